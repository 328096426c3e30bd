"""Build tiny random hybrid-attention checkpoints in the real Hugging Face layouts.

* ``qwen3_5``: ``Qwen3_5ForConditionalGeneration`` -- the text config inside
  ``text_config`` (``model_type: qwen3_5_text``), ``layer_types`` and
  ``full_attention_interval``, the ``linear_*`` Gated DeltaNet fields, weights
  under ``model.language_model.*`` (``linear_attn.in_proj_qkv / in_proj_z /
  in_proj_b / in_proj_a``, ``conv1d.weight [C, 1, K]``), a stub vision tower
  under ``model.visual.*``, RMSNorm weights stored zero-centred (``1 + w``;
  the gated norm of the linear layers is not);
* ``qwen3_5_moe``: the same with a sparse MoE block in every layer (experts
  fused: ``mlp.experts.gate_up_proj [E, 2I, D]`` / ``down_proj [E, D, I]``);
* ``qwen3_next``: the flat Qwen3-Next config, ``model.layers.*`` with
  ``in_proj_qkvz`` / ``in_proj_ba`` and one tensor per expert.

``mtp=True`` adds the checkpoint's multi-token-prediction head as the real
checkpoints ship it: ``mtp.fc [D, 2D]``, ``mtp.pre_fc_norm_embedding``,
``mtp.pre_fc_norm_hidden``, ``mtp.layers.<i>.*`` (a full-attention decoder
layer, the MLP in the main layers' layout), ``mtp.norm``, with
``mtp_num_hidden_layers`` in the text config; its norms are zero-centred too.

The vocabulary is the 2048-word tokenizer of ``fixtures/hf_gemma4/tokenizer``
(shared with the DFlash fixture's Qwen3 target, which can draft for these).
Residual branches are scaled up so that greedy text is varied; every
checkpoint is loaded through mlx-lm's own ``sanitize``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np

TOKENIZER = Path(__file__).parent / "fixtures" / "hf_gemma4" / "tokenizer"

def text_config(family: str = "qwen3_5", layers: int = 6, interval: int = 3, mtp_layers: int = 1,
                hidden: int = 64, vocab: int = 2048) -> dict:
    """The text config of a tiny checkpoint of ``family`` (HF field names)."""
    types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    tc = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 128,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attn_output_gate": True,
        "full_attention_interval": interval,
        "layer_types": types,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "mtp_num_hidden_layers": mtp_layers,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": [1, 1, 0], "mrope_interleaved": True},
        "eos_token_id": 1,
        "bos_token_id": 2,
        "pad_token_id": 0,
    }
    if family in ("qwen3_5_moe", "qwen3_next"):
        tc.update({"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 64, "norm_topk_prob": True, "decoder_sparse_step": 1,
                   "mlp_only_layers": []})
    if family == "qwen3_next":
        tc.update({"rope_theta": 10000.0, "partial_rotary_factor": 0.25})
        tc.pop("rope_parameters")
    return tc


def config(family: str = "qwen3_5", **kw) -> dict:
    """The whole ``config.json`` of a tiny checkpoint of ``family``."""
    tc = text_config(family, **kw)
    if family == "qwen3_next":
        return {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", **tc}
    arch = {"qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}[family]
    tc["model_type"] = family + "_text"
    return {
        "architectures": [arch],
        "model_type": family,
        "text_config": tc,
        "vision_config": {"depth": 1, "hidden_size": 16, "out_hidden_size": 64, "model_type": family},
        "image_token_id": 2040,
        "tie_word_embeddings": False,
        "eos_token_id": 1,
    }


def _mlx_model(family: str, cfg: dict):
    from mlx_lm.models import qwen3_5, qwen3_5_moe, qwen3_next

    mod = {"qwen3_5": qwen3_5, "qwen3_5_moe": qwen3_5_moe, "qwen3_next": qwen3_next}[family]
    return mod.Model(mod.ModelArgs.from_dict(cfg))


def _rand(rng, shape, scale):
    return mx.array(rng.normal(0.0, scale, shape).astype(np.float32))


def _decoder_layer(rng, prefix: str, tc: dict, linear: bool, residual: float) -> dict:
    """HF tensors of one decoder layer (``prefix`` ends with a dot)."""
    D, nh, kvh, hd = tc["hidden_size"], tc["num_attention_heads"], tc["num_key_value_heads"], tc["head_dim"]
    out = {}
    if linear:
        nk, nv, dk, dv, K = (tc["linear_num_key_heads"], tc["linear_num_value_heads"], tc["linear_key_head_dim"],
                             tc["linear_value_head_dim"], tc["linear_conv_kernel_dim"])
        kd, vd = nk * dk, nv * dv
        a = prefix + "linear_attn."
        if tc.get("model_type") == "qwen3_next":
            out[a + "in_proj_qkvz.weight"] = _rand(rng, (2 * kd + 2 * vd, D), D**-0.5)
            out[a + "in_proj_ba.weight"] = _rand(rng, (2 * nv, D), D**-0.5)
        else:
            out[a + "in_proj_qkv.weight"] = _rand(rng, (2 * kd + vd, D), D**-0.5)
            out[a + "in_proj_z.weight"] = _rand(rng, (vd, D), D**-0.5)
            out[a + "in_proj_b.weight"] = _rand(rng, (nv, D), D**-0.5)
            out[a + "in_proj_a.weight"] = _rand(rng, (nv, D), D**-0.5)
        out[a + "conv1d.weight"] = _rand(rng, (2 * kd + vd, 1, K), K**-0.5)  # HF Conv1d layout
        out[a + "A_log"] = mx.array(np.log(rng.uniform(1.0, 16.0, nv)).astype(np.float32))
        out[a + "dt_bias"] = mx.array(rng.uniform(-1.0, 1.0, nv).astype(np.float32))
        out[a + "norm.weight"] = mx.array(rng.uniform(0.6, 1.4, dv).astype(np.float32))  # not zero-centred
        out[a + "out_proj.weight"] = _rand(rng, (D, vd), residual * vd**-0.5)
    else:
        a = prefix + "self_attn."
        out[a + "q_proj.weight"] = _rand(rng, (2 * nh * hd, D), D**-0.5)  # queries and the output gate
        out[a + "k_proj.weight"] = _rand(rng, (kvh * hd, D), D**-0.5)
        out[a + "v_proj.weight"] = _rand(rng, (kvh * hd, D), D**-0.5)
        out[a + "o_proj.weight"] = _rand(rng, (D, nh * hd), residual * (nh * hd) ** -0.5)
        out[a + "q_norm.weight"] = mx.array(rng.uniform(-0.4, 0.4, hd).astype(np.float32))
        out[a + "k_norm.weight"] = mx.array(rng.uniform(-0.4, 0.4, hd).astype(np.float32))
    m = prefix + "mlp."
    if tc.get("num_experts"):
        E, I, S = tc["num_experts"], tc["moe_intermediate_size"], tc["shared_expert_intermediate_size"]
        out[m + "gate.weight"] = _rand(rng, (E, D), D**-0.5)
        if tc.get("model_type") == "qwen3_next":
            for e in range(E):
                out[m + f"experts.{e}.gate_proj.weight"] = _rand(rng, (I, D), D**-0.5)
                out[m + f"experts.{e}.up_proj.weight"] = _rand(rng, (I, D), D**-0.5)
                out[m + f"experts.{e}.down_proj.weight"] = _rand(rng, (D, I), residual * I**-0.5)
        else:
            out[m + "experts.gate_up_proj"] = _rand(rng, (E, 2 * I, D), D**-0.5)
            out[m + "experts.down_proj"] = _rand(rng, (E, D, I), residual * I**-0.5)
        out[m + "shared_expert.gate_proj.weight"] = _rand(rng, (S, D), D**-0.5)
        out[m + "shared_expert.up_proj.weight"] = _rand(rng, (S, D), D**-0.5)
        out[m + "shared_expert.down_proj.weight"] = _rand(rng, (D, S), residual * S**-0.5)
        out[m + "shared_expert_gate.weight"] = _rand(rng, (1, D), D**-0.5)
    else:
        I = tc["intermediate_size"]
        out[m + "gate_proj.weight"] = _rand(rng, (I, D), D**-0.5)
        out[m + "up_proj.weight"] = _rand(rng, (I, D), D**-0.5)
        out[m + "down_proj.weight"] = _rand(rng, (D, I), residual * I**-0.5)
    out[prefix + "input_layernorm.weight"] = mx.array(rng.uniform(-0.4, 0.4, D).astype(np.float32))
    out[prefix + "post_attention_layernorm.weight"] = mx.array(rng.uniform(-0.4, 0.4, D).astype(np.float32))
    return out


def mtp_weights(rng, tc: dict, residual: float = 2.0, copy: float = 0.0) -> dict:
    """The ``mtp.*`` tensors of a checkpoint with text config ``tc``.
    ``copy`` in [0, 1] blends ``mtp.fc`` towards passing the token embedding
    through (and weakens the block): on a target whose next token depends
    mostly on the current one (small ``residual`` in :func:`build`) the head
    then drafts the target's next-but-one token often, not always."""
    D = tc["hidden_size"]
    fc = np.asarray(_rand(rng, (D, 2 * D), (2 * D) ** -0.5))
    fc[:, :D] = (1 - copy) * fc[:, :D] + copy * np.eye(D, dtype=np.float32)
    fc[:, D:] *= 1 - copy
    residual = residual * (1 - copy) + 0.05 * copy
    out = {
        "mtp.fc.weight": mx.array(fc),
        "mtp.pre_fc_norm_embedding.weight": mx.array(rng.uniform(-0.4, 0.4, D).astype(np.float32)),
        "mtp.pre_fc_norm_hidden.weight": mx.array(rng.uniform(-0.4, 0.4, D).astype(np.float32)),
        "mtp.norm.weight": mx.array(rng.uniform(-0.4, 0.4, D).astype(np.float32)),
    }
    for i in range(tc.get("mtp_num_hidden_layers", 1)):
        out.update(_decoder_layer(rng, f"mtp.layers.{i}.", tc, linear=False, residual=residual))
    return out


def build(root: Path, family: str = "qwen3_5", seed: int = 0, mtp: bool = False, residual: float = 2.0,
          embed_scale: float = 1.0, name: str | None = None, mtp_copy: float = 0.0, **kw) -> Path:
    """Write a tiny random ``family`` checkpoint (HF layout) under ``root``;
    returns its folder.  ``mtp``: also write the ``mtp.*`` head.  ``kw``:
    :func:`text_config` options (``layers``, ``interval``, ``mtp_layers``...)."""
    cfg = config(family, **kw)
    tc = cfg.get("text_config", cfg)
    rng = np.random.default_rng(seed)
    D, V = tc["hidden_size"], tc["vocab_size"]
    pre = "model." if family == "qwen3_next" else "model.language_model."
    w = {pre + "embed_tokens.weight": _rand(rng, (V, D), embed_scale),
         pre + "norm.weight": mx.array(rng.uniform(-0.4, 0.4, D).astype(np.float32)),
         "lm_head.weight": _rand(rng, (V, D), D**-0.5 * 6.0)}  # spread logits: no near-ties
    for i, t in enumerate(tc["layer_types"]):
        w.update(_decoder_layer(rng, f"{pre}layers.{i}.", tc | {"model_type": family}, t == "linear_attention", residual))
    if family != "qwen3_next":
        w["model.visual.patch_embed.proj.weight"] = mx.zeros((16, 3, 2, 2, 2))  # a stub tower to skip
    if mtp:
        w.update(mtp_weights(rng, tc | {"model_type": family}, residual, mtp_copy))
    path = Path(root) / (name or f"{family}_{seed}{'_mtp' if mtp else ''}")
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 1, "bos_token_id": 2, "pad_token_id": 0}))
    mx.save_safetensors(str(path / "model.safetensors"), w, metadata={"format": "pt"})
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / f, path / f)
    return path


def load_reference(path: Path):
    """mlx-lm's own model for a tiny checkpoint (``mlx_lm.utils.load_model``: its sanitize)."""
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(path))
    return model
