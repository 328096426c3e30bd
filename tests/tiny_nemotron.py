"""Build tiny random Nemotron-H checkpoints in the real Hugging Face layout.

``nemotron_h``: a flat config with ``hybrid_override_pattern`` (``M`` Mamba2,
``*`` attention, ``-`` MLP, ``E`` MoE), weights under ``backbone.*``
(``embeddings``, ``layers.<i>.norm``, ``layers.<i>.mixer.*``, ``norm_f``) and an
untied ``lm_head``.  A Mamba2 mixer has ``in_proj`` (gate, x/B/C, dt),
``conv1d.weight [C, 1, K]`` and its bias, ``A_log``, ``D``, ``dt_bias``, a gated
``norm`` and ``out_proj``; a MoE layer has a ``gate`` with
``e_score_correction_bias``, one tensor per expert (``experts.<e>.up_proj`` /
``down_proj``) and ``shared_experts``.

``mtp=True`` adds the multi-token-prediction module as the checkpoints ship it
(what mlx-vlm 0.7.10's ``nemotron_h_mtp`` reads): ``num_nextn_predict_layers: 1``
and ``mtp_hybrid_override_pattern`` (e.g. ``"*E"``) in the config, and
``mtp.layers.<j>.*`` blocks of that pattern, the first also holding ``enorm``,
``hnorm`` and ``eh_proj [H, 2H]``, the last ``final_layernorm``.  Norms are plain
RMSNorm weights (not zero-centred).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np

TOKENIZER = Path(__file__).parent / "fixtures" / "hf_gemma4" / "tokenizer"


def config(pattern: str = "M*M-*E", mtp_pattern: str = "*E", hidden: int = 64, vocab: int = 2048,
           mtp: bool = True) -> dict:
    cfg = {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 96,
        "num_hidden_layers": len(pattern),
        "hybrid_override_pattern": pattern,
        "max_position_embeddings": 1024,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "attention_bias": False,
        "mamba_num_heads": 4,
        "mamba_head_dim": 8,
        "mamba_proj_bias": False,
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "n_groups": 2,
        "mlp_bias": False,
        "layer_norm_epsilon": 1e-5,
        "use_bias": False,
        "use_conv_bias": True,
        "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 48,
        "n_group": 1,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "topk_group": 1,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "tie_word_embeddings": False,
        "eos_token_id": 1,
        "bos_token_id": 2,
        "pad_token_id": 0,
    }
    if mtp:
        cfg.update({"num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": mtp_pattern})
    return cfg


def _rand(rng, shape, scale):
    return mx.array(rng.normal(0.0, scale, shape).astype(np.float32))


def _norm(rng, n):
    return mx.array(rng.uniform(0.6, 1.4, n).astype(np.float32))


def _block(rng, prefix: str, cfg: dict, kind: str, residual: float) -> dict:
    """HF tensors of one block of type ``kind`` (``prefix`` ends with a dot)."""
    D = cfg["hidden_size"]
    m = prefix + "mixer."
    out = {prefix + "norm.weight": _norm(rng, D)}
    if kind == "M":
        H, Dh, G, N, K = cfg["mamba_num_heads"], cfg["mamba_head_dim"], cfg["n_groups"], cfg["ssm_state_size"], cfg["conv_kernel"]
        inner = H * Dh
        conv = inner + 2 * G * N
        out[m + "in_proj.weight"] = _rand(rng, (inner + conv + H, D), D**-0.5)
        out[m + "conv1d.weight"] = _rand(rng, (conv, 1, K), K**-0.5)  # HF Conv1d layout
        out[m + "conv1d.bias"] = _rand(rng, (conv,), 0.1)
        out[m + "A_log"] = mx.array(np.log(rng.uniform(1.0, 16.0, H)).astype(np.float32))
        out[m + "D"] = mx.array(rng.uniform(0.5, 1.5, H).astype(np.float32))
        out[m + "dt_bias"] = mx.array(rng.uniform(-1.0, 1.0, H).astype(np.float32))
        out[m + "norm.weight"] = _norm(rng, inner)
        out[m + "out_proj.weight"] = _rand(rng, (D, inner), residual * inner**-0.5)
    elif kind == "*":
        nh, kvh, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        out[m + "q_proj.weight"] = _rand(rng, (nh * hd, D), D**-0.5)
        out[m + "k_proj.weight"] = _rand(rng, (kvh * hd, D), D**-0.5)
        out[m + "v_proj.weight"] = _rand(rng, (kvh * hd, D), D**-0.5)
        out[m + "o_proj.weight"] = _rand(rng, (D, nh * hd), residual * (nh * hd) ** -0.5)
    elif kind == "-":
        I = cfg["intermediate_size"]
        out[m + "up_proj.weight"] = _rand(rng, (I, D), D**-0.5)
        out[m + "down_proj.weight"] = _rand(rng, (D, I), residual * I**-0.5)
    elif kind == "E":
        E, I, S = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["moe_shared_expert_intermediate_size"]
        out[m + "gate.weight"] = _rand(rng, (E, D), D**-0.5)
        out[m + "gate.e_score_correction_bias"] = _rand(rng, (E,), 0.1)
        for e in range(E):
            out[m + f"experts.{e}.up_proj.weight"] = _rand(rng, (I, D), D**-0.5)
            out[m + f"experts.{e}.down_proj.weight"] = _rand(rng, (D, I), residual * I**-0.5)
        out[m + "shared_experts.up_proj.weight"] = _rand(rng, (S, D), D**-0.5)
        out[m + "shared_experts.down_proj.weight"] = _rand(rng, (D, S), residual * S**-0.5)
    return out


def mtp_weights(rng, cfg: dict, residual: float = 2.0, copy: float = 0.0) -> dict:
    """The ``mtp.*`` tensors.  ``copy`` in [0, 1] blends ``eh_proj`` towards
    passing the token embedding through and weakens the blocks: on a target
    whose next token leans on the current one the head then drafts the
    next-but-one token often, not always."""
    D = cfg["hidden_size"]
    eh = np.asarray(_rand(rng, (D, 2 * D), (2 * D) ** -0.5))
    eh[:, :D] = (1 - copy) * eh[:, :D] + copy * np.eye(D, dtype=np.float32)
    eh[:, D:] *= 1 - copy
    residual = residual * (1 - copy) + 0.05 * copy
    pattern = cfg["mtp_hybrid_override_pattern"]
    out = {"mtp.layers.0.enorm.weight": _norm(rng, D), "mtp.layers.0.hnorm.weight": _norm(rng, D),
           "mtp.layers.0.eh_proj.weight": mx.array(eh),
           f"mtp.layers.{len(pattern) - 1}.final_layernorm.weight": _norm(rng, D)}
    for j, kind in enumerate(pattern):
        out.update(_block(rng, f"mtp.layers.{j}.", cfg, kind, residual))
    return out


def build(root: Path, seed: int = 0, mtp: bool = True, residual: float = 2.0, mtp_copy: float = 0.0,
          name: str | None = None, head_weights: bool = True, **kw) -> Path:
    """Write a tiny random Nemotron-H checkpoint under ``root``; returns its
    folder.  ``head_weights=False``: the config states the MTP head, the
    weights lack it (a converter dropped it).  ``kw``: :func:`config` options."""
    cfg = config(mtp=mtp, **kw)
    rng = np.random.default_rng(seed)
    D, V = cfg["hidden_size"], cfg["vocab_size"]
    w = {"backbone.embeddings.weight": _rand(rng, (V, D), 1.0),
         "backbone.norm_f.weight": _norm(rng, D),
         "lm_head.weight": _rand(rng, (V, D), D**-0.5 * 6.0)}  # spread logits: no near-ties
    for i, kind in enumerate(cfg["hybrid_override_pattern"]):
        w.update(_block(rng, f"backbone.layers.{i}.", cfg, kind, residual))
    if mtp and head_weights:
        w.update(mtp_weights(rng, cfg, residual, mtp_copy))
    path = Path(root) / (name or f"nemotron_h_{seed}{'_mtp' if mtp else ''}")
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 1, "bos_token_id": 2, "pad_token_id": 0}))
    mx.save_safetensors(str(path / "model.safetensors"), w, metadata={"format": "pt"})
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / f, path / f)
    return path
