"""Write EAGLE-3 drafters as Speculators checkpoints (what vLLM serves).

:func:`save_speculators` writes ``config.json`` + ``model.safetensors`` in the
format ``speculators`` itself saves (``speculators_model_type: "eagle3"``,
``transformer_layer_config``, ``layers.0.*``, ``d2t`` offsets, ``t2d`` mask),
so a drafter trained or loaded by mtpflow -- including a SpecForge export --
can be served by vLLM (``--speculative-config '{"method": "eagle3", "model":
OUT}'``) or SGLang.  :func:`new_config` makes the config of a fresh drafter
for a target (training, tests).
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import mlx.core as mx
from mlx.utils import tree_flatten

from .config import Eagle3Config, default_aux_layer_ids


def new_config(target, *, aux_layer_ids=None, draft_vocab_size: int | None = None, intermediate_size: int | None = None,
               sliding_window: int | None = None, norm_before_residual: bool = True, norm_before_fc: bool = True,
               norm_output: bool = True) -> Eagle3Config:
    """The config of a fresh EAGLE-3 head for ``target`` (an adapter): the
    target's width and attention geometry, ``speculators train``'s flags by
    default."""
    tc = type(target).text_config(target.config)
    n = int(tc["num_hidden_layers"])
    geo = next(iter(type(target).attention_geometry(target.config).values()))
    rp = dict(tc.get("rope_parameters") or {})
    rp = dict(rp.get("full_attention", rp))  # Gemma 4 keeps one table per layer type
    rp.setdefault("rope_theta", float(tc.get("rope_theta", 10000.0)))
    rp.setdefault("rope_type", "default")
    return Eagle3Config(
        format="speculators",
        hidden_size=target.hidden_size,
        target_hidden_size=target.hidden_size,
        vocab_size=target.vocab_size,
        draft_vocab_size=draft_vocab_size or target.vocab_size,
        num_attention_heads=geo["num_attention_heads"],
        num_key_value_heads=geo["num_key_value_heads"],
        head_dim=geo["head_dim"],
        intermediate_size=intermediate_size or int(tc.get("intermediate_size") or 4 * target.hidden_size),
        rms_norm_eps=float(tc.get("rms_norm_eps", 1e-6)),
        rope=rp,
        max_position_embeddings=int(tc.get("max_position_embeddings", 4096)),
        sliding_window=sliding_window,
        aux_layer_ids=tuple(aux_layer_ids or default_aux_layer_ids(n)),
        norm_before_residual=norm_before_residual,
        norm_before_fc=norm_before_fc,
        fc_norm=False,
        norm_output=norm_output,
        qk_norm=False,
        verifier_architectures=tuple(target.config.get("architectures") or ()),
    )


def speculators_config(cfg: Eagle3Config, verifier_name: str | None = None, speculative_tokens: int = 3) -> dict:
    layer = {
        "model_type": "qwen3" if cfg.qk_norm else "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": dict(cfg.rope),
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }
    if cfg.sliding_window:
        layer.update(layer_types=["sliding_attention"], sliding_window=cfg.sliding_window, use_sliding_window=True)
    return {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0",
        "draft_vocab_size": cfg.draft_vocab_size,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        "target_hidden_size": cfg.target_hidden_size,
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"architectures": list(cfg.verifier_architectures), "name_or_path": verifier_name},
        },
        "transformer_layer_config": layer,
        "torch_dtype": "float32",
    }


def save_speculators(model, cfg: Eagle3Config, out, *, embed=None, verifier_name: str | None = None,
                     speculative_tokens: int = 3, dtype: str | None = None) -> Path:
    """Write ``model`` (an :class:`~.model.Eagle3Model`) as a Speculators
    checkpoint.  ``embed``: the embedding table to save when the model has
    none of its own (speculators keeps a frozen copy of the verifier's)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    weights.update({"d2t": model.d2t.astype(mx.int64)})
    if "t2d" in model:
        weights["t2d"] = model.t2d
    else:  # the mask of the target ids the head can draft
        import numpy as np

        mask = np.zeros(cfg.vocab_size, dtype=bool)
        mask[np.arange(cfg.draft_vocab_size) + np.array(model.d2t)] = True
        weights["t2d"] = mx.array(mask)
    if "embed_tokens.weight" not in weights and embed is not None:
        weights["embed_tokens.weight"] = embed
    if dtype:
        dt = getattr(mx, dtype)
        weights = {k: v.astype(dt) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    conf = speculators_config(attrs.evolve(cfg, format="speculators"), verifier_name, speculative_tokens)
    if dtype:
        conf["torch_dtype"] = dtype
    (out / "config.json").write_text(json.dumps(conf, indent=2))
    return out


#: formats ``mtpflow export`` writes for this kind (:mod:`mtpflow.export`)
FORMATS = ("speculators",)


def export_drafter(session, out, fmt: str = "speculators", *, verifier_name: str | None = None,
                   speculative_tokens: int = 3, dtype: str | None = None) -> Path:
    """``mtpflow export`` of a loaded EAGLE-3 drafter: a Speculators checkpoint."""
    d = session.drafter
    cfg = d.cfg
    if not cfg.verifier_architectures:  # e.g. a SpecForge export: record the target it was loaded with
        cfg = attrs.evolve(cfg, verifier_architectures=tuple(session.target.config.get("architectures") or ()))
    embed = None if "embed_tokens" in d.model else session.target.embed_table.weight
    return save_speculators(d.model, cfg, out, embed=embed, verifier_name=verifier_name,
                            speculative_tokens=speculative_tokens, dtype=dtype)
