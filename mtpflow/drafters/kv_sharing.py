"""What the KV-sharing drafter kinds share (the Gemma 4 assistant, ``mtp``, and
mtpflow's generic assistant, ``assistant``): the propose loop, which reads the
target's last hidden state and store-layer K/V, and the hand-over mask.

The mask: which handed-over K/V slots a drafting step attends to ("clean"
hand-over).

``positions`` are the slots' absolute positions (negative = empty/rejected),
``bonus`` the position of the row's last, unverified token.  Full-attention
layers see every accepted position before ``bonus``; sliding layers see the
last ``window + 1`` of them (transformers' bidirectional-mask quirk, spec L7),
that is positions ``[bonus - window - 1, bonus - 1]``.
"""

from __future__ import annotations

import mlx.core as mx

from ..state import DraftBlock
from ..targets.base import SLIDING
from .base import TreeBuilder

#: RoPE position of the drafter's query relative to the bonus token's position:
#: ``"bonus"`` (transformers, default) or ``"bonus-1"`` (mlx-vlm's convention).
POSITION_CONVENTIONS = {"bonus": 0, "bonus-1": -1}


def drafter_mask(positions: mx.array, bonus: mx.array, window: int | None) -> mx.array:
    """Boolean mask ``[B, 1, 1, S]`` for one query per row."""
    b = bonus[:, None]
    m = (positions >= 0) & (positions < b)
    if window is not None:
        m = m & (positions >= b - window - 1)
    return m[:, None, None, :]


class KVSharingDrafter:
    """The propose loop of a drafter whose model steps on the target's last
    hidden state and store-layer K/V (``model``: ``layer_types``,
    ``sliding_window``, ``step``, ``step_many``, ``head_argmax``,
    ``head_support``)."""

    needs = frozenset({"hidden", "shared_kv"})

    def __init__(self, model, position_convention: str = "bonus"):
        if position_convention not in POSITION_CONVENTIONS:
            raise ValueError(
                f"unknown drafter position convention {position_convention!r}; use one of {sorted(POSITION_CONVENTIONS)}"
            )
        self.model = model
        self.position_shift = POSITION_CONVENTIONS[position_convention]
        self.layer_types = sorted(set(model.layer_types))

    def lookahead_safe(self, state) -> bool:
        """A draft reads only the round's inputs (last tokens, hidden states,
        positions) and the target's K/V by position, all device arrays: the
        next round can be drafted on this round's lazy outcome, before its
        sync (:class:`mtpflow.api.LookaheadSafe`)."""
        return True

    def round_inputs(self, shared):
        """K/V and masks for one round (constant over the block's steps)."""
        kv, masks = {}, {}
        for t in self.layer_types:
            view = shared.kv[t]
            kv[t] = (view.keys, view.values)
            window = self.model.sliding_window if t == SLIDING else None
            masks[t] = drafter_mask(view.positions, shared.bonus_position, window)
        return kv, masks

    def propose_tree(self, session, state, shared, shape) -> DraftBlock:
        """A tree of candidates (:class:`~mtpflow.state.TreeShape`): every
        depth runs one drafting step for the whole frontier at once, each
        node expanded into its top children (a static shape), or the
        ``width`` children with the highest cumulative draft log-probability
        among all (a dynamic, EAGLE-2-style tree, re-ranked to its ``budget``
        by :func:`~mtpflow.drafters.base.finish_tree`).  A child's state is
        its parent's output, as along a chain."""
        B = state.size
        embed = session.target.embed
        kv, masks = self.round_inputs(shared)
        pos = shared.bonus_position + self.position_shift
        tok = shared.last_tokens[:, None]  # the frontier: [B, F]
        h = shared.hidden[:, None, :]
        grow = TreeBuilder(shape, B)
        for d in range(shape.levels):
            F = tok.shape[1]
            e = embed(tok)
            x = mx.concatenate([e, h.astype(e.dtype)], axis=-1)
            final, hn = self.model.step_many(x, kv, masks, mx.broadcast_to(pos[:, None], (B, F)))
            ids, lg = self.model.head_support(final)  # [B, F, S]
            tok, parent = grow.expand(d, lg, ids)
            grow.add(d, tok, parent)
            h = mx.take_along_axis(hn, parent[:, :, None], axis=1)
        return grow.finish()

    def propose(self, session, state, shared, n_draft: int) -> DraftBlock:
        B = shared.last_tokens.shape[0]
        if n_draft <= 0:
            return DraftBlock(tokens=mx.zeros((B, 0), mx.int32), n_draft=0)
        embed = session.target.embed
        kv, masks = self.round_inputs(shared)
        pos = shared.bonus_position + self.position_shift
        tok, h = shared.last_tokens, shared.hidden
        out = []
        for _ in range(n_draft):
            x = mx.concatenate([embed(tok), h], axis=-1)
            final, h = self.model.step(x, kv, masks, pos)
            tok = self.model.head_argmax(final)
            out.append(tok)
        return DraftBlock(tokens=mx.stack(out, axis=1), n_draft=n_draft)
