"""Gemma 4 targets (``gemma4_text`` and multimodal ``gemma4``) on mlx-lm's model.

The model code is mlx-lm's ``gemma4_text``; this adapter only normalises the
config (both the Hub's flat ``global_head_dim`` and transformers'
``per_layer_config`` form), loads the language model alone (weights under
``model.`` or ``model.language_model.``), and exposes the post-norm hidden
state and the store layers' K/V.

A prompt with images or audio (a request's ``media``) is prefilled on its input embeddings, soft
tokens in place, built by mlx-vlm's towers (:mod:`mtpflow.targets.gemma4_media`, loaded on first
use; the ``vision`` extra); decoding rounds are the same for every row.
"""

from __future__ import annotations

import math
from pathlib import Path

import mlx.core as mx

from .base import FULL, SLIDING, TargetAdapter, TargetError, cast_floats, load_safetensors, read_config, read_eos_ids


def text_config(config: dict) -> dict:
    """The text config of a ``gemma4`` / ``gemma4_text`` config.json, with
    ``per_layer_config`` folded into the flat Hub fields."""
    tc = dict(config.get("text_config") or config)
    if "vocab_size" not in tc and "vocab_size" in config:
        tc["vocab_size"] = config["vocab_size"]
    per = tc.pop("per_layer_config", None)
    if per:
        types = tc["layer_types"]
        for i_str, spec in per.items():
            i = int(i_str)
            if types[i] != FULL:
                continue
            if "head_dim" in spec:
                tc["global_head_dim"] = spec["head_dim"]
            if "num_key_value_heads" in spec:
                tc["num_global_key_value_heads"] = spec["num_key_value_heads"]
    tc.setdefault("num_kv_shared_layers", 0)
    tc.setdefault("hidden_size_per_layer_input", 0)
    if not tc.get("global_head_dim"):
        tc["global_head_dim"] = tc.get("head_dim")
    tc["model_type"] = "gemma4_text"
    return tc


def store_layers(tc: dict) -> dict[str, int]:
    """For each layer type, the last layer before the KV-shared ones."""
    n = tc["num_hidden_layers"]
    first_shared = n - (tc.get("num_kv_shared_layers") or 0)
    out = {}
    for i in range(first_shared):
        out[tc["layer_types"][i]] = i
    return out


def head_geometry(tc: dict) -> dict[str, tuple[int, int]]:
    """``{layer_type: (kv_heads, head_dim)}`` of a normalised text config."""
    geo = {SLIDING: (tc["num_key_value_heads"], tc["head_dim"])}
    kvh = tc["num_key_value_heads"]
    if tc.get("attention_k_eq_v") and tc.get("num_global_key_value_heads") is not None:
        kvh = tc["num_global_key_value_heads"]
    geo[FULL] = (kvh, tc.get("global_head_dim") or tc["head_dim"])
    return geo


class Gemma4Target(TargetAdapter):
    model_types = ("gemma4_text", "gemma4", "gemma4_unified")

    def __init__(self, model, config: dict, path: Path):
        self.model = model  # mlx_lm gemma4_text.Model
        self.inner = model.model
        self.config = config
        self.tc = text_config(config)
        self.path = Path(path)
        self.hidden_size = self.tc["hidden_size"]
        self.vocab_size = self.tc["vocab_size"]
        self.sliding_window = self.tc.get("sliding_window")
        self.layer_types = list(model.args.layer_types)
        self.store_layers = store_layers(self.tc)
        self.softcap = self.tc.get("final_logit_softcapping")
        self.eos_ids = read_eos_ids(path, config)
        self._embed_scale = mx.array(math.sqrt(self.hidden_size), dtype=mx.float32)
        self._media = None

    # -- config-only facts (no weights): used by drafter checks -----------------------
    @classmethod
    def text_config(cls, config: dict) -> dict:
        return text_config(config)

    @classmethod
    def layer_types_of(cls, config: dict) -> list[str]:
        return list(text_config(config)["layer_types"])

    @classmethod
    def attention_geometry(cls, config: dict) -> dict:
        """``{layer_type: {num_attention_heads, num_key_value_heads, head_dim, scale, q_norm}}``
        (Gemma 4: unit attention scale, query norms, full layers with their own geometry)."""
        tc = text_config(config)
        geo = head_geometry(tc)
        return {
            t: {"num_attention_heads": tc["num_attention_heads"], "num_key_value_heads": geo[t][0],
                "head_dim": geo[t][1], "scale": 1.0, "q_norm": True}
            for t in sorted(set(tc["layer_types"]))
        }

    @classmethod
    def from_path(cls, path, config: dict | None = None, dtype: str | None = "float32") -> "Gemma4Target":
        from mlx.utils import tree_flatten
        from mlx_lm.models import gemma4_text

        path = Path(path)
        config = config or read_config(path)
        tc = text_config(config)
        weights = load_safetensors(path)
        lm = {}
        for k, v in weights.items():
            if k.startswith("model.language_model."):
                lm["model." + k[len("model.language_model.") :]] = v
            elif k.startswith("language_model.model."):
                lm["model." + k[len("language_model.model.") :]] = v
            elif k.startswith("model.") and not k.startswith(("model.vision", "model.audio", "model.embed_vision", "model.embed_audio")):
                lm[k] = v
            elif k.startswith("lm_head."):
                lm[k] = v
        args = gemma4_text.ModelArgs.from_dict(tc)
        model = gemma4_text.Model(args)
        quant = config.get("quantization") or tc.get("quantization")
        if quant:
            import mlx.nn as nn

            nn.quantize(
                model,
                group_size=quant["group_size"],
                bits=quant["bits"],
                class_predicate=lambda p, m: f"{p}.scales" in lm,
            )
        lm = model.sanitize(lm)
        if not quant:
            lm = cast_floats(lm, dtype)
        try:
            model.load_weights(list(lm.items()), strict=True)
        except ValueError as exc:
            raise TargetError(f"{path}: weights do not match config.json ({exc})") from None
        mx.eval(model.parameters())
        n = len(tree_flatten(model.parameters()))
        if n == 0:  # pragma: no cover
            raise TargetError(f"{path}: no parameters loaded")
        return cls(model, config, path)

    @property
    def cache_layer_types(self) -> list[str]:
        first_shared = self.tc["num_hidden_layers"] - (self.tc.get("num_kv_shared_layers") or 0)
        return self.layer_types[:first_shared]

    def forward(self, tokens: mx.array, cache: list, inputs=None) -> mx.array:
        """Post-norm final hidden state ``[B, L, D]`` (cache offsets set by the caller).
        ``inputs``: ``(input embeddings [B, L, D], per-layer inputs or None)`` to use instead
        of the tokens' (mlx-vlm's convention: the embeddings are already scaled by sqrt(D))."""
        if inputs is None:
            return self.model.model(tokens, cache=cache)
        embeds, ple = inputs
        inner = self.inner
        scale, inner.embed_scale = inner.embed_scale, 1.0
        try:
            return inner(tokens, cache=cache, input_embeddings=embeds, per_layer_inputs=ple)
        finally:
            inner.embed_scale = scale

    # -- images and audio --------------------------------------------------------------
    @property
    def multimodal(self):
        """The towers / processor side (:class:`~mtpflow.targets.gemma4_media.Gemma4Media`)."""
        if self._media is None:
            from .gemma4_media import Gemma4Media

            self._media = Gemma4Media(self)
        return self._media

    def encode_media(self, text, images=(), audio=(), chat=None, system=None, max_tokens=0):
        """``(prompt ids, media)`` of a prompt with images / audio (see
        :func:`mtpflow.media.encode_prompt_with_media`)."""
        from ..media import MediaError

        if self.config.get("model_type") == "gemma4_text" or not (self.config.get("vision_config") or self.config.get("audio_config")):
            raise MediaError(f"{self.path}: this checkpoint has no vision or audio tower (no vision_config / audio_config); drop the images / audio")
        return self.multimodal.encode(text, images=images, audio=audio, chat=chat, system=system, max_tokens=max_tokens)

    def prefill(self, seqs, extra: int = 16, step: int = 512, pad_id: int = 0, taps=(), media=None):
        """The base prefill; rows with ``media`` (the rest may be ``None``) run on their input
        embeddings with the image / audio soft tokens in place."""
        if media is None or all(m is None for m in media):
            return super().prefill(seqs, extra=extra, step=step, pad_id=pad_id, taps=taps)
        if self.config.get("model_type") == "gemma4_text" or not (self.config.get("vision_config") or self.config.get("audio_config")):
            from ..media import MediaError

            raise MediaError(f"{self.path}: this checkpoint has no vision or audio tower; drop the images / audio")
        return self.multimodal.prefill(seqs, media, extra=extra, step=step, pad_id=pad_id, taps=taps)

    @property
    def lm_head_module(self):
        return None if self.model.tie_word_embeddings else self.model.lm_head

    def embed(self, tokens: mx.array) -> mx.array:
        e = self.model.model.embed_tokens(tokens)
        return e * self._embed_scale.astype(e.dtype)
