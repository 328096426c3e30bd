"""Pieces of the training objective that every drafter kind uses: shifting a sequence, one step's
loss terms (KL to the target or cross-entropy on its argmax), per-step weights, the weighted loss,
and the draft vocabulary."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np


def _power_exp() -> bool:
    from ..backend.profiles import current

    return current().power_exp


@mx.custom_function
def _power_exp_fn(x):
    return mx.power(math.e, x)


@_power_exp_fn.vjp
def _power_exp_vjp(primals, cotangent, output):
    # d e^x = e^x dx: the forward's powers times the cotangent (the power's own gradient
    # multiplies them by log(e) as well, one more pass over the array)
    out = output[0] if isinstance(output, (tuple, list)) else output
    return (cotangent * out,)


def exp(x: mx.array) -> mx.array:
    """``e ** x``; on a device whose profile says ``power_exp`` (an x86-64 CPU) as
    ``mx.power(e, x)``, which mlx[cpu] computes in less than half the time of
    ``mx.exp`` on x86-64 (to 1e-6 relative), with a backward that reuses it."""
    return _power_exp_fn(x) if _power_exp() else mx.exp(x)


def _blas_rowsum() -> bool:
    from ..backend.profiles import current

    return current().blas_rowsum


_ONES: dict = {}


def _ones(n: int) -> mx.array:
    """A float32 vector of ``n`` ones from host data (no graph: threads and streams may share it)."""
    v = _ONES.get(n)
    if v is None:
        v = _ONES[n] = mx.array(np.ones(n, np.float32))
    return v


@mx.custom_function
def _rowsum_blas(a):
    return a @ _ones(a.shape[-1])


@_rowsum_blas.vjp
def _rowsum_blas_vjp(primals, cotangent, output):
    a = primals[0] if isinstance(primals, (tuple, list)) else primals
    return (mx.broadcast_to(mx.expand_dims(cotangent, -1), a.shape),)


def rowsum(a: mx.array) -> mx.array:
    """``a.sum(-1)``; on a device whose profile says ``blas_rowsum`` (an x86-64 CPU), a float32
    ``a`` is summed as the BLAS product ``a @ ones`` (mlx[cpu]'s sum reduction runs on one thread
    at ~6x the time of OpenBLAS's matrix-vector product over a ``[1024, 8192]`` array), with the
    sum's own gradient (the cotangent broadcast, no product)."""
    if a.dtype == mx.float32 and a.ndim >= 2 and _blas_rowsum():
        return _rowsum_blas(a)
    return a.sum(-1)


def logsumexp(x: mx.array) -> mx.array:
    """``log(sum(exp(x)))`` over the last axis, kept; with :func:`exp` (its
    gradient, the softmax, reuses the forward's ``exp``)."""
    return logsumexp_max(x)[0]


def logsumexp_max(x: mx.array) -> tuple[mx.array, mx.array]:
    """``(logsumexp(x), max(x))`` over the last axis, kept (the max without a
    gradient): :func:`logsumexp` and the row maximum it subtracts, which
    :func:`top_hit` reads instead of a second pass over ``x`` for an argmax."""
    m = mx.stop_gradient(mx.max(x, axis=-1, keepdims=True))
    if not _power_exp():
        return mx.logsumexp(x, axis=-1, keepdims=True), m
    c = mx.where(mx.isinf(m), 0.0, m)  # a row of -inf: log(0) = -inf, as mx.logsumexp
    return c + mx.log(rowsum(exp(x - c)))[..., None], m


def top_hit(x: mx.array, idx: mx.array, m: mx.array) -> mx.array:
    """Whether ``x[..., idx]`` is the row's maximum ``m`` (:func:`logsumexp_max`):
    ``argmax(x) == idx`` without a pass over the row for the argmax (a tie for
    the maximum counts as a hit, where ``argmax`` takes the first index)."""
    return mx.take_along_axis(x, idx[..., None], axis=-1)[..., 0] >= m[..., 0]


def log_softmax(x: mx.array) -> mx.array:
    """``x - logsumexp(x)`` over the last axis (:func:`logsumexp`)."""
    return x - logsumexp(x)


def shift(a: mx.array, k: int) -> mx.array:
    """``out[:, t] = a[:, t + k]`` (zero past the end)."""
    if k == 0:
        return a
    T = a.shape[1]
    if k >= T:
        return mx.zeros_like(a)
    pad = mx.zeros((a.shape[0], k, *a.shape[2:]), a.dtype)
    return mx.concatenate([a[:, k:], pad], axis=1)


def ahead(a: mx.array, k: int, n: int) -> mx.array:
    """``shift(a, k)[:, :n]``: the first ``n`` positions of ``a`` read ``k`` on, as a view of ``a``
    where they lie inside it (``k + n <= T``), else copied (zero past the end).  An unrolled step
    whose terms sit at its first ``n`` rows reads its labels so, instead of copying the
    vocabulary-wide labels shifted."""
    return a[:, k:k + n] if k + n <= a.shape[1] else shift(a, k)[:, :n]


def step_terms(logp: mx.array, lab: mx.array, tgt: mx.array, valid: mx.array, soft: bool):
    """One step's (or depth's) unnormalised ``(loss_sum, correct, count)``: KL to the
    target's log-distribution ``lab`` (``soft``) or the cross-entropy of the token
    ``tgt``, summed over ``valid``; ``correct`` counts the drafter's argmax hitting ``tgt``."""
    vf = valid.astype(mx.float32)
    if soft:
        per = (exp(lab) * (lab - logp)).sum(-1)
    else:
        per = -mx.take_along_axis(logp, tgt[..., None], axis=-1)[..., 0]
    correct = mx.stop_gradient(((mx.argmax(logp, axis=-1) == tgt) & valid).sum().astype(mx.float32))
    return (per * vf).sum(), correct, mx.stop_gradient(vf.sum())


def label_top(z: mx.array) -> tuple[mx.array, mx.array]:
    """``(argmax(z), max(z))`` over the last axis (the max kept) in one pass over ``z``: the
    argmax, and the maximum gathered at it, for a caller that needs the target's greedy
    token and :func:`soft_labels` its maximum."""
    a = mx.argmax(z, axis=-1)
    return a, mx.take_along_axis(z, a[..., None], axis=-1)


def soft_labels(z: mx.array, m: mx.array | None = None) -> tuple[mx.array, mx.array, mx.array]:
    """``(p, sum p log p, sum p)`` over the last axis, ``p = softmax(z)``, of the target's logits or
    log-distribution ``z`` (the same labels either way): what :func:`logit_terms` reads of a soft
    label.  One ``exp`` (``p`` is the row's powers over their sum and ``log p = z - max - log sum``),
    where a ``log_softmax`` first and its ``exp`` after took two.  Computed once per batch, each step
    or depth then reads them shifted or gathered (not one ``exp`` per step).  ``m``: the rows'
    maximum (kept) where the caller has it (:func:`label_top`); ``sum p`` is the powers' sum over
    itself (1, or NaN for a row without a finite logit, as a sum of ``p`` gives), not a pass over ``p``."""
    if m is None:
        m = mx.max(z, axis=-1, keepdims=True)
    d = z - mx.where(mx.isinf(m), 0.0, m)
    e = exp(d)
    s = rowsum(e)[..., None]
    p = e / s
    psum = (s / s)[..., 0]
    return p, rowsum(p * d) - mx.log(s)[..., 0] * psum, psum


def logit_terms(x: mx.array, tgt: mx.array, valid: mx.array, soft: tuple | None = None):
    """:func:`step_terms` from the drafter's float32 logits ``x`` rather than its log-distribution:
    ``KL(p || softmax x) = sum p log p - sum p x + logsumexp(x) sum p`` with ``soft`` =
    :func:`soft_labels` of the target's distribution, or the cross-entropy of the token ``tgt``,
    ``logsumexp(x) - x[tgt]``.  The same terms to float rounding, without a vocabulary-wide
    ``log_softmax`` in the forward and the backward (about 40 % less elementwise work over a
    step's logits).  ``correct`` counts ``x[tgt]`` being the row's maximum (:func:`top_hit`: the
    argmax hitting ``tgt``)."""
    vf = valid.astype(mx.float32)
    per, m = logit_loss(x, tgt, soft, with_max=True)
    correct = mx.stop_gradient((top_hit(x, tgt, m) & valid).sum().astype(mx.float32))
    return (per * vf).sum(), correct, mx.stop_gradient(vf.sum())


def logit_loss(x: mx.array, tgt: mx.array | None, soft: tuple | None = None, with_max: bool = False):
    """Per row of the logits ``x``: ``KL(p || softmax x)`` with ``soft`` = :func:`soft_labels`,
    else the cross-entropy of the token ``tgt`` (:func:`logit_terms`).  ``with_max``: also the
    row maxima (:func:`logsumexp_max`, for :func:`top_hit`)."""
    lse, m = logsumexp_max(x)
    lse = lse[..., 0]
    if soft is not None:
        p, plogp, psum = soft
        per = plogp - rowsum(p * x) + lse * psum
    else:
        per = lse - mx.take_along_axis(x, tgt[..., None], axis=-1)[..., 0]
    return (per, m) if with_max else per


def step_weights(kind: str, n: int, decay: float = 0.8, acc: list[float] | None = None) -> np.ndarray:
    """Normalised per-step loss weights: ``"geometric"`` ``w_i = decay**i``, or
    ``"position"`` (D-PACE-like): with the running greedy acceptance ``a_j`` of
    step ``j`` (``acc``, the EMA of the per-step accuracy), ``E[tau] = 1 + sum_k
    prod_{j<=k} a_j`` and ``w_i = dE[tau]/da_i = prod_{j<i} a_j * (1 + sum_{k>i}
    prod_{i<m<=k} a_m)`` -- a step is weighted by how much its acceptance adds to
    the expected acceptance length.  Normalised to sum to 1."""
    if kind == "geometric":
        w = decay ** np.arange(n, dtype=np.float64)
    else:
        a = np.clip(np.asarray(acc if acc is not None else [0.5] * n, np.float64), 0.05, 0.99)
        w = np.zeros(n)
        for i in range(n):
            before = np.prod(a[:i])
            tail, run = 1.0, 1.0
            for k in range(i + 1, n):
                run *= a[k]
                tail += run
            w[i] = before * tail
    return (w / w.sum()).astype(np.float32)


def weighted_loss(sums: mx.array, counts: mx.array, weights: mx.array) -> tuple[mx.array, mx.array]:
    """``(loss, per_step_loss)``: each step's mean over its ``counts`` terms,
    weighted by ``weights``."""
    per = sums / mx.maximum(counts, 1.0)
    return (weights * per).sum(), per


def choose_draft_vocab(examples, vocab_size: int, k: int, always=(), extra=None) -> np.ndarray:
    """The ``k`` most frequent loss tokens of the training data (EAGLE-3's
    reduced draft vocabulary), plus ``always`` (EOS ids); sorted ids.

    ``extra``: more examples (``--vocab-data``) whose token frequencies are
    added with the same total weight as the training data's -- a large text
    corpus fixes the ranking of tokens a small training set sees rarely."""

    def freq(exs):
        counts = np.zeros(vocab_size, np.float64)
        for e in exs:
            counts += np.bincount(e.tokens[e.loss], minlength=vocab_size)[:vocab_size]
        return counts / max(counts.sum(), 1.0)

    counts = freq(examples)
    if extra:
        counts = counts + freq(extra)
    for t in always:
        counts[t] = counts.max() + 1
    top = np.argsort(-counts, kind="stable")[:k]
    return np.sort(top).astype(np.int32)

