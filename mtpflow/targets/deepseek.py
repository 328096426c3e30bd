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
