"""Targets for other mlx-lm architectures (llama, qwen2, qwen3, mistral, gemma3).

mlx-lm's own model code runs unchanged on :class:`SlotKVCache`; this adapter
only knows, per architecture, where the decoder body and the embedding are,
how the input embedding is scaled and which layers use sliding attention.
A third party adds another architecture by registering a subclass through
``mtpflow_register_targets``.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from .base import FULL, SLIDING, TargetAdapter, TargetError, read_config, read_eos_ids


def layer_types_of(config: dict) -> list[str]:
    """Attention type per layer, from ``layer_types`` or Gemma 3's pattern."""
    n = config["num_hidden_layers"]
    if config.get("layer_types"):
        return list(config["layer_types"])
    if config.get("model_type", "").startswith("gemma3"):
        pattern = config.get("sliding_window_pattern", 6)
        return [FULL if i % pattern == pattern - 1 else SLIDING for i in range(n)]
    if config.get("use_sliding_window") and config.get("sliding_window"):
        return [SLIDING] * n
    return [FULL] * n


class MLXLMTarget(TargetAdapter):
    model_types = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma3")

    def __init__(self, model, config: dict, path: Path):
        self.model = model
        self.config = config
        self.tc = dict(config.get("text_config") or config)
        self.tc.setdefault("model_type", config.get("model_type"))
        self.path = Path(path)
        self.inner = model.language_model.model if hasattr(model, "language_model") else model.model
        self.head_owner = model.language_model if hasattr(model, "language_model") else model
        self.hidden_size = self.tc["hidden_size"]
        self.vocab_size = self.tc.get("vocab_size") or config.get("vocab_size")
        self.layer_types = layer_types_of(self.tc)
        self.sliding_window = self.tc.get("sliding_window") if SLIDING in self.layer_types else None
        self.store_layers = {t: max(i for i, lt in enumerate(self.layer_types) if lt == t) for t in set(self.layer_types)}
        self.eos_ids = read_eos_ids(path, config)
        gemma = str(self.tc.get("model_type", "")).startswith("gemma")
        # Gemma scales the input embedding by sqrt(D), rounded to bf16 as the model does
        self._embed_scale = mx.array(self.hidden_size**0.5, mx.bfloat16) if gemma else None
        self.softcap = self.tc.get("final_logit_softcapping")

    @classmethod
    def from_path(cls, path, config: dict | None = None, dtype: str | None = "float32") -> "MLXLMTarget":
        from mlx_lm.utils import load_model

        path = Path(path)
        config = config or read_config(path)
        try:
            model, _ = load_model(path)
        except FileNotFoundError as exc:
            raise TargetError(f"{path}: {exc}; download the full checkpoint") from None
        except ValueError as exc:
            raise TargetError(f"{path}: cannot load the model ({exc})") from None
        if dtype and not (config.get("quantization") or config.get("quantization_config")):
            dt = getattr(mx, dtype)
            model.set_dtype(dt)
        mx.eval(model.parameters())
        return cls(model, config, path)

    def forward(self, tokens: mx.array, cache: list) -> mx.array:
        return self.inner(tokens, cache=cache)

    def logits(self, hidden: mx.array) -> mx.array:
        m = self.head_owner
        out = m.lm_head(hidden) if hasattr(m, "lm_head") and not getattr(m, "tie_word_embeddings", False) and "lm_head" in m else self.inner.embed_tokens.as_linear(hidden)
        if self.softcap:
            out = mx.tanh(out / self.softcap) * self.softcap
        return out

    def embed(self, tokens: mx.array) -> mx.array:
        e = self.inner.embed_tokens(tokens)
        if self._embed_scale is not None:
            e = e * self._embed_scale.astype(e.dtype)
        return e
