"""GGUF tensors to mlx-lm weights: HF tensor names, undoing llama.cpp's
converter transformations, and writing ``model.safetensors``.

``mlx`` is imported inside the function that writes the weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtpflow.convert.files import GGUFError

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np

    from mtpflow.convert.gguf_reader import GGUFFile

__all__ = ["hf_tensor_name", "unpermute_rope_rows"]

_LAYER_NAMES: dict[str, str] = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_NAMES: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def hf_tensor_name(gguf_name: str, arch: str) -> str:
    """Map a GGUF tensor name (``blk.3.attn_q.weight``) to its HF name."""
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias") or not stem:
        raise GGUFError(f"unexpected GGUF tensor name {gguf_name!r} for {arch}")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        kind = parts[2]
        if kind == "ffn_norm":
            # Gemma has separate pre/post FFN norms; llama/qwen2 only the pre one.
            mapped = "pre_feedforward_layernorm" if arch == "gemma3" else "post_attention_layernorm"
        else:
            mapped = _LAYER_NAMES.get(kind, "")
        if mapped:
            return f"model.layers.{parts[1]}.{mapped}.{suffix}"
    raise GGUFError(
        f"GGUF tensor {gguf_name!r} has no mlx-lm equivalent for {arch}; "
        "this GGUF variant is not supported"
    )


def unpermute_rope_rows(weight: "np.ndarray", n_head: int) -> "np.ndarray":
    """Inverse of llama.cpp ``LlamaModel.permute`` (rows of q/k proj or bias)."""
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise GGUFError(f"cannot un-permute {rows} rows into {n_head} heads")
    rest = weight.shape[1:]
    return (
        weight.reshape(n_head, rows // n_head // 2, 2, *rest)
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _convert_tensor(
    name: str, data: "np.ndarray", arch: str, hparams: dict[str, Any]
) -> "np.ndarray":
    """Undo llama.cpp's converter transformations for one tensor."""
    if arch == "llama":
        if ".attn_q." in name:
            return unpermute_rope_rows(data, hparams["n_head"])
        if ".attn_k." in name:
            return unpermute_rope_rows(data, hparams["n_head_kv"])
    if arch == "gemma3" and name.endswith("norm.weight"):
        # llama.cpp stores Gemma RMSNorm weights as 1 + w; mlx-lm adds the 1.
        return data - 1.0
    return data


def _write_weights(
    reader: GGUFFile, arch: str, hp: dict[str, Any], out_dir: Path, dtype: str
) -> tuple[int, bool, bool]:
    """Write model.safetensors; return (vocab_size, tied, has_qkv_bias)."""
    import mlx.core as mx

    weights: dict[str, Any] = {}
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            raise GGUFError(
                "GGUF has rope_freqs (llama3-style rope scaling), which is not supported"
            )
        hf_name = hf_tensor_name(tensor.name, arch)
        data = _convert_tensor(tensor.name, reader.dequantize(tensor), arch, hp)
        weights[hf_name] = mx.array(data).astype(getattr(mx, dtype))
        mx.eval(weights[hf_name])
    if "model.embed_tokens.weight" not in weights:
        raise GGUFError("GGUF has no token_embd.weight; the file is incomplete")
    expected = 1 + 2 + hp["n_layer"]  # embed + norm + per-layer minimum
    if len(weights) < expected:
        raise GGUFError(f"GGUF has only {len(weights)} tensors; the file is incomplete")
    tied = "lm_head.weight" not in weights
    vocab_size = int(weights["model.embed_tokens.weight"].shape[0])
    has_bias = "model.layers.0.self_attn.q_proj.bias" in weights
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    return vocab_size, tied, has_bias
