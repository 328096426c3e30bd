"""Targets for other mlx-lm architectures (llama, mistral, qwen2, qwen3, gemma3).

mlx-lm's own model code runs unchanged on :class:`SlotKVCache`; an adapter
only knows, per architecture, where the decoder body and the embedding are,
how the input embedding is scaled, which layers use sliding attention and the
attention geometry (for drafters that read the target's K/V).  Each
architecture difference is an attribute or a classmethod of its adapter
class; a third party adds another architecture by registering a subclass
through ``mtpflow_register_targets``.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from .base import FULL, SLIDING, TargetAdapter, TargetError, read_config, read_eos_ids


def _text(config: dict) -> dict:
    tc = dict(config.get("text_config") or config)
    tc.setdefault("model_type", config.get("model_type"))
    if "vocab_size" not in tc and "vocab_size" in config:
        tc["vocab_size"] = config["vocab_size"]
    return tc


class MLXLMTarget(TargetAdapter):
    """llama / mistral / qwen2 (and the base of the other mlx-lm adapters)."""

    model_types = ("llama", "mistral", "qwen2")
    #: the attention normalises queries per head (qwen3, gemma)
    q_norm = False
    #: the input embedding is scaled by sqrt(hidden size) (gemma)
    embed_scaled = False
    #: the mlx-lm model module (``mlx_lm.models.<name>``) that runs this
    #: architecture; ``None``: the one named by the config's ``model_type``
    mlx_lm_module: str | None = None

    def __init__(self, model, config: dict, path: Path):
        self.model = model
        self.config = config
        self.tc = _text(config)
        self.path = Path(path)
        self.inner = self.inner_of(model)
        self.head_owner = model.language_model if hasattr(model, "language_model") else model
        self.hidden_size = self.tc["hidden_size"]
        self.vocab_size = self.tc.get("vocab_size") or config.get("vocab_size")
        self.layer_types = self.layer_types_of(self.tc)
        self.sliding_window = self.tc.get("sliding_window") if SLIDING in self.layer_types else None
        self.store_layers = {t: max(i for i, lt in enumerate(self.layer_types) if lt == t) for t in set(self.layer_types)}
        self.eos_ids = read_eos_ids(path, config)
        # scaled by sqrt(D), rounded to bf16 as the model does
        self._embed_scale = mx.array(self.hidden_size**0.5, mx.bfloat16) if self.embed_scaled else None
        self.softcap = self.tc.get("final_logit_softcapping")

    @classmethod
    def inner_of(cls, model):
        """The decoder body (embedding, layers, final norm) of the mlx-lm model."""
        return model.language_model.model if hasattr(model, "language_model") else model.model

    # -- config-only facts (no weights): used by drafter checks -----------------------
    @classmethod
    def text_config(cls, config: dict) -> dict:
        """The flat text config (``text_config`` of a multimodal config, else itself)."""
        return _text(config)

    @classmethod
    def layer_types_of(cls, config: dict) -> list[str]:
        """Attention type per layer, from ``layer_types`` or ``use_sliding_window``."""
        tc = _text(config)
        n = tc["num_hidden_layers"]
        if tc.get("layer_types"):
            return list(tc["layer_types"])
        if tc.get("use_sliding_window") and tc.get("sliding_window"):
            return [SLIDING] * n
        return [FULL] * n

    @classmethod
    def attention_scale(cls, config: dict, head_dim: int) -> float:
        return head_dim**-0.5

    @classmethod
    def attention_geometry(cls, config: dict) -> dict:
        """``{layer_type: {num_attention_heads, num_key_value_heads, head_dim, scale, q_norm}}``."""
        tc = _text(config)
        nh = tc["num_attention_heads"]
        hd = tc.get("head_dim") or tc["hidden_size"] // nh
        kvh = tc.get("num_key_value_heads") or nh
        geo = {"num_attention_heads": nh, "num_key_value_heads": kvh, "head_dim": hd,
               "scale": cls.attention_scale(tc, hd), "q_norm": cls.q_norm}
        return {t: dict(geo) for t in sorted(set(cls.layer_types_of(tc)))}

    @classmethod
    def from_path(cls, path, config: dict | None = None, dtype: str | None = "float32") -> "MLXLMTarget":
        from mlx_lm.utils import load_model

        path = Path(path)
        config = config or read_config(path)
        try:
            model, _ = load_model(path, get_model_classes=cls._model_classes) if cls.mlx_lm_module else load_model(path)
        except FileNotFoundError as exc:
            raise TargetError(f"{path}: {exc}; download the full checkpoint") from None
        except ValueError as exc:
            raise TargetError(f"{path}: cannot load the model ({exc})") from None
        if dtype and not (config.get("quantization") or config.get("quantization_config")):
            dt = getattr(mx, dtype)
            model.set_dtype(dt)
        mx.eval(model.parameters())
        return cls(model, config, path)

    @classmethod
    def _model_classes(cls, config: dict):
        import importlib

        arch = importlib.import_module(f"mlx_lm.models.{cls.mlx_lm_module}")
        return arch.Model, arch.ModelArgs

    def forward(self, tokens: mx.array, cache: list) -> mx.array:
        return self.inner(tokens, cache=cache)

    @property
    def lm_head_module(self):
        m = self.head_owner
        untied = "lm_head" in m and not getattr(m, "tie_word_embeddings", False)
        return m.lm_head if untied else None

    def embed(self, tokens: mx.array) -> mx.array:
        e = self.inner.embed_tokens(tokens)
        if self._embed_scale is not None:
            e = e * self._embed_scale.astype(e.dtype)
        return e


class Qwen3Target(MLXLMTarget):
    model_types = ("qwen3",)
    q_norm = True


class Gemma3Target(MLXLMTarget):
    """Gemma 3: a sliding/full layer pattern, a scaled embedding, query norms
    and ``query_pre_attn_scalar``."""

    model_types = ("gemma3_text", "gemma3")
    q_norm = True
    embed_scaled = True

    @classmethod
    def layer_types_of(cls, config: dict) -> list[str]:
        tc = _text(config)
        if tc.get("layer_types"):
            return list(tc["layer_types"])
        pattern = tc.get("sliding_window_pattern", 6)
        return [FULL if i % pattern == pattern - 1 else SLIDING for i in range(tc["num_hidden_layers"])]

    @classmethod
    def attention_scale(cls, config: dict, head_dim: int) -> float:
        return (config.get("query_pre_attn_scalar") or head_dim) ** -0.5
