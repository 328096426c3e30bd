"""Drawing tokens: PRNG keys (one per batch or one per row), categorical and
argmax draws, and the target-only decoding step (:func:`sample_logits`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from mtpflow.sampling.logits import _as_array, process_logits
from mtpflow.sampling.params import ProcessParams

__all__ = ["split_keys", "row_keys", "sample", "greedy", "sample_logits"]


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


def greedy_tokens(logits: Any) -> mx.array:
    """The greedy token of raw logits ``[..., V] -> [...]`` int32, picked as mlx-lm's and
    mlx-vlm's generate loops pick it: the argmax of the log-probabilities ``logits -
    logsumexp(logits)``, computed in the logits' own dtype.  In bf16 the log-probabilities sit
    on a coarser grid than the logits (a log-probability near -9 has a step of 1/16, a logit
    near 1 one of 1/128), so two nearly tied logits can round to one log-probability, and
    argmax then takes the lower id where an argmax of the logits would take the other (a
    random Gemma 4 pair in bf16: 1 step in 256, enough to part a 32-token greedy output from
    mlx-lm's on 1 prompt in 8)."""
    x = _as_array(logits)
    return mx.argmax(x - mx.logsumexp(x, axis=-1, keepdims=True), axis=-1).astype(mx.int32)


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

