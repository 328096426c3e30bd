"""The float dtype a run computes in.

``[model] dtype = "auto"`` (the default) is the checkpoint's own dtype on a
GPU (Metal, CUDA), where bf16 / fp16 weights halve the memory and the time a
token streams them, and float32 on the CPU, where MLX's CPU backend computes
half-precision products no faster and OpenBLAS (:mod:`.blas`) only speeds up
float32 ones.  The checkpoint's dtype is its ``config.json``'s ``torch_dtype``
/ ``dtype`` (top level or ``text_config``), else the float dtype of its first
safetensors tensor (read from the file header, no weights).  Quantized weights
stay quantized whatever the dtype; drafters follow the target's resolved dtype.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

FLOAT_DTYPES = ("float32", "float16", "bfloat16")
_SAFETENSORS = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_ALIASES = {"float32": "float32", "fp32": "float32", "float": "float32", "float16": "float16", "fp16": "float16",
            "half": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16"}


def config_dtype(config: dict) -> str | None:
    """The float dtype a ``config.json`` names (``torch_dtype`` or ``dtype``, top level or text_config)."""
    for c in (config, config.get("text_config") or {}):
        for key in ("torch_dtype", "dtype"):
            v = c.get(key)
            if isinstance(v, str):
                v = _ALIASES.get(v.removeprefix("torch.").lower())
                if v is not None:
                    return v
    return None


def weights_dtype(path) -> str | None:
    """The float dtype of the first floating tensor in a folder's safetensors (header only)."""
    for f in sorted(Path(path).glob("*.safetensors")):
        try:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
        except (OSError, ValueError, struct.error):
            continue
        for name, info in header.items():
            if name != "__metadata__" and info.get("dtype") in _SAFETENSORS:
                return _SAFETENSORS[info["dtype"]]
    return None


def checkpoint_dtype(path, config: dict | None = None) -> str | None:
    """The checkpoint's own float dtype: its config's, else its weights'."""
    if config is None:
        p = Path(path) / "config.json"
        config = json.loads(p.read_text()) if p.is_file() else {}
    return config_dtype(config) or weights_dtype(path)


def resolve_dtype(setting: str | None, path=None, config: dict | None = None) -> str:
    """The dtype a ``[model] dtype`` setting runs: an explicit float dtype as
    given; ``"auto"`` / unset: float32 on a CPU device, else the checkpoint's
    own dtype (float32 when it names none)."""
    if setting and setting != "auto":
        if setting not in FLOAT_DTYPES:
            raise ValueError(f"dtype {setting!r}: use auto, {', '.join(FLOAT_DTYPES)}")
        return setting
    from .profiles import device_kind

    if device_kind() == "cpu":
        return "float32"
    return (checkpoint_dtype(path, config) if path is not None else None) or "float32"


def quantization(config: dict) -> dict | None:
    """The checkpoint's quantization settings (mlx's ``quantization`` / HF ``quantization_config``), or None."""
    tc = config.get("text_config") or {}
    return config.get("quantization") or config.get("quantization_config") or tc.get("quantization")


def describe(dtype: str, config: dict) -> str:
    """What the stats line says ran: ``"bfloat16"``, or ``"4-bit + bfloat16"`` for quantized weights."""
    q = quantization(config)
    bits = q.get("bits") if isinstance(q, dict) else None
    return f"{bits}-bit + {dtype}" if bits else dtype


def ran_dtype(target, config: dict, resolved: str) -> str:
    """What a loaded target computes in: its final norm's dtype (cast with the
    floats, never quantized), described with the weights' quantization."""
    norm = getattr(getattr(target, "inner", None), "norm", None)
    w = getattr(norm, "weight", None)
    name = str(w.dtype).removeprefix("mlx.core.") if w is not None else resolved
    return describe(name if name in FLOAT_DTYPES else resolved, config)
