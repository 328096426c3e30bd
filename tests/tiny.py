"""Build tiny random Gemma 4 target + assistant checkpoints (HF folder layout)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

FIXTURES = Path(__file__).parent / "fixtures" / "hf_gemma4"


def _save(path: Path, config: dict, weights: dict, tokenizer_from: Path | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    src = tokenizer_from or FIXTURES / "tokenizer"
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, path / f)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 1, "bos_token_id": 2, "pad_token_id": 0}))
    return path


def random_pair(root: Path, seed: int, like: str = "e", centroid: bool | None = None) -> tuple[Path, Path]:
    """A random target with pair ``like``'s geometry and a random assistant
    (centroid head for ``e``, dense for ``d`` unless ``centroid`` says otherwise)."""
    from mlx_lm.models import gemma4_text

    from mtpflow.drafters.gemma4_assistant.config import AssistantConfig
    from mtpflow.drafters.gemma4_assistant.heads import CentroidHead, TiedDenseHead
    from mtpflow.drafters.gemma4_assistant.model import Gemma4AssistantModel
    from mtpflow.targets.gemma4 import text_config

    mx.random.seed(seed)
    rng = np.random.default_rng(seed)
    tcfg = json.loads((FIXTURES / f"pair_{like}" / "target" / "config.json").read_text())
    model = gemma4_text.Model(gemma4_text.ModelArgs.from_dict(text_config(tcfg)))
    w = dict(tree_flatten(model.parameters()))
    out = {}
    for k, v in w.items():
        if "switch_glu" in k:
            continue
        if k.endswith("norm.weight") or k.endswith("layer_scalar") or k.endswith("router.scale") or k.endswith("per_expert_scale"):
            v = mx.array(rng.uniform(0.6, 1.4, v.shape).astype(np.float32))
        elif k.endswith("embed_tokens.weight"):
            v = v * 3.0  # spread the logits: no near-ties
        out[k] = v
    if tcfg.get("enable_moe_block"):
        n, E, I, D = tcfg["num_hidden_layers"], tcfg["num_experts"], tcfg["moe_intermediate_size"], tcfg["hidden_size"]
        for i in range(n):
            out[f"model.layers.{i}.experts.gate_up_proj"] = mx.array(rng.normal(0, D**-0.5, (E, 2 * I, D)).astype(np.float32))
            out[f"model.layers.{i}.experts.down_proj"] = mx.array(rng.normal(0, I**-0.5, (E, D, I)).astype(np.float32))
    tpath = _save(root / f"target_{like}_{seed}", tcfg, out)

    dcfg = json.loads((FIXTURES / f"pair_{like}" / "drafter" / "config.json").read_text())
    if centroid is not None:
        dcfg["use_ordered_embeddings"] = centroid
        dcfg.setdefault("num_centroids", 64)
        dcfg.setdefault("centroid_intermediate_top_k", 8)
    acfg = AssistantConfig.from_dict(dcfg)
    head = CentroidHead if acfg.use_ordered_embeddings else TiedDenseHead
    dm = Gemma4AssistantModel(acfg, head)
    dw = {}
    for k, v in tree_flatten(dm.parameters()):
        if k.endswith("norm.weight") or k.endswith("layer_scalar"):
            v = mx.array(rng.uniform(0.6, 1.4, v.shape).astype(np.float32))
        dw[k] = v
    if acfg.use_ordered_embeddings:
        dw["masked_embedding.token_ordering"] = mx.array(rng.permutation(acfg.text["vocab_size"]).astype(np.int64))
    dpath = _save(root / f"drafter_{like}_{seed}", dcfg, dw)
    return tpath, dpath


def as_multimodal(target: Path, out: Path) -> Path:
    """Re-save a ``gemma4_text`` checkpoint as a multimodal ``gemma4`` one
    (weights under ``model.language_model.``, plus a vision tower to ignore)."""
    cfg = json.loads((target / "config.json").read_text())
    mm = {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"], "text_config": cfg,
          "vocab_size": cfg["vocab_size"], "eos_token_id": cfg.get("eos_token_id")}
    w = mx.load(str(target / "model.safetensors"))
    w = {("model.language_model." + k[len("model."):]): v for k, v in w.items()}
    w["model.vision_tower.patch_embedder.weight"] = mx.zeros((4, 4))
    return _save(out, mm, w, tokenizer_from=target)


def as_per_layer_config(target: Path, out: Path) -> Path:
    """Re-save with transformers 5.24's ``per_layer_config`` serialisation."""
    cfg = json.loads((target / "config.json").read_text())
    per = {}
    for i, t in enumerate(cfg["layer_types"]):
        if t == "full_attention":
            spec = {"head_dim": cfg["global_head_dim"]}
            if cfg.get("attention_k_eq_v") and cfg.get("num_global_key_value_heads") is not None:
                spec["num_key_value_heads"] = cfg["num_global_key_value_heads"]
            per[str(i)] = spec
    cfg.pop("global_head_dim", None)
    cfg.pop("num_global_key_value_heads", None)
    cfg["per_layer_config"] = per
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(target / "model.safetensors", out / "model.safetensors")
    return _save(out, cfg, mx.load(str(target / "model.safetensors")), tokenizer_from=target)
