"""Drafter LM heads, registered as plugins (``mtpflow.builtins.heads``).

A head turns the drafter's final hidden state ``[B, Dd]`` into a next-token
choice.  Heads receive the tied embedding matrix ``E`` ``[V, Dd]`` at call
time (it belongs to the drafter body), so their own parameters load under the
checkpoint's names.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


class TiedDenseHead(nn.Module):
    """``logits = final @ E^T`` (26B/31B assistants).  No softcap, no scaling."""

    name = "tied_dense"

    @classmethod
    def from_config(cls, config, vocab_size: int, hidden_size: int, **context) -> "TiedDenseHead":
        return cls()

    def __call__(self, x: mx.array, E: mx.array) -> mx.array:
        return x @ E.T

    def argmax(self, x: mx.array, E: mx.array) -> mx.array:
        return mx.argmax(self(x, E), axis=-1).astype(mx.int32)

    def support(self, x: mx.array, E: mx.array):
        """``(ids, logits)`` of the tokens the head can draft (all of them)."""
        lg = self(x, E)
        ids = mx.broadcast_to(mx.arange(lg.shape[-1], dtype=mx.int32), lg.shape)
        return ids, lg


class CentroidHead(nn.Module):
    """Centroid-routed sparse head (E2B/E4B assistants, spec §5).

    ``C`` centroids score the hidden state; the top ``K`` clusters' ``V/C``
    tokens each (``token_ordering`` viewed as ``[C, V/C]``) are scored against
    ``E``.  :meth:`argmax` never builds vocab-sized logits; :meth:`__call__`
    reproduces the reference's dense output (``min - 1`` outside the selection,
    taken per row).
    """

    name = "centroid"

    def __init__(self, num_centroids: int, top_k: int, vocab_size: int, hidden_size: int):
        super().__init__()
        self.num_centroids = num_centroids
        self.top_k = top_k
        self.vocab_size = vocab_size
        self.centroids = nn.Linear(hidden_size, num_centroids, bias=False)
        self.token_ordering = mx.arange(vocab_size, dtype=mx.int32)

    @classmethod
    def from_config(cls, config, vocab_size: int, hidden_size: int, **context) -> "CentroidHead":
        return cls(config.num_centroids, config.centroid_top_k, vocab_size, hidden_size)

    def select(self, x: mx.array) -> mx.array:
        """Token ids of the top-K clusters, ``[B, K * V/C]``."""
        c = self.centroids(x)
        top = mx.argpartition(-c, self.top_k - 1, axis=-1)[..., : self.top_k]
        table = self.token_ordering.reshape(self.num_centroids, -1)
        return table[top].reshape(*x.shape[:-1], -1)

    def support(self, x: mx.array, E: mx.array):
        ids = self.select(x)
        lg = (E[ids] * x[..., None, :]).sum(-1)
        return ids, lg

    def argmax(self, x: mx.array, E: mx.array) -> mx.array:
        ids, lg = self.support(x, E)
        best = mx.argmax(lg, axis=-1, keepdims=True)
        return mx.take_along_axis(ids, best, axis=-1)[..., 0].astype(mx.int32)

    def __call__(self, x: mx.array, E: mx.array) -> mx.array:
        ids, lg = self.support(x, E)
        fill = lg.min(axis=-1, keepdims=True) - 1.0
        out = mx.broadcast_to(fill, (*x.shape[:-1], self.vocab_size))
        return mx.put_along_axis(out, ids, lg, axis=-1)
