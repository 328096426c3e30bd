"""Prefix caching across requests: the target's K/V of finished rows, reused.

A multi-turn chat re-sends its history every turn.  With ``[batch]
prefix_cache_mb > 0`` every row that leaves the batch leaves the target's K/V
of its sequence (prompt and answer) in an LRU bounded in bytes, as mlx-lm's
server and vLLM's automatic prefix caching keep theirs; a new prompt that
starts with a stored sequence prefills only its new suffix, on a copy of the
stored K/V -- speculation on, the output unchanged (the cached K/V are the
ones the target computed for those very tokens).

Not used for prompts with media, nor with drafters that read target layers
(``layer:N`` needs: their prefill needs the prompt's hidden states).  A
sliding-window layer keeps only its window, so a stored entry is reused up
to a length whose window it still holds.
"""

from __future__ import annotations

from collections import OrderedDict

import mlx.core as mx

from ..targets.cache import SlotKVCache


class _Entry:
    def __init__(self, tokens: tuple, layers: list, nbytes: int):
        self.tokens, self.layers, self.nbytes = tokens, layers, nbytes


def _own(x: mx.array) -> mx.array:
    """``x`` (a slice) copied into a buffer of its own (tests/test_prefix_cache.py
    checks with MLX's memory counters that the parent is released)."""
    return mx.contiguous(x)


def _common(a, b) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """LRU of ``{token sequence: per-layer (keys, values, positions, window, retain)}``."""

    def __init__(self, max_bytes: int, min_tokens: int = 8):
        self.max_bytes, self.min_tokens = int(max_bytes), int(min_tokens)
        self.entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = self.tokens_reused = 0

    # -- storing -----------------------------------------------------------------------
    def store(self, tokens, cache: list[SlotKVCache], row: int) -> None:
        """Keep row ``row`` of the batch ``cache`` as the K/V of ``tokens``
        (the positions ``0 .. len(tokens)-1`` the cache holds for it)."""
        tokens = tuple(int(t) for t in tokens)
        if len(tokens) < self.min_tokens or self.max_bytes <= 0:
            return
        layers, nbytes = [], 0
        for c in cache:
            k, v, p = c.view()
            # copies into buffers of their own: a slice would keep the whole
            # batch cache (every row, every spare slot) alive while counting one row
            k, v = _own(k[row : row + 1]), _own(v[row : row + 1])
            p = mx.where(p[row : row + 1] < len(tokens), p[row : row + 1], -1)  # nothing past the stored sequence
            mx.eval(k, v, p)
            held = frozenset(x for x in p[0].tolist() if x >= 0)
            layers.append((k, v, p, c.window, c.retain, held))
            nbytes += k.nbytes + v.nbytes + p.nbytes
        if nbytes > self.max_bytes:
            return
        self.entries.pop(tokens, None)
        self.entries[tokens] = _Entry(tokens, layers, nbytes)
        self.bytes = sum(e.nbytes for e in self.entries.values())
        while self.bytes > self.max_bytes and self.entries:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.nbytes

    # -- reusing -----------------------------------------------------------------------
    def lookup(self, prompt) -> tuple[int, list[SlotKVCache]] | None:
        """``(n, cache)``: a one-row cache holding the target's K/V of
        ``prompt[:n]`` (the longest stored prefix, ``n < len(prompt)``), or
        ``None``."""
        prompt = tuple(prompt)
        best, best_n = None, 0
        for key, e in self.entries.items():
            n = min(_common(key, prompt), len(prompt) - 1)
            if n > best_n and self._covers(e, n):
                best, best_n = e, n
        if best is None or best_n < self.min_tokens:
            self.misses += 1
            return None
        self.entries.move_to_end(best.tokens)
        self.hits += 1
        self.tokens_reused += best_n
        out = []
        for k, v, p, window, retain, _ in best.layers:
            c = SlotKVCache(window=window, retain=retain)
            c.keys, c.values = k, v
            c.positions = mx.where(p < best_n, p, -1)
            c.idx = p.shape[1]
            c.offset = mx.array([best_n], dtype=mx.int32)
            out.append(c)
        return best_n, out

    @staticmethod
    def _covers(e: _Entry, n: int) -> bool:
        """Every layer still holds the positions prefix ``n``'s next query needs."""
        for _, _, _, window, _, held in e.layers:
            need = range(max(0, n - window) if window else 0, n)
            if any(i not in held for i in need):
                return False
        return True

    def describe(self) -> dict:
        return {"entries": len(self.entries), "bytes": self.bytes, "hits": self.hits, "misses": self.misses,
                "tokens_reused": self.tokens_reused}
