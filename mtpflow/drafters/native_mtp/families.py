"""Family adapters: where a family keeps its MTP head and how to build it.

A family adapter is a small class (see :class:`.family.Family`); the drafter and the
loader never branch on a family.  Register one by adding it to
:data:`FAMILIES` (first match wins; :class:`NativeLayout` is the fallback for
any mlx-lm target that states ``num_nextn_predict_layers``).
"""

from __future__ import annotations

import inspect
import re

import mlx.nn as nn

from .family import Family, inner_model, text_config  # noqa: F401  (re-exported)
from .module import COPIES, OWN
from .nemotron import NemotronHLayout
from .qwen import QwenLayout


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
FAMILIES: list[type[Family]] = [QwenLayout, NemotronHLayout, SparseNativeLayout, NativeLayout]


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
