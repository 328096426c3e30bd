"""The Qwen3.5 / Qwen3.6 (dense and MoE) and Qwen3-Next native-MTP family.

The head is the checkpoint's top-level ``mtp.*`` tensors: one fusion shared by
every MTP layer -- ``mtp.fc [H, 2H]`` over ``[pre_fc_norm_embedding(e);
pre_fc_norm_hidden(h)]`` (embedding first) and the final ``mtp.norm`` -- and
``mtp_num_hidden_layers`` full-attention decoder layers ``mtp.layers.<i>.*``
in the main layers' layout.  In :class:`~.module.NativeMTP` terms:
``enorm = pre_fc_norm_embedding``, ``hnorm = pre_fc_norm_hidden``,
``eh_proj = fc``, ``shared_head.norm = norm`` for every layer ``i``, whose
block is ``mtp.layers.<i>`` (depth ``j`` runs layer ``min(j, D - 1)``, as the
kind chains; vLLM cycles ``j mod D``, mlx-vlm 0.7.10 stacks all ``D`` layers in
every step -- all the same for the published ``D = 1``).

Every RMSNorm of the head is stored zero-centred (``1 + w``) and converted at
load, unless the safetensors metadata says ``{"format": "mlx"}`` (a file an
MLX converter wrote, already converted).  Experts: Qwen3.5-MoE's fused
``experts.gate_up_proj`` / ``experts.down_proj`` and Qwen3-Next's per-expert
tensors become mlx-lm's ``switch_mlp``.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .family import Family, inner_model, text_config

#: the head's tensors stored zero-centred (``1 + w``) in Hugging Face checkpoints
_CENTRED = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight",
            "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "mtp.norm.weight")
_SHARED = {"pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm", "fc": "eh_proj", "norm": "shared_head.norm"}


class QwenLayout(Family):
    """Qwen3.5 / 3.6 dense and MoE, Qwen3-Next: the ``mtp.*`` head (see the module docstring)."""

    model_types = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
    depth_field = "mtp_num_hidden_layers"
    reads_metadata = True
    #: mlx-lm's attention passes the mask to ``scaled_dot_product_attention`` as given
    plain_masks = True

    @classmethod
    def selects(cls, key: str, config: dict) -> bool:
        return key.startswith("mtp.")

    @classmethod
    def expected(cls, config: dict) -> list[str]:
        return ["mtp.fc.", "mtp.pre_fc_norm_embedding.", "mtp.pre_fc_norm_hidden.", "mtp.norm."] + [
            f"mtp.layers.{i}." for i in range(cls.depth(config))
        ]

    @classmethod
    def to_module(cls, weights: dict, config: dict, model, metadata: dict | None = None) -> dict:
        centred = (metadata or {}).get("format") != "mlx"
        w = {}
        for k, v in weights.items():
            if centred and k.endswith(_CENTRED) and v.ndim == 1 and mx.issubdtype(v.dtype, mx.floating):
                v = v + 1.0
            w[k] = v
        E = int(text_config(config).get("num_experts") or 0)
        out = {}
        for i in range(cls.depth(config)):
            for name, ours in _SHARED.items():
                for k, v in w.items():
                    if k.startswith(f"mtp.{name}."):
                        out[f"layers.{i}.{ours}.{k[len(f'mtp.{name}.'):]}"] = v
            pre = f"mtp.layers.{i}."
            block = {k[len(pre):]: v for k, v in w.items() if k.startswith(pre)}
            if "mlp.experts.gate_up_proj" in block:  # Qwen3.5-MoE: fused experts
                gu = block.pop("mlp.experts.gate_up_proj")
                mid = gu.shape[-2] // 2
                block["mlp.switch_mlp.gate_proj.weight"] = gu[..., :mid, :]
                block["mlp.switch_mlp.up_proj.weight"] = gu[..., mid:, :]
                block["mlp.switch_mlp.down_proj.weight"] = block.pop("mlp.experts.down_proj")
            for proj in ("gate_proj", "up_proj", "down_proj"):  # Qwen3-Next: one tensor per expert
                keys = [f"mlp.experts.{e}.{proj}.weight" for e in range(E)]
                if E and all(k in block for k in keys):
                    block[f"mlp.switch_mlp.{proj}.weight"] = mx.stack([block.pop(k) for k in keys])
            for k, v in block.items():
                out[f"layers.{i}.block.{k}"] = v
        return out

    @classmethod
    def make_block(cls, model, config: dict, i: int) -> nn.Module:
        """A full-attention decoder layer of the target's own class (built at
        the first full-attention index, so its MLP is the main layers' kind)."""
        layers = inner_model(model).layers
        full = next(layer for layer in layers if not getattr(layer, "is_linear", False))
        lm = getattr(model, "language_model", model)
        tc = text_config(config)
        idx = int(tc.get("full_attention_interval", 4)) - 1
        return type(full)(lm.args, idx)

    @classmethod
    def depth(cls, config: dict) -> int:
        return int(text_config(config).get(cls.depth_field) or 0)
