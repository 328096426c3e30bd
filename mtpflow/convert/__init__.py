"""Model format converters (GGUF -> mlx-lm model folder).

Importing this package is cheap; the heavy work lives in
:mod:`mtpflow.convert.gguf`, which imports ``gguf``/``mlx`` lazily.
"""

from __future__ import annotations

__all__ = ["GGUF_SUPPORTED_ARCHS"]

#: GGUF ``general.architecture`` values the converter understands.
GGUF_SUPPORTED_ARCHS: tuple[str, ...] = ("llama", "qwen2", "gemma3")
