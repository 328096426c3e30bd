"""The family adapter interface (:class:`Family`) and the helpers every
adapter reads; the adapters themselves are listed in :mod:`.families`."""

from __future__ import annotations

import mlx.nn as nn

from ...targets.cache import SlotKVCache
from .module import MTPLayer, NativeMTP


def inner_model(model):
    """The decoder body (``embed_tokens``, ``layers``, ``norm``) of an mlx-lm model."""
    lm = getattr(model, "language_model", model)
    return lm.model


def text_config(config: dict) -> dict:
    tc = dict(config.get("text_config") or config)
    tc.setdefault("model_type", config.get("model_type"))
    return tc


class Family:
    """The interface a family adapter implements (class methods only).

    ``model_types``: the target ``model_type`` values it serves.
    ``depth_field``: the config field holding the number of MTP layers.
    ``caches_per_layer``: SlotKVCaches one MTP layer's attention keeps (2 for
    DeepSeek-V3.2 / GLM-5's sparse attention: the latent K/V and the indexer keys).
    ``plain_masks``: the block takes mlx-lm's ``None`` (one query) and
    ``"causal"`` masks as well as a boolean array; then, while the head's
    caches are dense (one row, no padding, no holes: ``RowCaches.dense``), the
    drafter passes those instead of building an array mask every step.

    * :meth:`depth` -- ``D`` from the (text) config;
    * :meth:`selects` -- whether a checkpoint tensor name belongs to the head
      (read straight from the safetensors: mlx-lm's ``sanitize`` drops them);
    * :meth:`expected` -- the tensor-name prefixes that must be present
      (for the "stripped by a converter" message);
    * :meth:`to_module` -- the head's checkpoint tensors under
      :class:`~.module.NativeMTP`'s names (``layers.i.{enorm,hnorm,eh_proj,
      shared_head.norm}``, ``layers.i.block.*``), with the family's own
      conversions (expert stacking, MLA splits, zero-centred norms ``1 + w``);
    * :meth:`make_block` -- the decoder block of layer ``i``: an instance of the
      family's mlx-lm decoder-layer class, called ``block(x, mask, cache)``;
    * :meth:`block_cache` -- what that block takes as ``cache`` from the
      layer's ``caches_per_layer`` SlotKVCaches.
    """

    model_types: tuple[str, ...] = ()
    depth_field = "num_nextn_predict_layers"
    caches_per_layer = 1
    plain_masks = False

    @classmethod
    def depth(cls, config: dict) -> int:
        return int(text_config(config).get(cls.depth_field) or 0)

    @classmethod
    def selects(cls, key: str, config: dict) -> bool:
        raise NotImplementedError

    @classmethod
    def expected(cls, config: dict) -> list[str]:
        raise NotImplementedError

    @classmethod
    def to_module(cls, weights: dict, config: dict, model) -> dict:
        raise NotImplementedError

    @classmethod
    def make_block(cls, model, config: dict, i: int) -> nn.Module:
        raise NotImplementedError

    @classmethod
    def make_caches(cls) -> list[SlotKVCache]:
        return [SlotKVCache() for _ in range(cls.caches_per_layer)]

    @classmethod
    def block_cache(cls, caches: list[SlotKVCache]):
        return caches[0] if len(caches) == 1 else list(caches)

    @classmethod
    def build(cls, model, config: dict, depth: int | None = None) -> NativeMTP:
        """The (randomly initialised) head for mlx-lm ``model``: load weights
        into it with ``load_weights(list(to_module(...).items()))``."""
        tc = text_config(config)
        D = cls.depth(config) if depth is None else depth
        eps = tc.get("rms_norm_eps", 1e-6)
        return NativeMTP([MTPLayer(tc["hidden_size"], eps, cls.make_block(model, config, i)) for i in range(D)])
