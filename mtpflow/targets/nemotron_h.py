"""Nemotron-H: Mamba2 layers interleaved with attention, MLP and MoE layers.

The layer stack is ``hybrid_override_pattern`` (``M``: Mamba2, ``*``:
attention without RoPE, ``-``: MLP, ``E``: MoE; or ``layers_block_type``).
Only ``M`` and ``*`` layers own a cache (mlx-lm's order), so this adapter's
``layer_types`` lists those layers only: a Mamba2 layer on a
:class:`~mtpflow.targets.recurrent.ScanCache`, an attention layer on a
:class:`~mtpflow.targets.cache.SlotKVCache`.  mlx-lm's model code runs
unchanged except for the Mamba2 mixer's call, whose selective scan runs step
by step on the cache (the recurrence mlx-lm's decode kernel computes: ``s_t =
exp(A dt_t) s_{t-1} + dt_t x_t B_t^T``, ``y_t = s_t C_t + D x_t``), recording
what a rollback to any accepted prefix needs.  Hybrid rules apply (chains
only, no prefix cache): see :mod:`mtpflow.targets.hybrid`.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import mlx.nn as nn

from .base import FULL, TargetError
from .cache import SlotKVCache
from .hybrid import LINEAR, HybridTarget
from .mlxlm import _text
from .recurrent import RecurrentCache, ScanCache

#: block characters of ``hybrid_override_pattern`` per ``layers_block_type`` name (mlx-lm's table)
BLOCK_CHARS = {"full_attention": "*", "linear_attention": "M", "moe": "E", "mlp": "-",
               "attention": "*", "mamba": "M", "conv": "M"}


def block_pattern(tc: dict, key: str = "hybrid_override_pattern", types_key: str = "layers_block_type") -> list[str]:
    """The layer pattern (one character per layer) of a Nemotron-H (text) config."""
    pattern = tc.get(key)
    if pattern is None:
        types = tc.get(types_key) or (tc.get("layer_types") if key == "hybrid_override_pattern" else None)
        if types is None:
            return []
        unknown = sorted(set(types) - BLOCK_CHARS.keys())
        if unknown:
            raise TargetError(f"{types_key} has unknown block types {unknown}; use {sorted(BLOCK_CHARS)}")
        pattern = [BLOCK_CHARS[t] for t in types]
    return list(pattern)


def _ssm_step(x, B, C, dt, state, A):
    """One Mamba2 step: ``x [B, H, Dh]``, ``B``/``C [B, G, N]``, ``dt [B, H]``
    (after softplus and clipping, float32), ``state [B, H, Dh, N]`` float32;
    returns ``(y [B, H, Dh] without the D skip, new state)``."""
    rep = x.shape[1] // B.shape[1]
    if rep > 1:
        B, C = mx.repeat(B, rep, axis=1), mx.repeat(C, rep, axis=1)
    dA = mx.exp(dt * A)
    state = dA[..., None, None] * state + (dt[..., None] * x)[..., None] * B[:, :, None, :]
    y = (state @ C[..., None])[..., 0]
    return y.astype(x.dtype), state


class _RecordingMamba2:
    """Mixed into a Mamba2 mixer's class: on a :class:`ScanCache` the mixer
    runs here (mlx-lm's projections, convolution and gated norm; the scan
    step by step, recorded for rollback); on any other cache, as mlx-lm runs it."""

    def __call__(self, hidden_states, mask=None, cache=None):
        if not isinstance(cache, ScanCache):
            return super().__call__(hidden_states, mask, cache)
        from mlx_lm.models.ssm import compute_dt

        Bsz, S, _ = hidden_states.shape
        I, G, N, H = self.intermediate_size, self.n_groups, self.ssm_state_size, self.num_heads
        gate, xbc, dt = mx.split(self.in_proj(hidden_states), [I, I + self.conv_dim], axis=-1)
        if mask is not None:
            xbc = mx.where(mask[..., None], xbc, 0)
        conv_in = cache.conv_input(xbc)
        conv_out = nn.silu(self.conv1d(conv_in))
        x, B, C = mx.split(conv_out, [I, I + G * N], axis=-1)
        x = x.reshape(Bsz, S, H, self.head_dim)
        B, C = B.reshape(Bsz, S, G, N), C.reshape(Bsz, S, G, N)
        dt = compute_dt(dt, self.dt_bias, self.time_step_limit)
        A = -mx.exp(self.A_log.astype(mx.float32))
        y = cache.scan(conv_in, partial(_ssm_step, A=A), (x, B, C, dt), (Bsz, H, self.head_dim, N), mask)
        y = y + x * self.D.astype(x.dtype)[:, None]
        y = self.norm(y.reshape(Bsz, S, I), gate)
        return self.out_proj(y)


_subclasses: dict = {}


def _recording(module) -> None:
    cls = type(module)
    if issubclass(cls, _RecordingMamba2):
        return
    sub = _subclasses.get(cls)
    if sub is None:
        sub = _subclasses[cls] = type("Recording" + cls.__name__, (_RecordingMamba2, cls), {})
    module.__class__ = sub


class NemotronHTarget(HybridTarget):
    """Nemotron-H (``nemotron_h``; the body is ``backbone``: ``embeddings``,
    ``layers``, ``norm_f``; an untied ``lm_head``)."""

    model_types = ("nemotron_h",)
    q_norm = False

    def __init__(self, model, config: dict, path):
        super().__init__(model, config, path)
        self.conv_kernel = self.tc["conv_kernel"]
        for layer in self.inner.layers:
            if getattr(layer, "block_type", None) == "M":
                _recording(layer.mixer)

    @classmethod
    def inner_of(cls, model):
        return model.backbone

    @classmethod
    def layer_types_of(cls, config: dict) -> list[str]:
        """One entry per layer that owns a cache (``M``: linear, ``*``: full attention)."""
        pattern = block_pattern(_text(config))
        if not pattern:
            raise TargetError("a nemotron_h config needs hybrid_override_pattern or layers_block_type; fix config.json")
        if "*" not in pattern:
            raise TargetError("this nemotron_h has no attention layer ('*' in hybrid_override_pattern); it is not supported")
        return [LINEAR if c == "M" else FULL for c in pattern if c in "M*"]

    @classmethod
    def attention_geometry(cls, config: dict) -> dict:
        tc = _text(config)
        nh = tc["num_attention_heads"]
        hd = tc.get("head_dim") or tc["hidden_size"] // nh
        return {FULL: {"num_attention_heads": nh, "num_key_value_heads": tc.get("num_key_value_heads") or nh,
                       "head_dim": hd, "scale": hd**-0.5, "q_norm": False}}

    def make_cache(self, extra: int = 16) -> list:
        return [ScanCache(self.conv_kernel, self.rollback_mode, record=not self._prefilling) if t == LINEAR
                else SlotKVCache() for t in self.layer_types]

    @property
    def lm_head_module(self):
        return self.head_owner.lm_head  # mlx-lm's nemotron_h always projects with its own lm_head

    @property
    def embed_table(self):
        return self.inner.embeddings

    def embed(self, tokens: mx.array) -> mx.array:
        return self.inner.embeddings(tokens)

    def final_norm(self, x: mx.array) -> mx.array:
        return self.inner.norm_f(x)


__all__ = ["NemotronHTarget", "RecurrentCache", "ScanCache", "block_pattern"]
