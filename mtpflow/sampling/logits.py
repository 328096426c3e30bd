"""Logits processing: logit bias, repetition / frequency / presence penalties,
temperature, top-k, top-p and min-p (:func:`process_logits`; the order is
described in :mod:`mtpflow.sampling`)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mtpflow.sampling.params import ProcessParams

__all__ = ["token_counts", "presence_mask", "process_logits"]

_NEG_INF = float("-inf")


def token_counts(context: Any, vocab_size: int, appended: Any = None, length: int = 1, start: Any = None) -> mx.array:
    """How often each token occurs in each row's context, per position: ``[B, L, V]`` float32.

    ``context`` is ``[B, T]`` int, padded with ``-1`` (ignored); ``start``
    (optional ``[B]`` int) counts only columns ``>= start[b]`` of row ``b``
    (the completion's tokens after a prompt of that length).  ``appended``
    (optional, ``[B, L-1]``) are tokens that follow the context inside the
    block being scored -- the draft tokens during verification: position
    ``l`` also counts ``appended[:, :l]``.  Without ``appended`` all
    ``length`` positions see the same context.
    """
    V = int(vocab_size)
    ctx = mx.array(context).astype(mx.int32)
    if ctx.ndim != 2:
        raise ValueError(f"context must be [B, T], got shape {ctx.shape}")
    B, T = ctx.shape
    # Padding (-1, or anything out of range) and columns before start go to an extra dropped column.
    valid = (ctx >= 0) & (ctx < V)
    if start is not None:
        valid = valid & (mx.arange(T, dtype=mx.int32)[None] >= mx.array(start).astype(mx.int32)[:, None])
    base = mx.zeros((B, V + 1), dtype=mx.float32)
    if T > 0:
        idx = mx.where(valid, ctx, V)
        base = base.at[mx.arange(B, dtype=mx.int32)[:, None], idx].add(mx.ones(idx.shape, dtype=mx.float32))
    base = base[:, :V]  # [B, V]
    if appended is None:
        return mx.broadcast_to(base[:, None, :], (B, length, V))
    app = mx.array(appended).astype(mx.int32)  # [B, L-1]
    if app.shape[1] == 0:
        return base[:, None, :]
    onehot = (app[:, :, None] == mx.arange(V, dtype=mx.int32)[None, None, :]).astype(mx.float32)  # [B, L-1, V]
    cum = mx.cumsum(onehot, axis=1)  # position l+1 counts app[:, :l+1]
    extra = mx.concatenate([mx.zeros((B, 1, V), dtype=mx.float32), cum], axis=1)  # [B, L, V]
    return base[:, None, :] + extra


def presence_mask(context: Any, vocab_size: int, appended: Any = None, length: int = 1) -> mx.array:
    """Which tokens occur in each row's context, per position: ``[B, L, V]`` bool
    (:func:`token_counts` ``> 0``; the same arguments)."""
    return token_counts(context, vocab_size, appended=appended, length=length) > 0


def process_logits(
    logits: Any,
    params: ProcessParams,
    context: Any = None,
    appended: Any = None,
    completion_start: Any = None,
) -> mx.array:
    """Processed log-probabilities ``[B, L, V]`` (``-inf`` for removed tokens).

    ``logits``: ``[B, L, V]`` (or ``[B, V]``, then the result is ``[B, V]``).
    ``context``: ``[B, T]`` int token ids padded with ``-1``, used by the
    repetition penalty (ignored when ``None``).  ``appended``: optional
    ``[B, L-1]`` tokens inside the scored block (the drafts when verifying
    ``[last, d_1..d_k]``), so position ``l``'s penalty also counts
    ``d_1..d_l`` -- exactly what target-only decoding would have seen.
    ``completion_start``: ``[B]`` int, the column of ``context`` where each
    row's completion begins (its prompt length): the frequency and presence
    penalties count only the completion's tokens, as OpenAI's do (default 0:
    the whole context).

    Greedy rows (``temperature <= 0``) get a one-hot distribution (``0`` at
    the argmax of the biased/penalised logits, ``-inf`` elsewhere), so
    :func:`sample` and :func:`rejection_accept` reduce to argmax decoding for
    them.
    """
    x = _as_array(logits)
    squeeze = x.ndim == 2
    if squeeze:
        x = x[:, None, :]
    if x.ndim != 3:
        raise ValueError(f"logits must be [B, L, V] or [B, V], got {x.shape}")
    V = x.shape[2]
    if V != params.vocab_size:
        raise ValueError(f"logits vocab {V} != params.vocab_size {params.vocab_size}")
    x = x.astype(mx.float32)

    x = _bias_and_penalties(x, params, context, appended, completion_start)
    if params.all_greedy:
        out = _one_hot_logprobs(x)
        return out[:, 0, :] if squeeze else out

    # 3. temperature
    if params.use_temperature:
        y = x / _col(params.temperature)
    else:
        y = x
    y = _filter(y, params)
    out = y - mx.logsumexp(y, axis=-1, keepdims=True)
    if params.any_greedy:
        out = mx.where(_col(params.greedy_rows), _one_hot_logprobs(x), out)
    return out[:, 0, :] if squeeze else out


def _col(a):  # [B] -> [B, 1, 1]
    return a[:, None, None]


def _bias_and_penalties(x, params: ProcessParams, context, appended, completion_start):
    """Steps 1-2 of :func:`process_logits` on float32 ``x`` ``[B, L, V]``."""
    B, L, V = x.shape
    # 1. logit bias
    if params.bias is not None:
        x = x + params.bias[:, None, :]
    # 2. repetition penalty, then frequency and presence penalties
    if params.reads_context and (context is not None or appended is not None):
        if context is None:
            context = mx.zeros((B, 0), dtype=mx.int32)
        if params.use_repetition:
            present = presence_mask(context, V, appended=appended, length=L)
            r = _col(params.repetition_penalty)
            penalised = mx.where(x > 0, x / r, x * r)
            x = mx.where(present, penalised, x)
        if params.use_penalties:
            counts = token_counts(context, V, appended=appended, length=L, start=completion_start)
            x = x - _col(params.frequency_penalty) * counts - _col(params.presence_penalty) * (counts > 0)
    return x


def _filter(y, params: ProcessParams):
    """Steps 4-6 of :func:`process_logits`: top-k, top-p and min-p on the
    tempered logits ``y`` (removed tokens set to ``-inf``)."""
    V = y.shape[-1]
    # 4-6. filters: one descending sort shared by top-k and top-p -- of the
    # K = params.candidates largest values when every sampling row has a small
    # top-k (mx.topk is O(V); a full sort is the costliest op here), else of all V.
    if params.use_top_k or params.use_top_p:
        K = params.candidates if params.use_top_k and 0 < params.candidates < V else V
        s = -mx.sort(-(mx.topk(y, K, axis=-1) if K < V else y), axis=-1)  # [B, L, K] descending
        if params.use_top_k:
            # greedy rows (neutral top_k = V) are clamped: their result is replaced below
            k = _col(mx.minimum(params.top_k, K) if K < V else params.top_k)  # [B,1,1] in [1, K]
            kth = mx.take_along_axis(s, k - 1, axis=-1)  # [B, L, 1]
            y = mx.where(y < kth, _NEG_INF, y)
            s = mx.where(s < kth, _NEG_INF, s)
        if params.use_top_p and K < V:
            # the nucleus of the top-k distribution, whose kept tokens include any
            # ties with the k-th value past the K candidates: the normaliser counts them
            e = mx.exp(s - s[..., :1])
            ties = mx.sum(y >= kth, axis=-1, keepdims=True) - mx.sum(s >= kth, axis=-1, keepdims=True)
            sp = e / (mx.sum(e, axis=-1, keepdims=True) + ties.astype(mx.float32) * mx.exp(kth - s[..., :1]))
        elif params.use_top_p:
            sp = mx.softmax(s, axis=-1)
        if params.use_top_p:
            excl = mx.cumsum(sp, axis=-1) - sp  # mass strictly before each rank
            keep = (excl < _col(params.top_p)) & (s > _NEG_INF)
            n_keep = mx.maximum(mx.sum(keep.astype(mx.int32), axis=-1, keepdims=True), 1)
            thresh = mx.take_along_axis(s, n_keep - 1, axis=-1)  # [B, L, 1]
            y = mx.where(y < thresh, _NEG_INF, y)
    if params.use_min_p:
        # p >= min_p * p_max  <=>  y >= y_max + log(min_p)  (renormalisation
        # by earlier filters preserves probability ratios and the max).
        ymax = mx.max(y, axis=-1, keepdims=True)
        logm = mx.log(_col(params.min_p))  # -inf for min_p == 0 -> keeps all
        y = mx.where(y < ymax + logm, _NEG_INF, y)
    return y


def _as_array(x: Any) -> mx.array:
    return x if isinstance(x, mx.array) else mx.array(x)


def _one_hot_logprobs(x: mx.array) -> mx.array:
    V = x.shape[-1]
    am = mx.argmax(x, axis=-1, keepdims=True).astype(mx.int32)
    return mx.where(mx.arange(V, dtype=mx.int32) == am, 0.0, _NEG_INF).astype(mx.float32)

