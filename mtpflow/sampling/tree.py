"""Acceptance of a verified token tree: the ancestor matrix and the accepted path."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mtpflow.sampling.logits import _as_array

__all__ = ["tree_visibility", "tree_accept"]


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
