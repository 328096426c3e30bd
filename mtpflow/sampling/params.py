"""The per-row processing parameters of one batch, as device arrays (:class:`ProcessParams`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from attrs import field, frozen

from mtpflow.state import SamplingParams, array_field

__all__ = ["ProcessParams"]


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
