"""Fewer graph nodes for a model's small ops, where MLX runs them as graphs of primitives.

On a CPU stream MLX has no kernel for ``mx.fast.rms_norm`` or ``mx.fast.rope``:
each call expands into its fallback, ~11 and ~28 graph nodes, and the thread
that submits a graph pays a few microseconds per node (docs/benchmarks.md,
"What limits speed on this CPU").  On a small model that submission, not the arithmetic, bounds a token.

* RMSNorm (``nn.RMSNorm``, Gemma's ``1 + weight`` norms, Gemma 4's unscaled
  one) and RoPE run their fallbacks through ``mx.compile``, which fuses
  each one's elementwise runs into single nodes.  The fused code performs the
  same operations in the same order, so the values are the same bit
  for bit (``tests/test_fusion.py`` compares them).
* A plain RoPE (``nn.RoPE``, Llama 3's, the proportional one) computes its
  cos / sin table once per forward: the layers share it and only rotate
  (5 nodes a call instead of ~14).
* ``nn.Linear`` and a tied ``nn.Embedding`` head keep their weight's
  transpose (a view of the same buffer) between calls instead of adding a
  ``Transpose`` node to every product, and multiply a batch-1 input without
  ``Flatten`` / ``Unflatten`` nodes.

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

import threading
from contextlib import contextmanager
from functools import partial

import mlx.core as mx
import mlx.nn as nn
import numpy as np

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


# A RoPE call expands into two parts on a CPU stream: the cos / sin table of its positions
# (Arange, Cos, Sin and their casts, ~10 nodes) and the rotation of ``x`` by it.  The layers
# of one forward share their RoPE's constants and, in mtpflow's caches, one offset array
# (``Target.set_offsets``), so the table is computed once per forward and kept here, one
# entry per RoPE spec and thread (``_rope_tables``); each layer then only rotates.
_rope_tables = threading.local()


def _rope_spec(module) -> tuple | None:
    """What a RoPE module's table depends on besides its positions, or None
    where its call is not a plain ``mx.fast.rope`` of ``x`` (Yarn and SuScaled
    scale ``x`` first: those keep the compiled whole call)."""
    spec = module.__dict__.get("_mtpflow_spec", False)
    if spec is False:
        spec, cls = None, _originals.get(type(module), type(module))
        if cls is nn.RoPE:
            spec = (module.dims, module.traditional, module.base, module.scale, None)
        elif cls in _rope_utils_classes(*_PLAIN_ROPES):
            freqs = getattr(module, "_freqs", None)
            if isinstance(freqs, mx.array):
                spec = (module.dims, module.traditional, None, 1.0, bytes(np.array(freqs.astype(mx.float32))))
        object.__setattr__(module, "_mtpflow_spec", spec)
    return spec


def _rotate(traditional: bool, dims: int):
    """MLX's RoPE fallback after its table: ``x`` rotated by ``cos`` / ``sin``
    (``[.., T, dims // 2]``), compiled once per layout and input shape."""
    key = (traditional, dims)
    fn = _rotations.get(key)
    if fn is None:
        half = dims // 2

        def rotate(x, cos, sin):
            if traditional:
                x1, x2 = x[..., 0:dims:2], x[..., 1:dims:2]
            else:
                x1, x2 = x[..., :half], x[..., half:dims]
            o1 = x1 * cos - x2 * sin
            o2 = x1 * sin + x2 * cos
            if traditional:
                out = mx.concatenate([o1[..., None], o2[..., None]], axis=-1).reshape(*x.shape[:-1], dims)
                parts = [out]
            else:
                parts = [o1, o2]
            if dims < x.shape[-1]:
                parts.append(x[..., dims:])
            return mx.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]

        fn = _rotations[key] = mx.compile(rotate)
    return fn


_rotations: dict = {}
_probes: dict = {}


def _probe(rows: int, T: int, dims: int, traditional: bool, dtype) -> mx.array:
    """``[rows, 1, T, dims]`` whose rotation is the table itself: pairs (1, 0)
    give ``(cos, sin)`` exactly (1 * c - 0 * s = c, 1 * s + 0 * c = s).  Made
    from host data (no graph), so threads and streams may share it."""
    key = (rows, T, dims, traditional, dtype)
    a = _probes.get(key)
    if a is None:
        half = dims // 2
        one = np.tile([1.0, 0.0], half) if traditional else np.repeat([1.0, 0.0], half)
        a = _probes[key] = mx.array(np.broadcast_to(one.astype(np.float32), (rows, 1, T, dims)), dtype=dtype)
    return a


class _FusedRoPE:
    """Mixed into a RoPE module whose call depends only on ``(x, offset)`` and
    the module's own constants: that call, compiled once per input shape; for
    a plain ``mx.fast.rope`` module, the rotation by a table the layers of a
    forward share."""

    def __call__(self, x, offset=0, *args, **kwargs):
        if (args or kwargs or not isinstance(offset, mx.array) or x.ndim < 2
                or x.shape[-2] > ROPE_FUSE_MAX_POSITIONS or x.size > ROPE_FUSE_MAX_ELEMENTS):
            return super().__call__(x, offset, *args, **kwargs)
        fn = self.__dict__.get("_mtpflow_fused")
        if fn is None:
            base = type(self).__mro__[2]  # the original class (after the mixin)
            fn = mx.compile(partial(base.__call__, self))
            object.__setattr__(self, "_mtpflow_fused", fn)
        spec = _rope_spec(self)
        if spec is None or x.ndim != 4 or offset.ndim > 1 or offset.size not in (1, x.shape[0]):
            return fn(x, offset)
        dims, traditional = spec[0], spec[1]
        T, stream = x.shape[2], mx.default_stream(mx.default_device())
        tables = _rope_tables.__dict__.setdefault("by_spec", {})
        t = tables.get(spec)
        if t is None or t[0] is not offset or t[1] != T or t[2] != x.dtype or t[3] != stream:
            table = fn(_probe(offset.size, T, dims, traditional, x.dtype), offset)
            if traditional:
                cos, sin = table[..., 0::2], table[..., 1::2]
            else:
                cos, sin = table[..., : dims // 2], table[..., dims // 2:]
            t = tables[spec] = (offset, T, x.dtype, stream, cos, sin)
        return _rotate(traditional, dims)(x, t[4], t[5])


#: mlx-lm's RoPE classes whose call is ``mx.fast.rope(x, dims, traditional, base=None, scale=1,
#: offset, freqs=self._freqs)`` on the module's constants alone (besides ``nn.RoPE``)
_PLAIN_ROPES = ("Llama3RoPE", "ProportionalRoPE")


def _rope_utils_classes(*names) -> tuple:
    """The classes of ``mlx_lm.models.rope_utils`` among ``names`` that this mlx-lm has."""
    try:
        from mlx_lm.models import rope_utils
    except ImportError:  # pragma: no cover
        return ()
    return tuple(getattr(rope_utils, n) for n in names if hasattr(rope_utils, n))


class _KeptTranspose:
    """The weight's transpose kept between calls (a view of the same buffer,
    computed once), so a product adds no ``Transpose`` node.  A new weight
    (loaded, trained, or a tracer inside a transform) gets its own transpose;
    a weight changed in place keeps the old one (unfuse first).

    A 3-D input of one row (``[1, T, K]``, batch-1 decoding) is multiplied by
    the transpose with a leading axis of 1 (also a view): MLX multiplies a
    3-D input by a 2-D weight as ``Flatten``, ``Matmul``, ``Unflatten``, and
    by this one as a single ``Matmul`` (the same BLAS call and bits).  Wider
    batches keep the 2-D weight, whose one product covers every row."""

    def _wt(self, x=None):
        w = self["weight"]
        c = self.__dict__.get("_mtpflow_wt")
        if c is None or c[0] is not w:
            c = (w, w.T, None)
            object.__setattr__(self, "_mtpflow_wt", c)
        if x is not None and x.ndim == 3 and x.shape[0] == 1:
            if c[2] is None:
                c = (c[0], c[1], c[1][None])
                object.__setattr__(self, "_mtpflow_wt", c)
            return c[2]
        return c[1]


class _LeanLinear(_KeptTranspose):
    """Mixed into ``nn.Linear``: its product on the kept transpose."""

    def __call__(self, x):
        if "bias" in self:
            return mx.addmm(self["bias"], x, self._wt())
        return x @ self._wt(x)


class _LeanEmbedding(_KeptTranspose):
    """Mixed into ``nn.Embedding``: a tied head's ``as_linear`` on the kept transpose."""

    def as_linear(self, x):
        return x @ self._wt(x)


def _known() -> dict:
    """``{original class: mixin}`` of the modules :func:`fuse` swaps."""
    known = {nn.RMSNorm: _FusedRMSNorm, nn.RoPE: _FusedRoPE, nn.Linear: _LeanLinear, nn.Embedding: _LeanEmbedding}
    for cls in _rope_utils_classes(*_PLAIN_ROPES, "YarnRoPE", "SuScaledRoPE"):
        known[cls] = _FusedRoPE
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
                m.__dict__.pop("_mtpflow_spec", None)
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

