"""GGUF metadata to an HF / mlx-lm ``config.json`` (hyper-parameters, RoPE
scaling, Gemma's sliding-window layout)."""

from __future__ import annotations

from typing import Any

from mtpflow.convert.files import GGUFError


def _get(meta: dict[str, Any], arch: str, key: str, default: Any = None) -> Any:
    value = meta.get(f"{arch}.{key}", default)
    if isinstance(value, list):  # per-layer arrays: require them uniform
        if len(set(value)) != 1:
            raise GGUFError(f"per-layer {arch}.{key} values are not supported")
        value = value[0]
    return value


def _require(meta: dict[str, Any], arch: str, key: str) -> Any:
    value = _get(meta, arch, key)
    if value is None:
        raise GGUFError(f"GGUF metadata {arch}.{key} is missing; the file is incomplete")
    return value


def _hparams(meta: dict[str, Any], arch: str) -> dict[str, Any]:
    n_embd = int(_require(meta, arch, "embedding_length"))
    n_head = int(_require(meta, arch, "attention.head_count"))
    head_dim = int(_get(meta, arch, "attention.key_length", n_embd // n_head))
    return {
        "n_embd": n_embd,
        "n_layer": int(_require(meta, arch, "block_count")),
        "n_ff": int(_require(meta, arch, "feed_forward_length")),
        "n_head": n_head,
        "n_head_kv": int(_get(meta, arch, "attention.head_count_kv", n_head)),
        "head_dim": head_dim,
        "eps": float(_require(meta, arch, "attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_get(meta, arch, "rope.freq_base", 10000.0)),
        "ctx": int(_get(meta, arch, "context_length", 4096)),
    }


def _rope_scaling(meta: dict[str, Any], arch: str) -> dict[str, Any] | None:
    kind = _get(meta, arch, "rope.scaling.type")
    factor = _get(meta, arch, "rope.scaling.factor")
    if kind in (None, "none") or not factor or float(factor) == 1.0:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    raise GGUFError(f"rope scaling {kind!r} in {arch} GGUF files is not supported")


def _sliding_window_pattern(meta: dict[str, Any], arch: str, n_layer: int) -> int:
    """Period of Gemma's local/global layers (every N-th layer is global).

    Older GGUFs omit it (Gemma 3 uses 6); newer ones may store an int or a
    per-layer list of booleans (True = sliding).
    """
    raw = meta.get(f"{arch}.attention.sliding_window_pattern", 6)
    if not isinstance(raw, list):
        return int(raw)
    flags = [bool(v) for v in raw]
    period = flags.index(False) + 1 if False in flags else n_layer + 1
    expected = [(i + 1) % period != 0 for i in range(len(flags))]
    if flags != expected:
        raise GGUFError(f"{arch} sliding-window layer layout {raw} is not periodic; unsupported")
    return period


def _build_config(
    meta: dict[str, Any],
    arch: str,
    hp: dict[str, Any],
    vocab_size: int,
    tied: bool,
    has_qkv_bias: bool,
    dtype: str,
) -> dict[str, Any]:
    """config.json contents for mlx-lm / transformers."""
    common: dict[str, Any] = {
        "hidden_size": hp["n_embd"],
        "num_hidden_layers": hp["n_layer"],
        "intermediate_size": hp["n_ff"],
        "num_attention_heads": hp["n_head"],
        "num_key_value_heads": hp["n_head_kv"],
        "head_dim": hp["head_dim"],
        "rms_norm_eps": hp["eps"],
        "vocab_size": vocab_size,
        "rope_theta": hp["rope_theta"],
        "max_position_embeddings": hp["ctx"],
        "tie_word_embeddings": tied,
        "rope_scaling": _rope_scaling(meta, arch),
        "torch_dtype": dtype,
    }
    if arch == "llama":
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            **common,
            "attention_bias": has_qkv_bias,
            "mlp_bias": False,
            "hidden_act": "silu",
        }
    if arch == "qwen2":
        return {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            **common,
            "hidden_act": "silu",
        }
    # gemma3 (text).  llama.cpp: 27B scales queries by 1/sqrt(n_embd/n_head),
    # the other sizes by 1/sqrt(head_dim); GGUF does not store the scalar.
    if hp["n_layer"] == 62:
        qscalar = hp["n_embd"] // hp["n_head"]
    else:
        qscalar = hp["head_dim"]
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        **common,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": qscalar,
        "sliding_window": int(_get(meta, arch, "attention.sliding_window", 512)),
        "sliding_window_pattern": _sliding_window_pattern(meta, arch, hp["n_layer"]),
        "rope_local_base_freq": 10000.0,
    }
