"""A batched Gated DeltaNet (linear-attention) layer cache that rolls back per row.

A hybrid-attention target (Qwen3.5, Qwen3-Next) interleaves full-attention
layers (:class:`~mtpflow.targets.cache.SlotKVCache`) with Gated DeltaNet
layers, whose cache is a short causal-convolution window ``conv [B, K-1, C]``
and a recurrent state ``recurrent [B, Hv, Dv, Dk]``.  The state cannot be
trimmed like K/V slots: a rejected draft must leave it as if the draft never
ran.  :class:`RecurrentCache` gives it the same per-row semantics as the slot
cache:

* ragged left-padded prefill: padding positions (negative) are masked, so
  they neither enter the convolution window (zeros, as a fresh row's empty
  window) nor update the state;
* a verify of ``T`` tokens records, per forward, what a rollback needs (see
  :attr:`RecurrentCache.mode`); :meth:`rollback` then leaves each row's conv
  window and state as after its own accepted prefix ``keep[b]`` (one batched,
  lazy pass: no host synchronisation);
* :meth:`select` / :meth:`merge` follow rows leaving and joining; compaction
  has nothing to do (the state has a fixed size).

Two rollback modes, chosen per cache (``mode``):

``"steps"`` (default)
    the verify keeps the state after every step (they are computed anyway);
    a rollback gathers the state after ``keep[b]`` steps.
``"replay"``
    the verify keeps the state before it and the step inputs ``(q, k, v, g,
    beta)``; a rollback replays the ``T`` steps from that snapshot with a
    mask ``t < keep[b]`` (a masked step leaves the state as it is).

Both give the state a fresh prefill of the accepted prefix gives, bitwise
(the same per-step ops in the same order); ``benchmarks`` and
``docs/hybrid.md`` compare their cost.
"""

from __future__ import annotations

import mlx.core as mx

#: rollback modes (see the module docstring)
MODES = ("steps", "replay")


_aranges: dict = {}


def arange(n: int) -> mx.array:
    """``arange(n)`` in int32, one array per ``n`` up to 256: made once, it is
    a constant in every later graph (index arrays a round uses again and again)."""
    if n > 256:
        return mx.arange(n, dtype=mx.int32)
    a = _aranges.get(n)
    if a is None:
        a = _aranges[n] = mx.arange(n, dtype=mx.int32)
    return a


def _step(q, k, v, g, beta, state, mask=None):
    """One Gated DeltaNet step (mlx-lm's compiled ops; heads already repeated)."""
    from mlx_lm.models.gated_delta import _gated_delta_step_ops

    return _gated_delta_step_ops(q, k, v, g, beta, state, mask)


class RecurrentCache:
    """The cache of one Gated DeltaNet layer for a batch of rows (see the module docstring)."""

    #: the longest forward whose per-step record is kept (a verify block; a
    #: longer forward is a prefill chunk, which is never rolled back)
    max_record = 64

    def __init__(self, kernel: int, mode: str = "steps", record: bool = True):
        if mode not in MODES:
            raise ValueError(f"rollback mode {mode!r}: use one of {', '.join(MODES)}")
        self.kernel = kernel
        self.mode = mode
        #: keep what a rollback of the next forwards needs (off while prefilling:
        #: a prompt is never rolled back, and per-step states of a long chunk are large)
        self.record = record
        self.conv = None  # [B, K-1, C]
        self.recurrent = None  # [B, Hv, Dv, Dk] float32
        self.offset = None  # [B] int32: position of the next token per row
        #: host-side: some row of the next forward starts at a negative
        #: position (left padding): mask those steps (set by the prefill)
        self.padded = False
        self._last = None  # the last forward's record (see _record)

    @property
    def dense(self) -> bool:
        return not self.padded

    @dense.setter
    def dense(self, value: bool) -> None:
        # the prefill says whether its rows are all of one length (no left padding)
        self.padded = not value

    # -- what the layer calls --------------------------------------------------------
    def make_mask(self, N: int, **kwargs):
        """``[B, N]`` (false: a left-padding step) or ``None`` (no padding)."""
        if not self.padded:
            return None
        return (self.offset[:, None] + arange(N)[None]) >= 0

    def conv_input(self, qkv: mx.array) -> mx.array:
        """``[B, K-1+S, C]``: the window before this forward, then ``qkv``."""
        B, S, C = qkv.shape
        old = self.conv if self.conv is not None else mx.zeros((B, self.kernel - 1, C), qkv.dtype)
        return mx.concatenate([old, qkv], axis=1)

    def update(self, conv_in, q, k, v, g, beta, mask=None) -> mx.array:
        """Run the recurrence over ``S`` steps from the cached state (``q, k``
        normalised, ``g`` the decay, ``beta`` the write strength, heads not yet
        repeated), keep what a rollback needs, store the new window and state;
        returns the outputs ``y [B, S, Hv, Dv]``."""
        B, S, Hk, Dk = q.shape
        Hv, Dv = v.shape[-2:]
        prev = self.recurrent if self.recurrent is not None else mx.zeros((B, Hv, Dv, Dk), mx.float32)
        if Hv // Hk > 1:
            q = mx.repeat(q, Hv // Hk, -2)
            k = mx.repeat(k, Hv // Hk, -2)
        record = self.record and S <= self.max_record
        state, ys, steps = prev, [], []
        for t in range(S):
            y, state = _step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state, None if mask is None else mask[:, t])
            ys.append(y)
            if record and self.mode == "steps":
                steps.append(state)
        if not record:
            self._last = None
        elif self.mode == "steps":
            self._last = (S, conv_in, prev, steps)
        else:
            self._last = (S, conv_in, prev, (q, k, v, g, beta))
        self.conv = conv_in[:, -(self.kernel - 1) :]
        self.recurrent = state
        return mx.stack(ys, axis=1)

    # -- rolling back ----------------------------------------------------------------
    def _restore(self, n: mx.array | int, host: list[int] | None = None) -> None:
        """Leave the window and state as after the first ``n`` (per row, ``>= 0``)
        tokens of the last forward (``host``: ``n`` on the host, if known)."""
        if self._last is None:
            raise RuntimeError(f"the last forward was not recorded (a prefill, or more than {self.max_record} tokens); "
                               "it cannot be rolled back")
        S, conv_in, prev, rec = self._last
        K1 = self.kernel - 1
        if isinstance(n, int):  # every row the same: static slices
            self.conv = conv_in[:, n : n + K1]
            if n == 0:
                self.recurrent = prev
            elif self.mode == "steps":
                self.recurrent = rec[n - 1]
            else:
                self.recurrent = self._replay(prev, rec, n)
            return
        idx = n[:, None] + arange(K1).astype(n.dtype)[None]
        self.conv = mx.take_along_axis(conv_in, idx[:, :, None], axis=1)
        if self.mode == "steps" and host is not None:
            # each row's state, sliced from the step it stopped at: B states move, not B * (S + 1)
            states = [prev, *rec]
            self.recurrent = mx.concatenate([states[m][b : b + 1] for b, m in enumerate(host)], axis=0)
        elif self.mode == "steps":
            allst = mx.stack([prev, *rec], axis=1)  # [B, S+1, Hv, Dv, Dk]
            self.recurrent = mx.take_along_axis(allst, n[:, None, None, None, None], axis=1)[:, 0]
        else:
            self.recurrent = self._replay(prev, rec, n)

    @staticmethod
    def _replay(prev, rec, n):
        """The state after ``n`` steps, replayed from ``prev`` (masked past ``n``)."""
        q, k, v, g, beta = rec
        S = q.shape[1]
        state = prev
        for t in range(S if not isinstance(n, int) else n):
            m = None if isinstance(n, int) else (t < n)
            _, state = _step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state, m)
        return state

    def rollback(self, block: int, keep: mx.array, next_pos: mx.array, trim: int, ragged: bool = True,
                 kept: list[int] | None = None) -> None:
        """After a verify over ``block`` tokens keep the first ``keep[b]`` of
        them in row ``b`` (the slot cache's signature; ``trim``: tokens every
        row rejected, ``ragged=False``: every row keeps ``block - trim``;
        ``kept``: ``keep`` on the host, if the caller has it)."""
        if not ragged:
            if trim:
                self._restore(block - trim)
        else:
            self._restore(keep, kept)
        self.offset = next_pos

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens of the last forward in every row."""
        if n:
            self._restore(self._last[0] - n)
            self.offset = self.offset - n
        return n

    def keep(self, block, keep, next_pos, trim) -> None:
        raise RuntimeError("a linear-attention layer cannot verify trees; draft chains on this target")

    # -- batch changes ---------------------------------------------------------------
    def select(self, rows: mx.array) -> None:
        """Keep only the given batch rows."""
        if self.conv is not None:
            self.conv = self.conv[rows]
            self.recurrent = self.recurrent[rows]
        if self.offset is not None:
            self.offset = self.offset[rows]
        self._last = None

    def merge_layers(self, layer: list["RecurrentCache"]) -> "RecurrentCache":
        """The caches of several batches of this layer, stacked (rows joining)."""
        tmpl = next(c for c in layer if c.conv is not None)
        out = type(self)(tmpl.kernel, tmpl.mode)
        out.conv = mx.concatenate([c.conv for c in layer], axis=0)
        out.recurrent = mx.concatenate([c.recurrent for c in layer], axis=0)
        out.offset = mx.concatenate([c.offset for c in layer], axis=0)
        return out

    # -- protocol odds and ends --------------------------------------------------------
    def is_trimmable(self) -> bool:
        return False

    def size(self) -> int:
        return 0

    @property
    def state(self) -> tuple:
        """``(conv window, recurrent state)`` (what to evaluate or save)."""
        return (self.conv, self.recurrent)

    @property
    def nbytes(self) -> int:
        return 0 if self.conv is None else self.conv.nbytes + self.recurrent.nbytes


class ScanCache(RecurrentCache):
    """The cache of a recurrent layer given by its step function (a Mamba2
    mixer's selective scan, or any other): :meth:`scan` runs ``y_t, s_t =
    step(x_t..., s_{t-1})`` over a forward's steps and keeps what a rollback
    needs, as :meth:`RecurrentCache.update` does for Gated DeltaNet -- the state
    after every step (``"steps"``), or the state before the forward and the
    step inputs (``"replay"``: the rollback runs ``step`` again, masked past
    each row's kept count).  Rollback, trim, rows leaving and joining are the
    base class's."""

    def scan(self, conv_in: mx.array, step, xs: tuple, init, mask=None) -> mx.array:
        """Run ``step`` over the ``S`` steps of ``xs`` (arrays ``[B, S, ...]``)
        from the cached state (``init``: the zero state's shape, for a new
        cache); a step with ``mask[:, t]`` false leaves a row's state as it is
        (left padding).  Stores ``conv_in``'s last ``K - 1`` entries as the
        window; returns the outputs stacked on axis 1."""
        S = xs[0].shape[1]
        prev = self.recurrent if self.recurrent is not None else mx.zeros(init, mx.float32)
        record = self.record and S <= self.max_record
        state, ys, steps = prev, [], []
        for t in range(S):
            state, y = self._advance(step, [x[:, t] for x in xs], state, None if mask is None else mask[:, t])
            ys.append(y)
            if record and self.mode == "steps":
                steps.append(state)
        if not record:
            self._last = None
        elif self.mode == "steps":
            self._last = (S, conv_in, prev, steps)
        else:
            self._last = (S, conv_in, prev, (step, xs))
        self.conv = conv_in[:, -(self.kernel - 1) :]
        self.recurrent = state
        return mx.stack(ys, axis=1)

    @staticmethod
    def _advance(step, x, state, m):
        y, new = step(*x, state)
        if m is not None:
            new = mx.where(m.reshape((-1,) + (1,) * (new.ndim - 1)), new, state)
        return new, y

    def _replay(self, prev, rec, n):
        """The state after ``n`` steps, replayed from ``prev`` (masked past ``n``)."""
        step, xs = rec
        S = xs[0].shape[1]
        state = prev
        for t in range(S if not isinstance(n, int) else n):
            state, _ = self._advance(step, [x[:, t] for x in xs], state, None if isinstance(n, int) else (t < n))
        return state
