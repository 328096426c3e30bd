"""Sampling and lossless speculative acceptance as pure MLX functions.

Everything here is vectorised over the batch ``B`` and the position axis
``L``; no function performs a host sync (no ``.item()``, ``.tolist()`` or
``mx.eval``), so they can be fused into one lazy graph (and ``mx.compile``-d).
Output shapes depend only on input shapes.

Processing pipeline (:func:`process_logits`), applied per row in this order --
the same function is used for target-only decoding, for the drafter's own
distribution and for verification, so every path sees the same distribution:

1. logit bias (dense ``[B, V]`` built once from each row's ``logit_bias``),
2. repetition penalty (HF semantics: tokens present in the row's context get
   ``x / r`` if ``x > 0`` else ``x * r``), then OpenAI's frequency and presence
   penalties over the tokens the row generated (``x - count * frequency -
   (count > 0) * presence``); while verifying, position ``l`` also counts the
   drafts before it (:func:`token_counts`), as target-only decoding would,
3. temperature (greedy rows, ``temperature <= 0``, are turned into a one-hot
   distribution at the argmax of the logits after steps 1-2),
4. top-k (``0`` = disabled; ties with the k-th value are kept, as in HF),
5. top-p / nucleus (keep the smallest prefix of the sorted distribution whose
   mass reaches ``top_p``; ties with the last kept value are kept),
6. min-p (keep tokens with ``p >= min_p * max(p)``).

The result is a log-softmax; removed tokens get ``-inf``.

Speculative acceptance:

* :func:`greedy_accept` -- exact-match against the target argmax.
* :func:`coupled_accept` -- position-keyed Gumbel coupling: the target's token
  at every verified position is drawn by Gumbel-max with noise keyed by the
  row's seed and that **absolute position** (:func:`position_keys`), and a
  draft is accepted while it equals it.  Lossless (each emitted token is an
  exact sample of the processed target distribution given its prefix), and
  the output is exactly what target-only sampling with the same seed gives:
  it does not depend on the drafts, the block size, the batch or the round.
  For drafts chosen deterministically (argmax, ``q`` one-hot) a draft is
  accepted with probability ``p(d)``, the same as rejection sampling.
* :func:`rejection_accept` -- Leviathan et al. / Chen et al. speculative
  sampling, for drafts *sampled* from a drafter distribution ``q``;
  lossless, i.e. the emitted tokens are distributed exactly as target-only
  sampling from the processed target distribution.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from attrs import field, frozen

from mtpflow.state import SamplingParams, array_field

__all__ = [
    "ProcessParams",
    "process_logits",
    "presence_mask",
    "token_counts",
    "greedy_accept",
    "rejection_accept",
    "sample",
    "greedy",
    "sample_logits",
    "split_keys",
    "row_keys",
    "position_keys",
    "coupled_sample",
    "coupled_accept",
    "tree_visibility",
    "tree_accept",
]

_NEG_INF = float("-inf")


@frozen(kw_only=True)
class ProcessParams:
    """Per-row processing parameters of one batch, as device arrays.

    Build with :meth:`from_rows`.  Arrays are ``[B]`` (``bias``: ``[B, V]``).
    The ``use_*`` flags are static python booleans computed at construction
    time so that disabled processors cost nothing; a row for which a processor
    is disabled gets a neutral value (``top_k = V``, ``top_p = inf``,
    ``min_p = 0``, ``repetition_penalty = 1``), so mixed batches are exact.
    """

    vocab_size: int
    temperature: Any = array_field()  # [B] float32, 1.0 for greedy rows
    greedy_rows: Any = array_field()  # [B] bool
    top_k: Any = array_field()  # [B] int32 in [1, V]
    top_p: Any = array_field()  # [B] float32 in (0, 1), +inf = disabled
    min_p: Any = array_field()  # [B] float32 in [0, 1]
    repetition_penalty: Any = array_field()  # [B] float32 > 0
    bias: Any = array_field(default=None)  # [B, V] float32 or None
    frequency_penalty: Any = array_field(default=None)  # [B] float32, or None when no row has one
    presence_penalty: Any = array_field(default=None)  # [B] float32, or None when no row has one
    any_greedy: bool = False
    all_greedy: bool = False
    use_temperature: bool = False
    use_top_k: bool = False
    use_top_p: bool = False
    use_min_p: bool = False
    use_repetition: bool = False
    #: a row has a frequency or presence penalty (they count the completion's tokens)
    use_penalties: bool = False
    #: how many of the largest values the top-k / top-p filters need: the
    #: largest top-k of the sampling rows when every one has a top-k of at
    #: most V / 4 (found with ``mx.topk``, no full sort), else V (a full sort)
    candidates: int = 0
    seeds: tuple = field(default=())

    @property
    def batch_size(self) -> int:
        return int(self.temperature.shape[0])

    @property
    def reads_context(self) -> bool:
        """Whether processing reads the rows' tokens (a repetition, frequency or presence penalty)."""
        return self.use_repetition or self.use_penalties

    @classmethod
    def from_rows(cls, rows: Sequence[SamplingParams], vocab_size: int) -> ProcessParams:
        """Build from one :class:`~mtpflow.state.SamplingParams` per row."""
        V = int(vocab_size)
        B = len(rows)
        if B == 0:
            raise ValueError("ProcessParams.from_rows needs at least one row")
        greedy_rows = [r.temperature <= 0.0 for r in rows]
        temps = [1.0 if g else float(r.temperature) for g, r in zip(greedy_rows, rows)]
        top_k = []
        top_p = []
        min_p = []
        rep = []
        for r in rows:
            k = int(r.top_k)
            top_k.append(V if k <= 0 or k >= V else k)
            p = float(r.top_p)
            if not (p > 0.0):
                raise ValueError(f"top_p must be > 0, got {p}")
            # >= 1 disables the filter: +inf so float error in the cumulative
            # sum can never drop a tail token of such a row in a mixed batch.
            top_p.append(p if p < 1.0 else math.inf)
            mp = float(r.min_p)
            if mp < 0.0 or mp > 1.0:
                raise ValueError(f"min_p must be in [0, 1], got {mp}")
            min_p.append(mp)
            rp = float(r.repetition_penalty)
            if not (rp > 0.0):
                raise ValueError(f"repetition_penalty must be > 0, got {rp}")
            rep.append(rp)
        bias = None
        if any(r.logit_bias for r in rows):
            dense = np.zeros((B, V), dtype=np.float32)
            for b, r in enumerate(rows):
                for tok, val in r.logit_bias.items():
                    tok = int(tok)
                    if not 0 <= tok < V:
                        raise ValueError(f"logit_bias token {tok} outside vocab of {V}")
                    dense[b, tok] += float(val)
            bias = mx.array(dense)
        freq = [float(r.frequency_penalty) for r in rows]
        pres = [float(r.presence_penalty) for r in rows]
        use_penalties = any(freq) or any(pres)
        # Greedy rows ignore the sampling filters: the static flags reflect
        # only sampling rows.
        samp = [not g for g in greedy_rows]
        k_max = max((k for sm, k in zip(samp, top_k) if sm), default=V)
        return cls(
            vocab_size=V,
            temperature=mx.array(temps, dtype=mx.float32),
            greedy_rows=mx.array(greedy_rows),
            top_k=mx.array(top_k, dtype=mx.int32),
            top_p=mx.array(top_p, dtype=mx.float32),
            min_p=mx.array(min_p, dtype=mx.float32),
            repetition_penalty=mx.array(rep, dtype=mx.float32),
            bias=bias,
            frequency_penalty=mx.array(freq, dtype=mx.float32) if use_penalties else None,
            presence_penalty=mx.array(pres, dtype=mx.float32) if use_penalties else None,
            any_greedy=any(greedy_rows),
            all_greedy=all(greedy_rows),
            use_temperature=any(s and t != 1.0 for s, t in zip(samp, temps)),
            use_top_k=any(s and k < V for s, k in zip(samp, top_k)),
            use_top_p=any(s and p < 1.0 for s, p in zip(samp, top_p)),
            use_min_p=any(s and m > 0.0 for s, m in zip(samp, min_p)),
            use_repetition=any(r != 1.0 for r in rep),
            use_penalties=use_penalties,
            candidates=k_max if 4 * k_max <= V else V,
            seeds=tuple(r.seed for r in rows),
        )


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


# --------------------------------------------------------------------------
# sampling


def _is_row_keys(key: Any) -> bool:
    return key is not None and key.ndim == 2


def split_keys(key: Any, num: int = 2) -> mx.array:
    """Split a key (``[2]`` -> ``[num, 2]``) or per-row keys (``[B, 2]`` ->
    ``[num, B, 2]``, each row split independently)."""
    key = _as_array(key)
    if _is_row_keys(key):
        return mx.swapaxes(mx.vmap(lambda k: mx.random.split(k, num))(key), 0, 1)
    return mx.random.split(key, num)


def row_keys(seeds: Sequence[int | None], key: Any = None) -> mx.array:
    """Per-row keys ``[B, 2]``: ``mx.random.key(seed)`` for seeded rows, a
    split of ``key`` (default ``key(0)``) for the others.  Construction-time
    helper (python loop over rows)."""
    base = mx.random.split(_as_array(key) if key is not None else mx.random.key(0), len(seeds))
    seeded = [(i, int(s)) for i, s in enumerate(seeds) if s is not None]
    if not seeded:
        return base
    out = np.array(base)
    for i, s in seeded:
        out[i] = np.array(mx.random.key(s))
    return mx.array(out)


def _uniform(key: mx.array, shape: tuple[int, ...]) -> mx.array:
    if _is_row_keys(key):
        return mx.vmap(lambda k: mx.random.uniform(shape=shape[1:], key=k))(key)
    return mx.random.uniform(shape=shape, key=key)


def sample(logprobs: Any, key: Any) -> mx.array:
    """Categorical sample along the last axis (``[B, ..., V] -> [B, ...]`` int32).

    ``logprobs`` may be unnormalised log-weights; ``-inf`` entries are never
    drawn.  ``key`` is one PRNG key (``[2]``) or per-row keys (``[B, 2]``;
    then row ``b`` depends only on ``key[b]``, whatever else is in the
    batch).  Same key -> same output.
    """
    lp = _as_array(logprobs)
    key = _as_array(key)
    if _is_row_keys(key):
        # Gumbel-max with per-row noise: mx.random.categorical cannot be
        # vmapped over inputs of rank > 1 (its sampler uses searchsorted).
        noise = mx.vmap(lambda k: mx.random.gumbel(shape=lp.shape[1:], key=k))(key)
        out = mx.argmax(lp + noise, axis=-1)
    else:
        out = mx.random.categorical(lp, axis=-1, key=key)
    return out.astype(mx.int32)


def greedy(logprobs: Any) -> mx.array:
    """Argmax along the last axis (``[..., V] -> [...]`` int32)."""
    return mx.argmax(logprobs, axis=-1).astype(mx.int32)


def sample_logits(
    logits: Any,
    params: ProcessParams,
    key: Any = None,
    context: Any = None,
) -> mx.array:
    """Target-only decoding step: process ``[B, V]`` logits and draw ``[B]``.

    Uses argmax (no key needed) when every row is greedy.
    """
    lp = process_logits(logits, params, context=context)
    if params.all_greedy:
        return greedy(lp)
    if key is None:
        raise ValueError("sample_logits needs a PRNG key for sampling rows")
    return sample(lp, key)


# --------------------------------------------------------------------------
# speculative acceptance


def _prefix_count(match: mx.array) -> mx.array:
    """Length of the all-true prefix of ``match`` ``[B, k]`` -> ``[B]`` int32."""
    if match.shape[1] == 0:
        return mx.zeros((match.shape[0],), dtype=mx.int32)
    return mx.sum(mx.cumprod(match.astype(mx.int32), axis=1), axis=1).astype(mx.int32)


def greedy_accept(target_logits: Any, draft_tokens: Any, active: Any = None) -> tuple[mx.array, mx.array]:
    """Exact-match acceptance against the target argmax.

    ``target_logits`` ``[B, k+1, V]`` (raw or processed -- argmax is the
    same for greedy rows after bias/penalty), ``draft_tokens`` ``[B, k]``.
    Returns ``counts`` ``[B]`` int32 (longest prefix with
    ``draft == argmax``) and ``tokens`` ``[B, k+1]`` int32 = the argmax at
    every position; the caller emits ``tokens[b, :counts[b] + 1]``.
    ``active`` ``[B]`` bool (optional): inactive rows accept nothing.
    """
    sel = mx.argmax(_as_array(target_logits), axis=-1).astype(mx.int32)
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
    """Lossless acceptance by coupling (see the module docstring).

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


# --------------------------------------------------------------------------
# trees


def tree_visibility(parents: Any, depth: int) -> mx.array:
    """Ancestor-or-self matrix ``[B, N, N]`` of the verified inputs (root
    first) from ``parents`` ``[B, N]`` (input index of each input's parent,
    ``-1`` for the root), for trees of at most ``depth`` levels."""
    par = _as_array(parents).astype(mx.int32)
    B, N = par.shape
    eye = mx.broadcast_to(mx.eye(N, dtype=mx.bool_)[None], (B, N, N))
    vis = eye
    cur = par
    for _ in range(depth):
        valid = cur >= 0
        hit = (mx.arange(N)[None, None, :] == mx.maximum(cur, 0)[:, :, None]) & valid[:, :, None]
        vis = vis | hit
        cur = mx.where(valid, mx.take_along_axis(par, mx.maximum(cur, 0), axis=1), -1)
    return vis


def tree_accept(samples: Any, tokens: Any, parents: Any, depth: Any, visible: Any, max_depth: int,
                active: Any = None) -> tuple[mx.array, mx.array, mx.array]:
    """Walk a verified tree: from the root, step to the child whose token
    equals the target's sample at its parent, as long as there is one.

    ``samples`` ``[B, N]``: the target's token at each input's next position
    (argmax for greedy rows, :func:`coupled_sample` otherwise); ``tokens``
    ``[B, N]`` the inputs (root first); ``parents`` ``[B, N]`` (root: -1);
    ``depth`` ``[B, N]`` (root: 0); ``visible``: :func:`tree_visibility`.
    Siblings must carry distinct tokens.  Returns ``counts`` ``[B]`` (the
    accepted depth), ``out`` ``[B, D+1]`` (the accepted path's tokens, then
    the target's sample after it: the correction or bonus) and ``path``
    ``[B, D]`` (input index of the accepted node at each depth 1..D).
    Lossless for greedy and coupled samples alike: every emitted token is the
    target's own sample given its prefix."""
    t = _as_array(samples).astype(mx.int32)
    tok = _as_array(tokens).astype(mx.int32)
    par = _as_array(parents).astype(mx.int32)
    dep = _as_array(depth).astype(mx.int32)
    B, N = tok.shape
    safe = mx.maximum(par, 0)
    match = (tok == mx.take_along_axis(t, safe, axis=1)) & (par >= 0)
    if active is not None:
        match = match & _as_array(active)[:, None]
    is_root = par < 0
    acc = is_root
    for _ in range(max_depth):
        acc = is_root | (match & mx.take_along_axis(acc, safe, axis=1))
    score = mx.where(acc, dep, -1)
    deepest = mx.argmax(score, axis=1).astype(mx.int32)  # [B]
    counts = mx.take_along_axis(dep, deepest[:, None], axis=1)[:, 0]
    onpath = mx.take_along_axis(_as_array(visible), deepest[:, None, None], axis=1)[:, 0]  # [B, N]
    levels = mx.arange(1, max_depth + 1, dtype=mx.int32)
    at = onpath[:, None, :] & (dep[:, None, :] == levels[None, :, None])  # [B, D, N]
    path = mx.argmax(at, axis=-1).astype(mx.int32)  # [B, D]
    path_tok = mx.take_along_axis(tok, path, axis=1)
    bonus = mx.take_along_axis(t, deepest[:, None], axis=1)
    pos = mx.arange(max_depth + 1, dtype=mx.int32)[None]
    padded = mx.concatenate([path_tok, bonus], axis=1)
    out = mx.where(pos < counts[:, None], padded, mx.broadcast_to(bonus, padded.shape))
    return counts.astype(mx.int32), out, path
