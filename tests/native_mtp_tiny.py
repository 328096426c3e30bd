"""Tiny random checkpoints in the native-MTP layouts (DeepSeek-V3, GLM-4 MoE, GLM-5).

The target's own layers are saved in mlx-lm's layout; the MTP layers
``model.layers.{N+i}.*`` in the Hugging Face layout (per-expert MLPs, MLA's
``kv_b_proj``), as real checkpoints ship them, so loading exercises the
family's ``sanitize``.  ``mix`` blends the head's fusion towards the hidden
half (a random head drafts almost nothing; a pass-through one drafts the
target's own next-token guess), so tests see accepted and rejected drafts.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 64, "moe_intermediate_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
    "n_shared_experts": 1, "n_routed_experts": 4, "routed_scaling_factor": 1.5,
    "kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 8, "v_head_dim": 16, "qk_nope_head_dim": 16,
    "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True, "n_group": 1, "topk_group": 1,
    "num_experts_per_tok": 2, "moe_layer_freq": 1, "first_k_dense_replace": 1, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "attention_bias": False, "tie_word_embeddings": False,
    "num_nextn_predict_layers": 1, "eos_token_id": 1, "bos_token_id": 0,
}

GLM_MOE_DSA = {
    **{k: v for k, v in DEEPSEEK_V3.items() if k not in ("rope_theta", "architectures")},
    "model_type": "glm_moe_dsa", "architectures": ["GlmMoeDsaForCausalLM"],
    "index_head_dim": 16, "index_n_heads": 2, "index_topk": 256,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
}

GLM4_MOE = {
    "model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"], "vocab_size": 128, "hidden_size": 64,
    "intermediate_size": 64, "max_position_embeddings": 512, "moe_intermediate_size": 32, "norm_topk_prob": True,
    "num_attention_heads": 4, "n_group": 1, "head_dim": 16, "topk_group": 1, "n_shared_experts": 1,
    "n_routed_experts": 4, "routed_scaling_factor": 1.5, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
    "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "rope_scaling": None, "use_qk_norm": True, "tie_word_embeddings": False, "attention_bias": True,
    "partial_rotary_factor": 0.5, "num_nextn_predict_layers": 1, "eos_token_id": 1,
}

GLM4_MOE_LITE = {
    **{k: v for k, v in DEEPSEEK_V3.items() if k != "architectures"},
    "model_type": "glm4_moe_lite", "architectures": ["Glm4MoeLiteForCausalLM"], "partial_rotary_factor": 1.0,
}


def _hf_mtp_layer(model_layer, prefix: str, cfg: dict, rng) -> dict:
    """A decoder layer's mlx tensors back in the HF layout (experts one by one, kv_b_proj)."""
    out = {}
    for k, v in tree_flatten(model_layer.parameters()):
        if ".switch_mlp." in k:
            base, proj_w = k.split(".switch_mlp.")
            proj = proj_w.split(".")[0]
            for e in range(v.shape[0]):
                out[f"{prefix}{base}.experts.{e}.{proj}.weight"] = v[e]
        elif k.endswith("embed_q.weight") or k.endswith("unembed_out.weight"):
            continue
        else:
            out[prefix + k] = v
    attn = getattr(model_layer, "self_attn", None)
    if attn is not None and "embed_q" in attn:
        wk = attn.embed_q.weight.swapaxes(-1, -2)  # [heads, nope, rank]
        wv = attn.unembed_out.weight  # [heads, v, rank]
        out[prefix + "self_attn.kv_b_proj.weight"] = mx.concatenate([wk, wv], axis=1).reshape(-1, wk.shape[-1])
    return out


def make_checkpoint(root: Path, seed: int = 0, config: dict | None = None, depth: int = 1, mix: float = 0.9,
                    strip: bool = False, residual: float = 4.0, half: str = "hidden",
                    block_scale: float = 0.05, tokenizer: Path | None = None) -> Path:
    from mlx_lm.utils import _get_classes

    cfg = dict(config or DEEPSEEK_V3)
    cfg["num_nextn_predict_layers"] = depth
    mx.random.seed(seed)
    rng = np.random.default_rng(seed)
    model_cls, args_cls = _get_classes(cfg)
    n = cfg["num_hidden_layers"]
    big = dict(cfg, num_hidden_layers=n + depth)
    model = model_cls(args_cls.from_dict(big))
    w = {}
    for k, v in tree_flatten(model.parameters()):
        if k.endswith("norm.weight") or k.endswith("layernorm.weight"):
            v = mx.array(rng.uniform(0.7, 1.3, v.shape).astype(np.float32))
        elif k.endswith("o_proj.weight") or k.endswith("down_proj.weight"):
            v = v * residual
        elif k.endswith("embed_tokens.weight"):
            v = v * 3.0
        elif "e_score_correction_bias" in k:
            v = mx.array(rng.normal(0, 0.1, v.shape).astype(np.float32))
        w[k] = v
    out = {k: v for k, v in w.items() if not any(k.startswith(f"model.layers.{n + i}.") for i in range(depth))}
    H = cfg["hidden_size"]
    for i in range(depth):
        pre = f"model.layers.{n + i}."
        out.update(_hf_mtp_layer(model.model.layers[n + i], pre, cfg, rng))
        out[pre + "enorm.weight"] = mx.array(rng.uniform(0.7, 1.3, (H,)).astype(np.float32))
        out[pre + "hnorm.weight"] = mx.array(rng.uniform(0.7, 1.3, (H,)).astype(np.float32))
        out[pre + "shared_head.norm.weight"] = mx.array(rng.uniform(0.7, 1.3, (H,)).astype(np.float32))
        eh = rng.normal(0, (2 * H) ** -0.5, (H, 2 * H)).astype(np.float32) * (1 - mix)
        (eh[:, H:] if half == "hidden" else eh[:, :H])[:] += mix * np.eye(H, dtype=np.float32)
        out[pre + "eh_proj.weight"] = mx.array(eh)
        if cfg["model_type"] == "deepseek_v3":  # DeepSeek-V3 ships copies of the embedding and head (GLM-5 does not)
            out[pre + "embed_tokens.weight"] = w["model.embed_tokens.weight"]
            out[pre + "shared_head.head.weight"] = w["lm_head.weight"]
        for k in list(out):
            if k.startswith(pre) and (k.endswith("o_proj.weight") or k.endswith("down_proj.weight")):
                out[k] = out[k] * block_scale  # a near pass-through block
    if strip:
        out = {k: v for k, v in out.items() if not any(k.startswith(f"model.layers.{n + i}.") for i in range(depth))}
    path = Path(root) / f"{cfg['model_type']}_{seed}_d{depth}{'_stripped' if strip else ''}_{half}{residual}"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    mx.save_safetensors(str(path / "model.safetensors"), out)
    if tokenizer is not None:  # a tokenizer folder (its vocabulary must fit vocab_size)
        import shutil

        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(Path(tokenizer) / f, path / f)
    return path


def quantized_copy(src: Path, dst: Path, bits: int = 4, group_size: int = 32, mixed: bool = False) -> Path:
    """``src`` quantized as mlx-community publishes (``quantization`` in
    config.json, ``.scales`` / ``.biases``), its MTP layers kept, quantized too,
    in mlx-lm's layout (what a converter that kept them would write)."""
    import mlx.nn as nn

    from mtpflow.drafters.native_mtp.drafter import load_head
    from mtpflow.drafters.native_mtp.module import to_native
    from mtpflow.targets.deepseek import DeepseekTarget

    target = DeepseekTarget.from_path(src)
    cfg = json.loads((Path(src) / "config.json").read_text())
    _, head, _ = load_head(Path(src), target.model, "float32")

    def pred(p, m):
        return hasattr(m, "to_quantized") and m.weight.shape[-1] % group_size == 0 and "gate" not in p.split(".")[-1:]

    nn.quantize(target.model, group_size=group_size, bits=bits, class_predicate=pred)
    cfg["quantization"] = {"group_size": group_size, "bits": bits}
    if mixed:  # mlx-lm's mixed quantization: the head's eh_proj at 8 bits, named by checkpoint path
        head.layers[0].eh_proj = head.layers[0].eh_proj.to_quantized(group_size=group_size, bits=8)
        cfg["quantization"][f"model.layers.{cfg['num_hidden_layers']}.eh_proj"] = {"group_size": group_size, "bits": 8}
    nn.quantize(head, group_size=group_size, bits=bits, class_predicate=pred)
    w = dict(tree_flatten(target.model.parameters()))
    w.update(to_native(dict(tree_flatten(head.parameters())), cfg["num_hidden_layers"]))
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    mx.save_safetensors(str(dst / "model.safetensors"), w)
    return dst


def module_folder(src: Path, dst: Path) -> Path:
    """A trained-module folder in the loader contract's layout, cut from a
    checkpoint: its config.json and only its ``model.layers.{N+i}.*`` tensors
    (the head's own, without DeepSeek's copies of the embedding and LM head)."""
    cfg = json.loads((Path(src) / "config.json").read_text())
    n, d = cfg["num_hidden_layers"], cfg["num_nextn_predict_layers"]
    w = mx.load(str(Path(src) / "model.safetensors"))
    keep = {k: v for k, v in w.items()
            if any(k.startswith(f"model.layers.{n + i}.") for i in range(d))
            and ".embed_tokens." not in k and ".shared_head.head." not in k}
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    mx.save_safetensors(str(dst / "model.safetensors"), keep)
    return dst
