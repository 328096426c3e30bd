"""Lossless speculative acceptance of a drafted chain: exact match against the
target argmax, rejection sampling, and position-keyed Gumbel coupling (see
:mod:`mtpflow.sampling`)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mtpflow.sampling.draw import _uniform, greedy_tokens, sample, split_keys
from mtpflow.sampling.logits import _NEG_INF, _as_array

__all__ = ["greedy_accept", "rejection_accept", "position_keys", "coupled_sample", "coupled_accept"]


def _prefix_count(match: mx.array) -> mx.array:
    """Length of the all-true prefix of ``match`` ``[B, k]`` -> ``[B]`` int32."""
    if match.shape[1] == 0:
        return mx.zeros((match.shape[0],), dtype=mx.int32)
    return mx.sum(mx.cumprod(match.astype(mx.int32), axis=1), axis=1).astype(mx.int32)


def greedy_accept(target_logits: Any, draft_tokens: Any, active: Any = None) -> tuple[mx.array, mx.array]:
    """Exact-match acceptance against the target argmax.

    ``target_logits`` ``[B, k+1, V]`` (raw or processed -- argmax is the
    same for greedy rows after bias/penalty; the argmax is mlx-lm's, see
    :func:`~mtpflow.sampling.draw.greedy_tokens`), ``draft_tokens`` ``[B, k]``.
    Returns ``counts`` ``[B]`` int32 (longest prefix with
    ``draft == argmax``) and ``tokens`` ``[B, k+1]`` int32 = the argmax at
    every position; the caller emits ``tokens[b, :counts[b] + 1]``.
    ``active`` ``[B]`` bool (optional): inactive rows accept nothing.
    """
    sel = greedy_tokens(target_logits)  # as mlx-lm picks a greedy token (its dtype's log-probabilities)
    k = sel.shape[1] - 1
    if k == 0:  # nothing drafted: the argmax alone
        return mx.zeros((sel.shape[0],), dtype=mx.int32), sel
    d = mx.array(draft_tokens).astype(mx.int32).reshape(sel.shape[0], k)
    match = d == sel[:, :k]
    if active is not None:
        match = match & _as_array(active)[:, None]
    counts = _prefix_count(match)
    return counts, sel


def rejection_accept(
    target_logprobs: Any,
    draft_tokens: Any,
    draft_probs: Any,
    key: Any,
    active: Any = None,
) -> tuple[mx.array, mx.array]:
    """Lossless speculative sampling (Leviathan et al. 2023, Chen et al. 2023).

    ``target_logprobs`` ``[B, k+1, V]``: the *processed* target distribution
    ``p`` (output of :func:`process_logits`) at ``[last, d_1..d_k]``.
    ``draft_tokens`` ``[B, k]``.  ``draft_probs``: the drafter's
    distribution ``q`` ``[B, k, V]`` that the drafts were *sampled* from, or
    ``None`` when the drafts were chosen deterministically (argmax): then
    ``q`` is one-hot at the draft and the rule becomes "accept ``d_i`` with
    probability ``p_i(d_i)``, on rejection sample from ``p_i`` with ``d_i``
    removed and renormalised".  (It is *wrong* to pass a softmax of the
    drafter logits for argmax drafts -- ``q`` must be the distribution the
    draft was actually drawn from.)

    Sparse / centroid heads that draw from a subset of the vocabulary pass
    ``q`` as a dense ``[B, k, V]`` array with zeros outside the support
    (rows summing to 1 over the support).

    Draft ``i`` is accepted with probability ``min(1, p_i(d_i) / q_i(d_i))``;
    at the first rejection the correction is drawn from
    ``norm(max(p_i - q_i, 0))`` (from ``p_i`` if that is all zero); if all
    ``k`` are accepted a bonus token is drawn from ``p_k``.

    Returns ``counts`` ``[B]`` int32 and ``tokens`` ``[B, k+1]`` int32 with
    ``tokens[b, :counts[b]+1]`` = accepted drafts then the correction/bonus.
    Entries after ``counts[b]`` are valid token ids but carry no meaning.
    One ``key`` (split internally), either a single PRNG key or per-row keys
    ``[B, 2]`` (see :func:`sample`); same key -> same result; no host sync.
    Greedy rows (one-hot ``p``) reduce exactly to :func:`greedy_accept`.
    ``active`` ``[B]`` bool (optional): inactive rows accept no draft and draw
    their first token from ``p`` itself (target-only sampling).
    """
    lp = _as_array(target_logprobs)
    B, k1, V = lp.shape
    k = k1 - 1
    d = mx.array(draft_tokens).astype(mx.int32).reshape(B, k)
    k_acc, k_corr, k_bonus = split_keys(key, 3)

    bonus = sample(lp[:, k, :], k_bonus)[:, None]  # [B, 1]
    if k == 0:
        return mx.zeros((B,), dtype=mx.int32), bonus

    lp_d = lp[:, :k, :]  # [B, k, V]
    p = mx.exp(lp_d)
    p_tok = mx.take_along_axis(p, d[:, :, None], axis=-1)[..., 0]  # [B, k]
    u = _uniform(k_acc, (B, k))  # [0, 1)
    if draft_probs is None:
        accept = u < p_tok
        is_draft = d[:, :, None] == mx.arange(V, dtype=mx.int32)[None, None, :]
        resid_log = mx.where(is_draft, _NEG_INF, lp_d)
        resid_empty = p_tok >= 1.0  # p is one-hot at the draft: never rejected
    else:
        q = _as_array(draft_probs).astype(mx.float32)
        q_tok = mx.take_along_axis(q, d[:, :, None], axis=-1)[..., 0]
        # u < min(1, p/q)  <=>  u * q < p   (u < 1; q = 0 means p/q = inf)
        accept = u * q_tok < p_tok
        resid = mx.maximum(p - q, 0.0)
        resid_empty = mx.sum(resid, axis=-1) <= 0.0
        resid_log = mx.log(resid)
    if active is not None:
        act = _as_array(active)[:, None]
        accept = accept & act
        resid_empty = resid_empty | ~act
    resid_log = mx.where(resid_empty[..., None], lp_d, resid_log)
    correction = sample(resid_log, k_corr)  # [B, k]

    counts = _prefix_count(accept)
    pos = mx.arange(k1, dtype=mx.int32)[None, :]
    extra = mx.concatenate([correction, bonus], axis=1)  # [B, k+1]
    d_pad = mx.concatenate([d, bonus], axis=1)
    tokens = mx.where(pos < counts[:, None], d_pad, extra)
    return counts, tokens


# --------------------------------------------------------------------------
# position-keyed Gumbel coupling


_M1, _M2, _M3 = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D


def position_keys(keys: Any, positions: Any) -> mx.array:
    """Per-row, per-position PRNG keys ``[B, L, 2]`` from row keys ``[B, 2]``
    and absolute token positions ``[B, L]``: a fixed mixing of the row key
    with the position, so a token's noise depends only on (row seed,
    position) -- not on the round, the block or the batch."""
    k = _as_array(keys).astype(mx.uint32)
    p = _as_array(positions).astype(mx.uint32)
    hi = k[:, None, 0] ^ (p * _M1)
    lo = k[:, None, 1] ^ (p * _M2 + _M3)
    return mx.stack([hi, lo], axis=-1)


def _gumbel(keys: mx.array, V: int) -> mx.array:
    B, L = keys.shape[:2]
    flat = keys.reshape(B * L, 2)
    g = mx.vmap(lambda kk: mx.random.gumbel(shape=(V,), key=kk))(flat)
    return g.reshape(B, L, V)


def coupled_sample(logprobs: Any, keys: Any, positions: Any) -> mx.array:
    """Gumbel-max samples of ``logprobs [B, L, V]`` (or ``[B, V]`` with
    ``positions [B]``), noise keyed by (row key, position): ``[B, L]`` int32."""
    lp = _as_array(logprobs)
    squeeze = lp.ndim == 2
    if squeeze:
        lp, positions = lp[:, None, :], _as_array(positions)[:, None]
    g = _gumbel(position_keys(keys, positions), lp.shape[-1])
    out = mx.argmax(lp + g, axis=-1).astype(mx.int32)
    return out[:, 0] if squeeze else out


def coupled_accept(target_logprobs: Any, draft_tokens: Any, keys: Any, positions: Any,
                   active: Any = None) -> tuple[mx.array, mx.array]:
    """Lossless acceptance by coupling (see :mod:`mtpflow.sampling`).

    ``target_logprobs`` ``[B, k+1, V]`` (processed) at ``[last, d_1..d_k]``;
    ``positions`` ``[B, k+1]``: the absolute position of the token each row
    predicts (``last``'s position + 1 + l).  Returns ``counts`` ``[B]`` and
    ``tokens`` ``[B, k+1]``: the target's coupled sample at every position --
    the accepted drafts equal it, and the entry after them is the
    correction or bonus.  Greedy rows (one-hot ``p``) reduce to
    :func:`greedy_accept`.  ``active`` ``[B]`` bool: inactive rows accept nothing."""
    t = coupled_sample(target_logprobs, keys, positions)
    k = t.shape[1] - 1
    d = mx.array(draft_tokens).astype(mx.int32).reshape(t.shape[0], k)
    match = d == t[:, :k]
    if active is not None:
        match = match & _as_array(active)[:, None]
    return _prefix_count(match), t

