"""Hybrid-attention targets: Qwen3.5 / Qwen3.5-MoE / Qwen3-Next.

These models interleave Gated DeltaNet (linear-attention) layers with full
attention (``full_attention_interval``: every n-th layer is full attention,
as mlx-lm builds them).  mlx-lm's model code runs unchanged except for the
Gated DeltaNet module, whose ``__call__`` is replaced (by giving the module
a subclass of its own class) with the same computation on a
:class:`~mtpflow.targets.recurrent.RecurrentCache`: the recurrence is run
step by step with mlx-lm's own step function, and what a rollback needs is
recorded.  Full-attention layers use the usual
:class:`~mtpflow.targets.cache.SlotKVCache`.

Hybrids verify chains only (``supports_trees = False``: a tree request runs
as a chain, with one warning at load); the prefix cache is refused with a
one-line error (``supports_prefix_cache = False``): a stored entry would need
the recurrent state at every prefix length it may serve.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..backend import fusion
from .base import FULL, TargetError
from .cache import SlotKVCache
from .mlxlm import MLXLMTarget, _text
from .recurrent import RecurrentCache

LINEAR = "linear_attention"


# mlx-lm's ``normalize_qk`` (L2 norms of q and k as ``mx.fast.rms_norm`` with its eps scaled, q
# times ``Dk**-1``, k times ``Dk**-0.5``) as one fused RMSNorm over q and k side by side, the two
# factors its per-head weight.  Where ``[generation] fuse_ops`` is on (the CPU, which has no
# ``mx.fast.rms_norm`` kernel and runs a graph of ~11 nodes per call), the values are the same bit
# for bit (``tests/test_hybrid.py`` compares them); elsewhere mlx-lm's own function runs.
_qk_memo: dict = {}


def _qk_consts(Hk: int, Dk: int, dtype) -> tuple:
    """``(scale [2 Hk, 1], eps, 1 / Dk)`` for :func:`fusion.rms_norm`: the scale is
    ``Dk**-1`` for q's heads, ``Dk**-0.5`` for k's, in ``dtype`` (as mlx-lm's
    Python-float factors are cast)."""
    key = (Hk, Dk, dtype)
    c = _qk_memo.get(key)
    if c is None:
        inv = Dk**-0.5
        c = _qk_memo[key] = (mx.array([inv**2] * Hk + [inv] * Hk, mx.float32)[:, None].astype(dtype),
                             mx.array(1e-6 * inv**2, mx.float32), mx.array(1.0 / Dk, mx.float32))
        mx.eval(*c)
    return c


class _RecordingGDN:
    """Mixed into a Gated DeltaNet module's class: on a :class:`RecurrentCache`
    the layer runs here (mlx-lm's computation, the recurrence recorded for
    rollback); on any other cache (mlx-lm's own), as mlx-lm runs it."""

    def __call__(self, inputs, mask=None, cache=None):
        if not isinstance(cache, RecurrentCache):
            return super().__call__(inputs, mask, cache)
        from mlx_lm.models.gated_delta import compute_g, normalize_qk

        B, S, _ = inputs.shape
        qkv, z, b, a = self._project(inputs)
        if mask is not None:
            qkv = mx.where(mask[..., None], qkv, 0)
        conv_in = cache.conv_input(qkv)
        conv_out = nn.silu(self.conv1d(conv_in))
        Hk, Dk = self.num_k_heads, self.head_k_dim
        v = conv_out[..., 2 * self.key_dim :].reshape(B, S, self.num_v_heads, self.head_v_dim)
        if fusion.is_fused(self.out_proj):
            # q and k side by side, normalised and scaled in one fused op (see _qk_consts)
            qk = fusion.rms_norm(conv_out[..., : 2 * self.key_dim].reshape(B, S, 2 * Hk, Dk), *_qk_consts(Hk, Dk, conv_out.dtype))
            q, k = qk[:, :, :Hk], qk[:, :, Hk:]
        else:
            q, k = (conv_out[..., i * self.key_dim : (i + 1) * self.key_dim].reshape(B, S, Hk, Dk) for i in (0, 1))
            q, k = normalize_qk(q, k, inv_scale=Dk**-0.5, eps=1e-6)
        g = compute_g(self.A_log, a, self.dt_bias)
        out = cache.update(conv_in, q, k, v, g, mx.sigmoid(b), mask)
        out = self.norm(out.astype(q.dtype), z)
        return self.out_proj(out.reshape(B, S, -1))


class _Qwen35Projections:
    def _project(self, x):
        B, S, _ = x.shape
        z = self.in_proj_z(x).reshape(B, S, self.num_v_heads, self.head_v_dim)
        return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)


class _Qwen3NextProjections:
    def _project(self, x):
        B, S, _ = x.shape
        q, k, v, z, b, a = self.fix_query_key_value_ordering(self.in_proj_qkvz(x), self.in_proj_ba(x))
        qkv = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1)
        return qkv, z, b, a


_subclasses: dict = {}


def _recording(module, projections) -> None:
    """Give ``module`` (a Gated DeltaNet) the recording subclass of its class."""
    cls = type(module)
    if issubclass(cls, _RecordingGDN):
        return
    sub = _subclasses.get(cls)
    if sub is None:
        sub = _subclasses[cls] = type("Recording" + cls.__name__, (_RecordingGDN, projections, cls), {})
    module.__class__ = sub


class HybridTarget(MLXLMTarget):
    """The base of hybrid-attention adapters: Gated DeltaNet layers on
    :class:`RecurrentCache`, full-attention layers on :class:`SlotKVCache`."""

    q_norm = True
    supports_trees = False
    supports_prefix_cache = False
    #: the Gated DeltaNet projections of this architecture
    projections: type = _Qwen35Projections
    #: how the recurrent caches roll back ("steps" or "replay", see recurrent.py)
    rollback_mode = "steps"

    def __init__(self, model, config: dict, path):
        super().__init__(model, config, path)
        self.store_layers = {FULL: max(i for i, t in enumerate(self.layer_types) if t == FULL)}
        self.conv_kernel = self.tc.get("linear_conv_kernel_dim", 4)
        for layer in self.inner.layers:
            if getattr(layer, "is_linear", False):
                _recording(layer.linear_attn, self.projections)

    @classmethod
    def layer_types_of(cls, config: dict) -> list[str]:
        """Every ``full_attention_interval``-th layer is full attention (what
        mlx-lm builds; a ``layer_types`` list that says otherwise is refused)."""
        tc = _text(config)
        n, k = tc["num_hidden_layers"], tc.get("full_attention_interval", 4)
        types = [FULL if (i + 1) % k == 0 else LINEAR for i in range(n)]
        given = tc.get("layer_types")
        if given and list(given) != types:
            raise TargetError(
                f"layer_types {given} is not every {k}-th layer full attention (full_attention_interval); "
                "mlx-lm builds the model from full_attention_interval: fix config.json"
            )
        return types

    @classmethod
    def attention_geometry(cls, config: dict) -> dict:
        tc = _text(config)
        nh = tc["num_attention_heads"]
        hd = tc.get("head_dim") or tc["hidden_size"] // nh
        return {FULL: {"num_attention_heads": nh, "num_key_value_heads": tc.get("num_key_value_heads") or nh,
                       "head_dim": hd, "scale": hd**-0.5, "q_norm": True}}

    _prefilling = False

    def make_cache(self, extra: int = 16) -> list:
        return [RecurrentCache(self.conv_kernel, self.rollback_mode, record=not self._prefilling) if t == LINEAR
                else SlotKVCache() for t in self.layer_types]

    def prefill(self, seqs, extra: int = 16, step: int = 512, pad_id: int = 0, taps=(), media=None):
        """The base prefill (left padding is masked out of the recurrent layers
        while it runs: their ``dense`` flag; nothing is recorded for rollback);
        the next forwards need no mask and are recorded."""
        self._prefilling = True
        try:
            out = super().prefill(seqs, extra=extra, step=step, pad_id=pad_id, taps=taps, media=media)
        finally:
            self._prefilling = False
        for c in out[0]:
            if isinstance(c, RecurrentCache):
                c.padded, c.record = False, True
        return out

    def compact(self, cache: list, n_valid_max: int, min_positions: list[int]) -> None:
        super().compact([c for c in cache if isinstance(c, SlotKVCache)], n_valid_max, min_positions)

    def forward_tree(self, *args, **kwargs):
        raise TargetError(f"{self.path}: a hybrid-attention target verifies chains only; draft chains (tree = \"off\")")


class Qwen35Target(HybridTarget):
    """Qwen3.5 / 3.6, dense and MoE (``qwen3_5``, ``qwen3_5_moe``; the text
    config inside ``text_config``, weights under ``model.language_model``)."""

    model_types = ("qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text")
    projections = _Qwen35Projections


class Qwen3NextTarget(HybridTarget):
    """Qwen3-Next (``qwen3_next``: a flat config, fused ``in_proj_qkvz`` / ``in_proj_ba``)."""

    model_types = ("qwen3_next",)
    projections = _Qwen3NextProjections
