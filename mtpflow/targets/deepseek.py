"""Targets whose checkpoints carry DeepSeek-style native MTP heads.

mlx-lm's DeepSeek-V3 (MLA attention, MoE) and GLM-4.x MoE model code runs
unchanged on :class:`~mtpflow.targets.cache.SlotKVCache` (MLA caches the
latent K/V and the RoPE key); ``shared_kv`` of an MLA layer holds that latent
cache, not per-head K/V.  The MTP layers ``model.layers.{N + i}`` are dropped
from the target at load whatever ``N`` is (mlx-lm's DeepSeek-V3 drops layer
61 only, DeepSeek-V3's own count); the ``native_mtp`` drafter reads them.
"""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx

from .base import TargetError, read_config
from .mlxlm import MLXLMTarget

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _without_mtp(get_classes):
    def classes(config):
        model_cls, args_cls = get_classes(config=config)
        n = int(config["num_hidden_layers"])

        class Model(model_cls):
            def sanitize(self, weights):
                keep = {}
                for k, v in weights.items():
                    m = _LAYER.match(k)
                    if m is None or int(m.group(1)) < n:
                        keep[k] = v
                return super().sanitize(keep)

        Model.__name__ = Model.__qualname__ = model_cls.__name__
        return Model, args_cls

    return classes


class DeepseekTarget(MLXLMTarget):
    model_types = ("deepseek_v3", "glm4_moe", "glm4_moe_lite")

    @classmethod
    def from_path(cls, path, config: dict | None = None, dtype: str | None = "float32") -> "DeepseekTarget":
        from mlx_lm.utils import _get_classes, load_model

        path = Path(path)
        config = config or read_config(path)
        try:
            model, _ = load_model(path, get_model_classes=_without_mtp(_get_classes))
        except FileNotFoundError as exc:
            raise TargetError(f"{path}: {exc}; download the full checkpoint") from None
        except ValueError as exc:
            raise TargetError(f"{path}: cannot load the model ({exc})") from None
        if dtype and not (config.get("quantization") or config.get("quantization_config")):
            model.set_dtype(getattr(mx, dtype))
        mx.eval(model.parameters())
        return cls(model, config, path)


class SlotCachePair(list):
    """One DeepSeek-V3.2 / GLM-5 layer's caches (mlx-lm's ``CacheList``): the
    latent K/V ``[0]`` and the DSA indexer's keys ``[1]``, two
    :class:`~mtpflow.targets.cache.SlotKVCache` that always hold the same
    slots.  Reads come from ``[0]``; every write, rollback, selection and
    compaction goes to both, so the engine handles it as one cache."""

    window = None
    retain = None

    def __init__(self, caches=None):
        from .cache import SlotKVCache

        super().__init__(caches if caches is not None else [SlotKVCache(), SlotKVCache()])

    def _both(name):
        def method(self, *args, **kwargs):
            out = [getattr(c, name)(*args, **kwargs) for c in self]
            return out[0]

        method.__name__ = name
        return method

    rollback = _both("rollback")
    keep = _both("keep")
    select = _both("select")
    trim = _both("trim")
    compact = _both("compact")
    del _both

    def _read(name):
        return property(lambda self: getattr(self[0], name), lambda self, v: [setattr(c, name, v) for c in self])

    offset = _read("offset")
    dense = _read("dense")
    idx = _read("idx")
    _tree = _read("_tree")
    keys = property(lambda self: self[0].keys)
    values = property(lambda self: self[0].values)
    positions = property(lambda self: self[0].positions)
    step = property(lambda self: self[0].step)
    del _read

    def view(self):
        return self[0].view()

    def is_trimmable(self) -> bool:
        return True

    def size(self) -> int:
        return self[0].idx

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self)

    def make_mask(self, *args, **kwargs):
        return self[0].make_mask(*args, **kwargs)

    @classmethod
    def merge_layers(cls, layer: list) -> "SlotCachePair":
        """Continuous batching: stack several batches' pairs of one layer."""
        from .cache import merge_caches

        return cls([merge_caches([[p[j]] for p in layer])[0] for j in range(2)])


class DeepseekV32Target(DeepseekTarget):
    """DeepSeek-V3.2 / GLM-5: MLA with a DSA indexer; each layer keeps a
    :class:`SlotCachePair`.  The indexer picks ``index_topk`` keys only past
    that many cached slots (shorter contexts attend densely).  Tree verifies
    place the indexer's RoPE by offset, so they are exact only while the
    context is within ``index_topk``."""

    model_types = ("deepseek_v32", "glm_moe_dsa")

    def make_cache(self, extra: int = 16) -> list:
        return [SlotCachePair() for _ in self.cache_layer_types]
