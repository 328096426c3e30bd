"""Family adapters: where a family keeps its MTP head and how to build it.

A family adapter is a small class (see :class:`Family`); the drafter and the
loader never branch on a family.  Register one by adding it to
:data:`FAMILIES` (first match wins; :class:`NativeLayout` is the fallback for
any mlx-lm target that states ``num_nextn_predict_layers``).
"""

from __future__ import annotations

import inspect
import re

import mlx.nn as nn

from ...targets.cache import SlotKVCache
from .module import COPIES, OWN, MTPLayer, NativeMTP


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


class NativeLayout(Family):
    """DeepSeek's layout (DeepSeek-V3, GLM-4.x MoE, and any mlx-lm target with
    ``num_nextn_predict_layers``): MTP layer ``i`` is the extra decoder layer
    ``model.layers.{num_hidden_layers + i}`` with ``enorm``, ``hnorm``,
    ``eh_proj``, ``shared_head.norm`` and the family's own decoder-layer
    tensors; the block is the target's decoder-layer class built for layer
    index ``num_hidden_layers + i`` (so DeepSeek's ``first_k_dense_replace`` /
    ``moe_layer_freq`` pick its MLP as the checkpoint's), and its tensors go
    through the target's own ``sanitize`` (expert stacking, MLA ``kv_b_proj``
    split, fp8 dequantisation) as if they were layer 0's."""

    model_types = ("deepseek_v3", "glm4_moe", "glm4_moe_lite")

    @classmethod
    def _prefix(cls, config: dict, i: int) -> str:
        return f"model.layers.{text_config(config)['num_hidden_layers'] + i}."

    @classmethod
    def selects(cls, key: str, config: dict) -> bool:
        D = cls.depth(config)
        return any(key.startswith(cls._prefix(config, i)) for i in range(D)) and not any(
            key.startswith(cls._prefix(config, i) + c) for i in range(D) for c in COPIES
        )

    @classmethod
    def expected(cls, config: dict) -> list[str]:
        return [cls._prefix(config, i) + "eh_proj" for i in range(cls.depth(config))]

    @classmethod
    def to_module(cls, weights: dict, config: dict, model) -> dict:
        out = {}
        for i in range(cls.depth(config)):
            pre = cls._prefix(config, i)
            own = {k[len(pre):]: v for k, v in weights.items() if k.startswith(pre)}
            block = {f"model.layers.0.{k}": v for k, v in own.items() if not k.startswith(OWN + COPIES)}
            if hasattr(model, "sanitize") and block:
                block = model.sanitize(block)
            for k, v in block.items():
                m = re.match(r"^model\.layers\.0\.(.+)$", k)
                if m:
                    out[f"layers.{i}.block.{m.group(1)}"] = v
            for k, v in own.items():
                if k.startswith(OWN):
                    out[f"layers.{i}.{k}"] = v
        return out

    @classmethod
    def layer_class(cls, model):
        return type(inner_model(model).layers[-1])

    @classmethod
    def make_block(cls, model, config: dict, i: int) -> nn.Module:
        klass = cls.layer_class(model)
        args = getattr(model, "args", None) or getattr(getattr(model, "language_model", None), "args", None)
        params = [p for p in inspect.signature(klass.__init__).parameters.values() if p.name != "self"]
        n = text_config(config)["num_hidden_layers"]
        if len(params) >= 2:
            return klass(args, n + i)
        return klass(args)


class SparseNativeLayout(NativeLayout):
    """DeepSeek-V3.2 and GLM-5 (``glm_moe_dsa``): the native layout with a
    sparse (DSA) attention whose layer keeps two caches, the latent K/V and
    the indexer's keys (mlx-lm's ``CacheList``)."""

    model_types = ("deepseek_v32", "glm_moe_dsa")
    caches_per_layer = 2


#: families, first match on the target's ``model_type`` wins
FAMILIES: list[type[Family]] = [SparseNativeLayout, NativeLayout]


def family_for(config: dict) -> type[Family] | None:
    """The family adapter of a target config: by ``model_type``, else the
    native layout when the config states ``num_nextn_predict_layers``."""
    mt = text_config(config).get("model_type")
    for fam in FAMILIES:
        if mt in fam.model_types:
            return fam
    if text_config(config).get("num_nextn_predict_layers"):
        return NativeLayout
    return None


def supported() -> list[str]:
    return sorted({t for f in FAMILIES for t in f.model_types})
