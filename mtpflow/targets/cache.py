"""A batched, position-tracking KV cache that can roll back per row.

Every slot stores one token's K/V together with its absolute position for
each row (``positions[b, s]``; negative = empty, left padding or rejected).
Masks are derived from positions, so

* rows of different lengths share one cache (left padding is just negative
  positions),
* a row rolls back by invalidating its rejected slots -- other rows keep
  theirs (ragged acceptance), and trailing slots rejected by every row are
  physically trimmed,
* a sliding-window layer never wraps: it keeps its slots in position order and
  compacts (drops slots older than ``retain`` positions) in bulk, so rolling
  back after a rotation is always exact and the drafter can read the window
  in position order.

The cache follows mlx-lm's cache protocol (``update_and_fetch``, ``offset``,
``make_mask``, ``trim``) so mlx-lm's model code runs on it unchanged.
``offset`` is an ``[B]`` int32 array: the position of the first token of the
forward in progress for every row.
"""

from __future__ import annotations

from contextlib import contextmanager

import mlx.core as mx


class SlotKVCache:
    step = 256
    #: a dense sliding layer whose window drops no slot gets the ``"causal"`` mask, as a full
    #: layer does (``False``: an array mask, the masks before; ``scripts/lowp_equality.py
    #: --paths before`` compares the two)
    causal_in_window = True
    #: a dense sliding layer past its window hands a one-query step its last ``window`` slots in a
    #: buffer of their own (``None``: on a CUDA GPU).  MLX's CUDA attention runs a one-query step over
    #: >= 256 keys through cuDNN when the keys look like a slice of a cache buffer of whole
    #: 256-slot steps, and then reads them from the buffer's start (mlx 0.32: ``unslice_kv``
    #: drops the slice's offset): right for mlx-lm's caches, whose slices start at slot 0, wrong
    #: for a window that starts later.  Its own buffer of ``window`` slots is what mlx-lm's
    #: rotating cache hands over, so the kernel is the one mlx-lm's step runs
    window_buffer: bool | None = None
    #: where a layer gets the ``"causal"`` mask, hand it as the boolean array it stands for
    #: (``None``: on a CPU device).  MLX has no attention kernel on a CPU: its fallback expands
    #: ``"causal"`` into that array in every layer (6 graph nodes a layer), while one array
    #: built here is shared by the layers of the forward.  The same values bit for bit; on a
    #: GPU the string picks the causal kernel, so it stays
    causal_array: bool | None = None
    #: :meth:`rollback` takes a lazy ``keep`` and ``next_pos`` with ``trim=0`` (the rejected
    #: slots stay as holes, masked by position): a drafting round built before the previous
    #: round's sync rolls that round back so (``mtpflow.builtins.stages._lookahead_chain``)
    lazy_rollback = True

    def __init__(self, window: int | None = None, retain: int | None = None):
        self.window = window
        # a sliding layer keeps at least `retain` past positions (>= window)
        self.retain = retain if retain is not None else window
        self.keys = None
        self.values = None
        self.positions = None  # [B, cap] int32
        self.idx = 0  # slots in use
        self.offset = None  # [B] int32, position of the next token per row
        #: host-side: every used slot is valid and every row holds the same
        #: consecutive positions (equal-length prompts, no holes); then a
        #: single query needs no mask (and a sliding layer sees its last
        #: ``window`` slots), as with mlx-lm's own caches.  Only the target's
        #: prefill sets it; whatever may leave a hole clears it.
        self.dense = False
        #: a tree verify in progress: ``(positions [B, N], visible [B, N, N])``
        #: -- the new slots' positions (root + depth) and which of them each
        #: query sees (its ancestors and itself), see :meth:`tree`; ``visible``
        #: may be ``[B, N, T + N]``, also covering the last ``T`` old slots
        self._tree = None

    # -- mlx-lm protocol -------------------------------------------------------------
    def _grow(self, B: int, n_kv: int, hd_k: int, hd_v: int, n_new: int, dtype) -> None:
        need = self.idx + n_new
        cap = 0 if self.keys is None else self.keys.shape[2]
        if need <= cap:
            return
        n = ((need - cap + self.step - 1) // self.step) * self.step
        k = mx.zeros((B, n_kv, n, hd_k), dtype)
        v = mx.zeros((B, n_kv, n, hd_v), dtype)
        p = mx.full((B, n), -1, mx.int32)
        if self.keys is None:
            self.keys, self.values, self.positions = k, v, p
        else:
            self.keys = mx.concatenate([self.keys[..., : self.idx, :], k], axis=2)
            self.values = mx.concatenate([self.values[..., : self.idx, :], v], axis=2)
            self.positions = mx.concatenate([self.positions[:, : self.idx], p], axis=1)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        B, n_kv, L, hd = keys.shape
        self._grow(B, n_kv, hd, values.shape[3], L, keys.dtype)
        prev = self.idx
        self.idx += L
        self.keys[..., prev : self.idx, :] = keys
        self.values[..., prev : self.idx, :] = values
        if self._tree is not None:
            self.positions[:, prev : self.idx] = self._tree[0]
            self.offset = self.offset + L
        else:
            new_pos, self.offset = _advance(self.offset, L)
            self.positions[:, prev : self.idx] = new_pos
            if self._windowed(L):  # the slots a single query sees (see make_mask)
                lo = self.idx - self.window
                k, v = self.keys[..., lo : self.idx, :], self.values[..., lo : self.idx, :]
                own = self.window_buffer if self.window_buffer is not None else _on_cuda()
                if own:
                    rows = mx.arange(lo, self.idx)
                    k, v = mx.take(self.keys, rows, axis=2), mx.take(self.values, rows, axis=2)
                return k, v
        return self.keys[..., : self.idx, :], self.values[..., : self.idx, :]

    def _windowed(self, N: int) -> bool:
        """A dense sliding cache past its window, read by one query: attention
        runs over the last ``window`` slots with no mask."""
        return self.dense and N == 1 and self.window is not None and self.idx > self.window

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None, **kwargs):
        """Mask ``[B, 1, N, idx + N]`` for the next ``N`` queries (called before
        ``update_and_fetch``)."""
        window = window_size if window_size is not None else self.window
        if self._tree is not None:
            return self._tree_mask(N, window)
        if self.dense and (window_size is None or window_size == self.window):
            if N == 1:
                return None  # every slot it is given is visible (see _windowed)
            if not return_array and (self.window is None or (self.causal_in_window and self.idx + N <= self.window)):
                # every query sees every slot up to its own: the window (if any) drops none of them.
                # The same mask mlx-lm passes, so a GPU runs the same attention kernel (an array
                # mask takes another one there); on a CPU, the array it stands for (causal_array)
                return _causal(self.idx, N) if _causal_as_array(self.causal_array) else "causal"
        if N == 1 and self.idx:
            # one query per row (a null round): the cache never holds a slot
            # past it, so it sees the valid old slots inside its window and itself
            old = self.positions[:, : self.idx]
            seen = old >= 0 if window is None else old > mx.maximum(self.offset - window, -1)[:, None]
            return mx.pad(seen, ((0, 0), (0, 1)), constant_values=True)[:, None, None]
        q = self.offset[:, None] + mx.arange(N, dtype=mx.int32)[None]  # [B, N]
        old = self.positions[:, : self.idx] if self.idx else mx.zeros((q.shape[0], 0), mx.int32)
        kv = mx.concatenate([old, q], axis=1)  # [B, S]
        qe, kve = q[:, :, None], kv[:, None, :]
        mask = (kve >= 0) & (kve <= qe)
        if window is not None:
            mask = mask & (kve > qe - window)
        if N > 1:
            # every query may see its own slot, so a left-padded query (prefill)
            # never has an empty row (NaN); decoding rows always see themselves
            own = mx.arange(self.idx, self.idx + N)[:, None] == mx.arange(self.idx + N)[None, :]
            mask = mask | own[None]
        return mask[:, None]

    def _tree_mask(self, N: int, window):
        """Tree verify: each node sees the valid old slots before it (within the
        window) and, among the new slots, its own ancestors and itself.  A
        ``visible`` wider than ``N`` (``[B, N, T + N]``) also covers the ``T``
        slots before the new ones: tree nodes an earlier forward of the same
        tree appended (a drafter growing its tree level by level)."""
        q, visible = self._tree
        split = self.idx - (visible.shape[-1] - N)  # the slots before it are context, seen by position
        old = self.positions[:, :split] if split else mx.zeros((q.shape[0], 0), mx.int32)
        om = (old[:, None, :] >= 0) & (old[:, None, :] <= q[:, :, None])
        nm = visible
        if window is not None:
            tp = mx.concatenate([self.positions[:, split : self.idx], q], axis=1) if split < self.idx else q
            om = om & (old[:, None, :] > q[:, :, None] - window)
            nm = nm & (tp[:, None, :] > q[:, :, None] - window)
        return mx.concatenate([om, nm], axis=-1)[:, None]

    @contextmanager
    def tree(self, positions: mx.array, visible: mx.array):
        """Within this block the next forward is a tree verify: its slots get
        ``positions`` and its queries see only ``visible`` among themselves."""
        self._tree = (positions, visible)
        try:
            yield self
        finally:
            self._tree = None

    def keep(self, block: int, keep: mx.array, next_pos: mx.array, trim: int) -> None:
        """After a tree verify over ``block`` slots: invalidate the slots with
        ``keep[b, i]`` false (rejected branches), set each row's next position
        and drop ``trim`` trailing slots no row kept."""
        start = self.idx - block
        tail = self.positions[:, start : self.idx]
        self.positions[:, start : self.idx] = mx.where(keep, tail, -1)
        self.dense = False
        self.idx -= trim
        self.offset = next_pos

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.idx, n)
        self.idx -= n
        self.offset = self.offset - n
        return n

    def size(self) -> int:
        return self.idx

    @property
    def state(self):
        return self.view()

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes + self.positions.nbytes

    # -- mtpflow extensions ----------------------------------------------------------
    def view(self):
        """``(keys, values, positions)`` of the used slots, in slot order."""
        return self.keys[..., : self.idx, :], self.values[..., : self.idx, :], self.positions[:, : self.idx]

    def rollback(self, block: int, keep: mx.array, next_pos: mx.array, trim: int, ragged: bool = True,
                 kept: list[int] | None = None) -> None:
        """After a verify over ``block`` slots, keep the first ``keep[b]`` of them
        in row ``b``, invalidate the rest, set each row's next position and
        physically drop ``trim`` trailing slots (rejected by every row).
        ``ragged=False`` says every row keeps the same number of slots: then
        the trim alone removes every rejected slot.  ``kept``: ``keep`` on the
        host, when the caller has it (a cache of another kind may use it)."""
        start = self.idx - block
        if block > 0 and ragged:
            rel = mx.arange(block, dtype=mx.int32)[None]
            tail = self.positions[:, start : self.idx]
            self.positions[:, start : self.idx] = mx.where(rel < keep[:, None], tail, -1)
            self.dense = False
        self.idx -= trim
        self.offset = next_pos

    def select(self, rows: mx.array) -> None:
        """Keep only the given batch rows (rows that finished leave)."""
        if self.keys is not None:
            self.keys = self.keys[rows]
            self.values = self.values[rows]
            self.positions = self.positions[rows]
        if self.offset is not None:
            self.offset = self.offset[rows]

    def compact(self, n_keep: int, min_position: mx.array | None = None) -> None:
        """Rewrite the slots so every row's valid slots (optionally only those at
        positions ``>= min_position[b]``) are the last ``n_keep`` slots, in
        position order; emptier rows get empty slots on the left."""
        if self.keys is None:
            return
        pos = self.positions[:, : self.idx]
        valid = pos >= 0
        if min_position is not None:
            valid = valid & (pos >= min_position[:, None])
        # order: invalid slots first (by slot), then valid ones by position
        key = mx.where(valid, pos, -1 - self.idx + mx.arange(self.idx, dtype=mx.int32)[None])
        order = mx.argsort(key, axis=1)[:, self.idx - n_keep :]
        B = pos.shape[0]
        newpos = mx.take_along_axis(mx.where(valid, pos, -1), order, axis=1)
        gather = order[:, None, :, None]
        keys = mx.take_along_axis(self.keys[..., : self.idx, :], gather, axis=2)
        values = mx.take_along_axis(self.values[..., : self.idx, :], gather, axis=2)
        positions = newpos.reshape(B, n_keep)
        # the buffer keeps a whole number of steps, as mlx-lm's KVCache does: on CUDA a one-query
        # step over >= 256 keys runs cuDNN only on keys sliced from such a buffer (else the vector
        # kernel), so a compacted cache would run another kernel than a fresh one or mlx-lm's
        pad = -n_keep % self.step
        if pad:
            keys = mx.pad(keys, ((0, 0), (0, 0), (0, pad), (0, 0)))
            values = mx.pad(values, ((0, 0), (0, 0), (0, pad), (0, 0)))
            positions = mx.pad(positions, ((0, 0), (0, pad)), constant_values=-1)
        self.keys, self.values, self.positions = keys, values, positions
        self.idx = n_keep


_last_advance: tuple = (None, 0, None, None)
_gpu: bool | None = None
_cpu: bool | None = None


def _on_cuda() -> bool:
    """Whether MLX's default device is a CUDA GPU, whose cuDNN decoding path reads a slice from
    its buffer's start (asked once; Metal's kernels take the slice's offset)."""
    global _gpu
    if _gpu is None:
        cuda = getattr(mx, "cuda", None)
        _gpu = mx.default_device().type == mx.DeviceType.gpu and cuda is not None and cuda.is_available()
    return _gpu


def _causal_as_array(setting: bool | None) -> bool:
    """``causal_array``, with ``None`` read as whether MLX's default device is a CPU (asked once)."""
    global _cpu
    if setting is not None:
        return setting
    if _cpu is None:
        from ..backend.profiles import device_kind

        _cpu = device_kind() == "cpu"
    return _cpu


def _causal(idx: int, N: int) -> mx.array:
    """The ``[N, idx + N]`` boolean mask MLX's attention fallback builds for ``"causal"``:
    query ``i`` (at slot ``idx + i``) sees slots ``0 .. idx + i``."""
    return mx.arange(idx, idx + N)[:, None] >= mx.arange(idx + N)[None]


def _advance(offset: mx.array, L: int):
    """``(positions of the next L slots [B, L], offset + L)``; the layers of one
    forward share an ``offset`` array, so they share these too (a one-entry
    memo: one graph node per forward instead of one per layer)."""
    global _last_advance
    o, n, pos, nxt = _last_advance
    if o is offset and n == L:
        return pos, nxt
    pos = offset[:, None] + mx.arange(L, dtype=mx.int32)[None]
    nxt = offset + L
    _last_advance = (offset, L, pos, nxt)
    return pos, nxt


def merge_caches(caches: list[list[SlotKVCache]]) -> list[SlotKVCache]:
    """Stack the per-layer caches of several batches (continuous batching):
    slot axes are right-aligned, shorter ones padded with empty slots."""
    out = []
    for layer in zip(*caches):
        if hasattr(layer[0], "merge_layers"):  # a layer of several caches merges itself
            out.append(layer[0].merge_layers(list(layer)))
            continue
        width = max(c.idx for c in layer)
        tmpl = next(c for c in layer if c.keys is not None)
        merged = SlotKVCache(window=tmpl.window, retain=tmpl.retain)
        ks, vs, ps, offs = [], [], [], []
        for c in layer:
            k, v, p = c.view()
            pad = width - c.idx
            if pad:
                B, H, _, hk = k.shape
                k = mx.concatenate([mx.zeros((B, H, pad, hk), k.dtype), k], axis=2)
                v = mx.concatenate([mx.zeros((B, H, pad, v.shape[3]), v.dtype), v], axis=2)
                p = mx.concatenate([mx.full((B, pad), -1, mx.int32), p], axis=1)
            ks.append(k)
            vs.append(v)
            ps.append(p)
            offs.append(c.offset)
        merged.keys = mx.concatenate(ks, axis=0)
        merged.values = mx.concatenate(vs, axis=0)
        merged.positions = mx.concatenate(ps, axis=0)
        merged.offset = mx.concatenate(offs, axis=0)
        merged.idx = width
        out.append(merged)
    return out
