"""The ``dflash`` drafter kind: one drafter forward per block.

* The target's prefill and every verify expose the outputs of the
  checkpoint's ``target_layer_ids`` (``needs = {"layer:l+1", ...}``);
  :meth:`DFlashDrafter.prefilled` and :meth:`DFlashDrafter.commit` project
  the features of every new *accepted* position once into each drafter
  layer's context K/V (its own :class:`~mtpflow.targets.cache.SlotKVCache`,
  rows keyed by request; rejected positions never enter it).
* :meth:`DFlashDrafter.propose` runs the block ``[last, mask x n]`` at the
  positions that follow, all layers at once, and takes each block position's
  argmax through the target's LM head.  The block's own K/V are not kept (the
  reference crops them every round).

Drafts are argmax choices; the rejection sampler verifies them with a
one-hot ``q``, so sampling stays lossless.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from ...errors import IncompatibleDrafter
from ...state import DraftBlock
from ...targets.base import read_config
from ...targets.cache import SlotKVCache
from ..base import RowCaches, TreeBuilder, load_weights
from .config import DFlashConfig, check_compatible, is_dflash
from .model import DFlashModel


class DFlashDrafter:
    kind = "dflash"
    model_types = ()  # recognised by matches(): z-lab configs say model_type "qwen3"
    needs = frozenset()  # an instance needs its checkpoint's target layers
    #: ``mtpflow train --kind dflash`` (mtpflow.api.TrainableDrafter)
    train_kind, trainer = "dflash", "mtpflow.drafters.dflash.train:DFlashTrainer"
    #: the last rounds draft up to the remaining budget, as dflash_generate
    #: does (a block's drafts depend on its length: the block is non-causal)
    drafts_to_budget = True

    def __init__(self, model: DFlashModel, cfg: DFlashConfig, target, extra: int = 24):
        self.model, self.cfg, self.target = model, cfg, target
        self.needs = frozenset(f"layer:{i}" for i in cfg.taps)
        self.extra = extra
        self.rows = RowCaches()

    def reset(self) -> None:
        self.rows.reset()

    # -- the checkpoint -------------------------------------------------------------------
    @classmethod
    def matches(cls, config: dict) -> bool:
        return is_dflash(config)

    @classmethod
    def check(cls, target_config: dict, drafter_config: dict, drafter_path=None):
        return check_compatible(target_config, drafter_config, drafter_path)

    @classmethod
    def recommended_block_size(cls, config: dict, path=None) -> int | None:
        dc = config.get("dflash_config") or {}
        return int(dc.get("block_size") or config.get("block_size") or 0) or None

    @classmethod
    def max_block_size(cls, config: dict) -> int | None:
        """The largest block the checkpoint was trained for."""
        return cls.recommended_block_size(config)

    @classmethod
    def load(cls, path, target, options) -> "DFlashDrafter":
        path = Path(path)
        cfg = check_compatible(target.config, read_config(path), path)
        model = DFlashModel(cfg)
        load_weights(model, path, options.dtype, "DFlash checkpoint")
        return cls(model, cfg, target, extra=(options.config.draft.max_block_size + 8) if options.config else 24)

    # -- pieces ---------------------------------------------------------------------------
    def _features(self, state):
        return mx.concatenate([state.taps[i] for i in self.cfg.taps], axis=-1)

    def _new_caches(self):
        out = []
        for layer in self.model.layers:
            w = layer.window
            out.append(SlotKVCache(window=w, retain=None if w is None else w + 1 + self.extra))
        return out

    def _take_in(self, caches, state) -> None:
        """Append the context K/V of the last forward's valid positions."""
        pos = state.fwd_positions
        # the position of column 0, for RoPE: a verify block starts at a valid
        # position (rejected drafts trail it); a left-padded prompt row starts
        # as many positions before 0 as it has padding columns
        first = mx.where(pos[:, 0] >= 0, pos[:, 0], -mx.sum(pos < 0, axis=1))
        for c, (k, v) in zip(caches, self.model.context_kv(self._features(state), first)):
            c.offset = mx.zeros((k.shape[0],), dtype=mx.int32)
            c.update_and_fetch(k, v)
            L = k.shape[2]
            c.positions[:, c.idx - L : c.idx] = pos

    def _masks(self, caches, q):
        """Per layer ``[B, 1, L, S + L]`` for block queries at positions ``q [B, L]``."""
        out = []
        L = q.shape[1]
        for layer, c in zip(self.model.layers, caches):
            kpos = c.positions[:, : c.idx]
            ctx = (kpos[:, None, :] >= 0) & (kpos[:, None, :] <= q[:, :, None])
            blk = mx.ones((1, L, L), dtype=mx.bool_)
            if layer.causal:
                blk = mx.tril(blk)
            if layer.window is not None:
                ctx = ctx & (q[:, :, None] - kpos[:, None, :] < layer.window)
                blk = blk & ((mx.arange(L)[:, None] - mx.arange(L)[None, :]) < layer.window)[None]
            out.append(mx.concatenate([ctx, mx.broadcast_to(blk, (q.shape[0], L, L))], axis=-1)[:, None])
        return out

    # -- the engine's calls ---------------------------------------------------------------
    def prefilled(self, session, state) -> None:
        caches = self._new_caches()
        self._take_in(caches, state)
        mx.async_eval([c.keys for c in caches] + [c.values for c in caches])
        self.rows.add([r.request for r in state.rows], caches, {})

    def commit(self, session, state, accepted) -> None:
        self.rows.sync(state.rows)
        self._take_in(self.rows.caches, state)
        rows = [r.position for r in state.rows]
        session.target.compact(self.rows.caches, n_valid_max=max(rows), min_positions=rows)
        mx.async_eval([c.keys for c in self.rows.caches] + [c.values for c in self.rows.caches])

    def _block_logits(self, state, n_draft: int):
        """Target-head logits ``[B, n_draft, V]`` of one block forward."""
        B = state.size
        self.rows.sync(state.rows)
        caches = self.rows.caches
        L = n_draft + 1
        ids = mx.concatenate([state.last_tokens[:, None], mx.full((B, n_draft), self.cfg.mask_token_id, mx.int32)], axis=1)
        x = self.target.embed_table(ids)
        if self.cfg.input_embedding_scale != 1.0:
            x = x * self.cfg.input_embedding_scale
        q = state.positions[:, None] + mx.arange(L, dtype=mx.int32)[None]
        kv = [c.view()[:2] for c in caches]
        hidden = self.model.block(x, state.positions, kv, self._masks(caches, q))
        raw = self.target.raw_logits(hidden[:, 1:])
        if self.cfg.output_multiplier != 1.0:
            raw = raw * self.cfg.output_multiplier
        return self.target.softcapped(raw)

    def propose_tree(self, session, state, shared, shape) -> DraftBlock:
        """A tree over the block's per-position distributions (DDTree-style):
        one block forward gives every depth's distribution; a static shape
        expands each node into that depth's top tokens, a dynamic one keeps,
        best first, the ``width`` candidates of highest cumulative
        log-probability per depth (re-ranked to its ``budget``)."""
        B, D = state.size, shape.levels
        if D + 1 > self.cfg.block_size:
            raise IncompatibleDrafter(f"tree depth {D} needs a block of {D + 1}, above this checkpoint's {self.cfg.block_size}")
        lg = self._block_logits(state, D)  # [B, D, V]
        grow = TreeBuilder(shape, B)
        for d in range(D):  # every node of a depth shares that depth's distribution
            tok, parent = grow.expand(d, lg[:, d : d + 1])
            grow.add(d, tok, parent)
        return grow.finish()

    def propose(self, session, state, shared, n_draft: int) -> DraftBlock:
        B = state.size
        if n_draft <= 0:
            return DraftBlock(tokens=mx.zeros((B, 0), mx.int32), n_draft=0)
        if n_draft + 1 > self.cfg.block_size:
            raise IncompatibleDrafter(
                f"block size {n_draft + 1} is above this DFlash checkpoint's block_size {self.cfg.block_size}"
            )
        logits = self._block_logits(state, n_draft)
        return DraftBlock(tokens=mx.argmax(logits, axis=-1).astype(mx.int32), n_draft=n_draft)
