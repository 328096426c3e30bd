"""The Nemotron-H native-MTP family.

The checkpoint carries one prediction module (``num_nextn_predict_layers: 1``)
as the top-level ``mtp.layers.<j>.*`` tensors: a short stack of Nemotron-H
blocks given by ``mtp_hybrid_override_pattern`` (or ``mtp_layers_block_type``;
``"*E"`` in the published checkpoints: attention, then MoE), each with its
``norm`` and ``mixer.*`` in the main layers' layout.  The first block also
holds the fusion -- ``enorm``, ``hnorm``, ``eh_proj [H, 2H]`` over
``[enorm(e); hnorm(h)]``, embedding first -- and the last the output norm
``final_layernorm``.  In :class:`~.module.NativeMTP` terms: layer 0's
``enorm`` / ``hnorm`` / ``eh_proj`` are block 0's, its ``shared_head.norm`` is
the last block's ``final_layernorm``, and its decoder block is the whole stack
(mlx-lm's ``NemotronHBlock`` per pattern character; attention blocks share the
layer's one K/V cache slot each -- one ``*`` is supported).  Norms are plain
RMSNorm weights (no ``1 + w``), with ``layer_norm_epsilon``.  Per-expert
``experts.<e>.up_proj`` / ``down_proj`` become mlx-lm's ``switch_mlp.fc1`` /
``fc2``.

Depth: the one module is reused for every draft of a block (as mlx-vlm 0.7.10
and vLLM do), which is what the kind's ``min(j, D - 1)`` gives for ``D = 1``.
"""

from __future__ import annotations

import re

import mlx.core as mx
import mlx.nn as nn

from ...errors import IncompatibleDrafter
from ...targets.nemotron_h import block_pattern
from .family import Family, text_config
from .module import MTPLayer, NativeMTP

_FUSION = ("enorm.", "hnorm.", "eh_proj.")
_EXPERT = re.compile(r"^mixer\.experts\.(\d+)\.(up_proj|down_proj)\.(\w+)$")


class _Stack(nn.Module):
    """The MTP module's blocks in pattern order, called ``(x, mask, cache)``:
    the attention block reads ``cache``, the others none."""

    def __init__(self, args, pattern: list[str]):
        super().__init__()
        from mlx_lm.models.nemotron_h import NemotronHBlock

        self.layers = [NemotronHBlock(args, c) for c in pattern]

    def __call__(self, x, mask=None, cache=None):
        for layer in self.layers:
            x = layer(x, mask=mask, cache=cache) if layer.block_type == "*" else layer(x)
        return x


class NemotronHLayout(Family):
    """Nemotron-H (``nemotron_h``): the ``mtp.layers.<j>.*`` module (see the module docstring)."""

    model_types = ("nemotron_h",)

    @classmethod
    def pattern(cls, config: dict) -> list[str]:
        tc = text_config(config)
        pattern = block_pattern(tc, "mtp_hybrid_override_pattern", "mtp_layers_block_type")
        if not pattern or pattern.count("*") != 1 or any(c not in "*E-" for c in pattern):
            raise IncompatibleDrafter(
                f"mtp_hybrid_override_pattern {''.join(pattern) or None!r}: the Nemotron-H MTP head runs one "
                "attention block ('*') plus MoE / MLP blocks ('E', '-'), as the published checkpoints ship; "
                "fix config.json or draft with another kind"
            )
        return pattern

    @classmethod
    def selects(cls, key: str, config: dict) -> bool:
        # FP8 checkpoints' attention ``k_scale`` / ``v_scale`` have no place in the MLX block
        return key.startswith("mtp.layers.") and not key.endswith((".k_scale", ".v_scale"))

    @classmethod
    def expected(cls, config: dict) -> list[str]:
        if cls.depth(config) != 1:
            raise IncompatibleDrafter(
                f"num_nextn_predict_layers is {cls.depth(config)}: a Nemotron-H checkpoint carries one MTP module "
                "(reused for every draft); fix config.json"
            )
        P = len(cls.pattern(config))
        return (["mtp.layers.0." + f for f in _FUSION] + [f"mtp.layers.{P - 1}.final_layernorm."]
                + [f"mtp.layers.{j}.mixer." for j in range(P)])

    @classmethod
    def to_module(cls, weights: dict, config: dict, model) -> dict:
        P = len(cls.pattern(config))
        out, experts = {}, {}
        for k, v in weights.items():
            m = re.match(r"^mtp\.layers\.(\d+)\.(.+)$", k)
            j, rest = int(m.group(1)), m.group(2)
            if j == 0 and rest.startswith(_FUSION):
                out[f"layers.0.{rest}"] = v
            elif j == P - 1 and rest.startswith("final_layernorm."):
                out[f"layers.0.shared_head.norm.{rest[len('final_layernorm.'):]}"] = v
            elif e := _EXPERT.match(rest):
                experts.setdefault((j, e.group(2), e.group(3)), {})[int(e.group(1))] = v
            else:
                out[f"layers.0.block.layers.{j}.{rest}"] = v
        fc = {"up_proj": "fc1", "down_proj": "fc2"}
        for (j, proj, leaf), per in experts.items():
            out[f"layers.0.block.layers.{j}.mixer.switch_mlp.{fc[proj]}.{leaf}"] = mx.stack([per[e] for e in sorted(per)])
        return out

    @classmethod
    def make_block(cls, model, config: dict, i: int) -> nn.Module:
        return _Stack(getattr(model, "language_model", model).args, cls.pattern(config))

    @classmethod
    def build(cls, model, config: dict, depth: int | None = None) -> NativeMTP:
        tc = text_config(config)
        eps = tc.get("layer_norm_epsilon", 1e-5)
        D = cls.depth(config) if depth is None else depth
        return NativeMTP([MTPLayer(tc["hidden_size"], eps, cls.make_block(model, config, i)) for i in range(D)])
