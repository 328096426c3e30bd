"""The ``ngram`` drafter kind: prompt lookup decoding, no model.

For every row it looks for the most recent earlier occurrence of the row's
last ``n`` tokens (``n`` from :attr:`NgramDrafter.max_ngram` down to 1) in the
row's prompt + generated tokens and proposes the tokens that followed that
occurrence (padded with the last token when the continuation is short).  With
no match at all it proposes the last token repeated.

The work is host-side, once per round for the whole batch, and O(new tokens)
per row and round: each row keeps an index ``n-gram -> end position of its
most recent occurrence`` that is extended incrementally with the tokens the
row emitted since the previous round.  The proposals of all rows leave as one
``[B, n_draft]`` ``mx.array``.  Nothing here reads a device array, so the
round keeps its single host synchronisation.
"""

from __future__ import annotations

import mlx.core as mx

from ..state import DraftBlock


class _RowIndex:
    """Incremental n-gram index of one row's token sequence."""

    __slots__ = ("request", "max_ngram", "tables", "upto")

    def __init__(self, request, max_ngram: int):
        self.request = request  # identity check: a reused request id is a new row
        self.max_ngram = max_ngram
        # tables[n - 1]: n-gram tuple -> end index of its most recent occurrence
        self.tables: list[dict[tuple, int]] = [{} for _ in range(max_ngram)]
        self.upto = 0  # n-grams ending before this index are indexed

    def extend(self, seq: list[int], end: int) -> None:
        """Index every n-gram that ends at an index ``< end``."""
        tables, m = self.tables, self.max_ngram
        for j in range(self.upto, end):
            for n in range(1, min(m, j + 1) + 1):
                tables[n - 1][tuple(seq[j - n + 1 : j + 1])] = j
        self.upto = max(self.upto, end)

    def propose(self, seq: list[int], k: int) -> list[int]:
        last = len(seq) - 1
        # index all earlier n-gram ends, never the current suffix itself
        self.extend(seq, last)
        for n in range(min(self.max_ngram, len(seq)), 0, -1):
            j = self.tables[n - 1].get(tuple(seq[last - n + 1 :]))
            if j is not None:
                cont = seq[j + 1 : j + 1 + k]
                return cont + [cont[-1]] * (k - len(cont))  # cont is never empty: j < last
        return [seq[-1]] * k


class NgramDrafter:
    """Prompt-lookup drafter (``--draft-kind ngram``); loads no checkpoint."""

    kind = "ngram"
    model_types = ()  # model-free: chosen only with --draft-kind ngram
    needs = frozenset()  # reads nothing from the target
    max_ngram = 3

    def __init__(self, max_ngram: int | None = None):
        if max_ngram is not None:
            if max_ngram < 1:
                raise ValueError("max_ngram must be >= 1")
            self.max_ngram = max_ngram
        self._rows: dict[str, _RowIndex] = {}

    @classmethod
    def load(cls, path, target, options) -> "NgramDrafter":
        return cls()

    def _index(self, row) -> _RowIndex:
        req = row.request
        idx = self._rows.get(req.id)
        if idx is None or idx.request is not req:
            idx = self._rows[req.id] = _RowIndex(req, self.max_ngram)
        return idx

    def propose(self, session, state, shared, n_draft: int) -> DraftBlock:
        B = state.size
        if n_draft <= 0:
            return DraftBlock(tokens=mx.zeros((B, 0), mx.int32), n_draft=0)
        out = []
        for row in state.rows:
            seq = list(row.request.prompt) + list(row.generated)
            out.append(self._index(row).propose(seq, n_draft))
        live = {r.request.id for r in state.rows}
        if len(self._rows) > len(live):  # rows that left the batch
            self._rows = {k: v for k, v in self._rows.items() if k in live}
        return DraftBlock(tokens=mx.array(out, dtype=mx.int32), n_draft=n_draft)
