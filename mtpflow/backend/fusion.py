"""Fewer graph nodes for a model's small ops, where MLX runs them as graphs of primitives.

On a CPU stream MLX has no kernel for ``mx.fast.rms_norm`` or ``mx.fast.rope``:
each call expands into its fallback, ~11 and ~28 graph nodes, and the thread
that submits a graph pays a few microseconds per node (docs/benchmarks.md,
"What limits speed on this CPU").  On a small model that submission, not the arithmetic, bounds a token.

* RMSNorm (``nn.RMSNorm``, Gemma's ``1 + weight`` norms, Gemma 4's unscaled
  one) and RoPE run their fallbacks through ``mx.compile``, which fuses
  each one's elementwise runs into single nodes.  The fused code performs the
  same float32 operations in the same order, so the values are the same bit
  for bit (``tests/test_fusion.py`` compares them).
* ``nn.Linear`` and a tied ``nn.Embedding`` head keep their weight's
  transpose (a view of the same buffer) between calls instead of adding a
  ``Transpose`` node to every product.

:func:`fuse` swaps, in place, the class of every module it knows under a
module for a subclass with the leaner call (parameters, ``isinstance`` and
saving are unchanged); :func:`unfuse` and :func:`stock` restore mlx-lm's own
classes.  A call the fused form does not cover (mixed dtypes, an ``int`` RoPE
offset, extra arguments, a large RoPE input such as a prefill chunk) runs the
original code.

``[generation] fuse_ops = "auto"`` fuses on a CPU device only: Metal and CUDA
have kernels for both ops, and their ``async_eval`` runs ahead of the host.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import mlx.core as mx
import mlx.nn as nn

#: a RoPE input of up to this many positions (its axis -2) and elements runs
#: fused (decode steps, verifies, trees); longer ones (prefill chunks, whose
#: cost is arithmetic) run the original code, so the traces a RoPE module keeps
#: (one per input shape) stay few
ROPE_FUSE_MAX_POSITIONS = 32
ROPE_FUSE_MAX_ELEMENTS = 1 << 17


# MLX's fallback: in float32, x * rsqrt(mean(x^2) + eps), cast back, times the weight.  The mean
# is a sum times 1 / n; a shapeless trace would compute 1 / n in a node of its own on every
# call, so the caller passes it (the same float32 constant mlx's mean multiplies by).
@partial(mx.compile, shapeless=True)
def _rms_norm(x, weight, eps, inv_n):
    x32 = x.astype(mx.float32)
    return (x32 * mx.rsqrt(mx.square(x32).sum(-1, keepdims=True) * inv_n + eps)).astype(x.dtype) * weight


#: ``rms_norm(x, weight, eps, inv_n)``: ``mx.fast.rms_norm``'s fallback as one compiled node (``eps``
#: and ``inv_n`` float32 arrays, ``weight`` any shape that broadcasts against ``x``)
rms_norm = _rms_norm


@partial(mx.compile, shapeless=True)
def _rms_norm_offset(x, weight, eps, inv_n):
    # Gemma's norms scale by 1 + weight
    x32 = x.astype(mx.float32)
    return (x32 * mx.rsqrt(mx.square(x32).sum(-1, keepdims=True) * inv_n + eps)).astype(x.dtype) * (1.0 + weight)


@partial(mx.compile, shapeless=True)
def _rms_norm_no_scale(x, eps, inv_n):
    x32 = x.astype(mx.float32)
    return (x32 * mx.rsqrt(mx.square(x32).sum(-1, keepdims=True) * inv_n + eps)).astype(x.dtype)


_constants: dict = {}


def _const(value: float) -> mx.array:
    """One float32 array per constant (``eps``, ``1 / n``), shared by every call."""
    a = _constants.get(value)
    if a is None:
        a = _constants[value] = mx.array(value, dtype=mx.float32)
    return a


class _FusedRMSNorm:
    """Mixed into ``nn.RMSNorm``: ``mx.fast.rms_norm(x, weight, eps)``, fused."""

    _fused = staticmethod(_rms_norm)

    def __call__(self, x):
        w = self.weight
        if x.dtype != w.dtype:
            return super().__call__(x)
        return self._fused(x, w, _const(self.eps), _const(1.0 / x.shape[-1]))


class _FusedOffsetRMSNorm(_FusedRMSNorm):
    """Mixed into Gemma's norms: ``mx.fast.rms_norm(x, 1.0 + weight, eps)``, fused."""

    _fused = staticmethod(_rms_norm_offset)


class _FusedRMSNormNoScale:
    """Mixed into a norm whose call is ``mx.fast.rms_norm(x, None, eps)``."""

    def __call__(self, x):
        return _rms_norm_no_scale(x, _const(self.eps), _const(1.0 / x.shape[-1]))


class _FusedRoPE:
    """Mixed into a RoPE module whose call depends only on ``(x, offset)`` and
    the module's own constants: that call, compiled once per input shape."""

    def __call__(self, x, offset=0, *args, **kwargs):
        if (args or kwargs or not isinstance(offset, mx.array) or x.ndim < 2
                or x.shape[-2] > ROPE_FUSE_MAX_POSITIONS or x.size > ROPE_FUSE_MAX_ELEMENTS):
            return super().__call__(x, offset, *args, **kwargs)
        fn = self.__dict__.get("_mtpflow_fused")
        if fn is None:
            base = type(self).__mro__[2]  # the original class (after the mixin)
            fn = mx.compile(partial(base.__call__, self))
            object.__setattr__(self, "_mtpflow_fused", fn)
        return fn(x, offset)


class _KeptTranspose:
    """The weight's transpose kept between calls (a view of the same buffer,
    computed once), so a product adds no ``Transpose`` node.  A new weight
    (loaded, trained, or a tracer inside a transform) gets its own transpose;
    a weight changed in place keeps the old one (unfuse first)."""

    def _wt(self):
        w = self["weight"]
        c = self.__dict__.get("_mtpflow_wt")
        if c is None or c[0] is not w:
            c = (w, w.T)
            object.__setattr__(self, "_mtpflow_wt", c)
        return c[1]


class _LeanLinear(_KeptTranspose):
    """Mixed into ``nn.Linear``: its product on the kept transpose."""

    def __call__(self, x):
        if "bias" in self:
            return mx.addmm(self["bias"], x, self._wt())
        return x @ self._wt()


class _LeanEmbedding(_KeptTranspose):
    """Mixed into ``nn.Embedding``: a tied head's ``as_linear`` on the kept transpose."""

    def as_linear(self, x):
        return x @ self._wt()


def _known() -> dict:
    """``{original class: mixin}`` of the modules :func:`fuse` swaps."""
    known = {nn.RMSNorm: _FusedRMSNorm, nn.RoPE: _FusedRoPE, nn.Linear: _LeanLinear, nn.Embedding: _LeanEmbedding}
    try:
        from mlx_lm.models import rope_utils

        for name in ("Llama3RoPE", "ProportionalRoPE", "YarnRoPE", "SuScaledRoPE"):
            cls = getattr(rope_utils, name, None)
            if cls is not None:
                known[cls] = _FusedRoPE
    except ImportError:  # pragma: no cover
        pass
    for name in ("gemma", "gemma2", "gemma3_text"):  # their RMSNorm scales by 1 + weight
        try:
            mod = __import__(f"mlx_lm.models.{name}", fromlist=["RMSNorm"])
        except ImportError:  # pragma: no cover
            continue
        if hasattr(mod, "RMSNorm"):
            known[mod.RMSNorm] = _FusedOffsetRMSNorm
    try:
        from mlx_lm.models import gemma4_text

        if hasattr(gemma4_text, "RMSNormNoScale"):
            known[gemma4_text.RMSNormNoScale] = _FusedRMSNormNoScale
    except ImportError:  # pragma: no cover
        pass
    return known


_subclasses: dict = {}  # original class -> fused subclass
_originals: dict = {}  # fused subclass -> original class


def _fused_class(cls, mixin):
    sub = _subclasses.get(cls)
    if sub is None:
        sub = type(f"Fused{cls.__name__}", (mixin, cls), {"__module__": __name__})
        _subclasses[cls], _originals[sub] = sub, cls
    return sub


def fuse(module) -> int:
    """Swap every known RMSNorm, RoPE, linear and embedding module under
    ``module`` (itself included) for its leaner form; returns how many were swapped."""
    known = _known()
    n = 0
    for _, m in module.named_modules():
        mixin = known.get(type(m))
        if mixin is not None:
            m.__class__ = _fused_class(type(m), mixin)
            n += 1
    return n


def unfuse(module, keep_caches: bool = False) -> int:
    """Restore mlx-lm's classes under ``module``; returns how many were
    restored.  ``keep_caches``: leave the compiled RoPE calls and the kept
    transposes on the modules, for a :func:`fuse` that follows (see :func:`stock`)."""
    n = 0
    for _, m in module.named_modules():
        cls = _originals.get(type(m))
        if cls is not None:
            m.__class__ = cls
            if not keep_caches:
                m.__dict__.pop("_mtpflow_fused", None)
                m.__dict__.pop("_mtpflow_wt", None)
            n += 1
    return n


def is_fused(module) -> bool:
    return any(type(m) in _originals for _, m in module.named_modules())


@contextmanager
def stock(*modules):
    """Within this block the ``modules`` run their original (unfused) code
    (the bench's mlx-lm baseline); fused ones are fused again after it, with
    their compiled calls kept (a timed run after it does not trace again).
    Not while another thread may be running the modules: a call in flight
    when its class changes fails."""
    was = [m for m in modules if m is not None and is_fused(m)]
    for m in was:
        unfuse(m, keep_caches=True)
    try:
        yield
    finally:
        for m in was:
            fuse(m)

