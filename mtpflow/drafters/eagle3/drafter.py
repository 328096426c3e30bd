"""The ``eagle3`` drafter kind: EAGLE-3 heads as vLLM and SGLang serve them.

Per round, with no host synchronisation of its own:

* the target's prefill and every verify expose the hidden states of the
  drafter's three layers (``needs = {"layer:a", "layer:b", "layer:c"}``);
* :meth:`Eagle3Drafter.prefilled` and :meth:`Eagle3Drafter.commit` run the
  drafter's step 0 over the new context pairs (token ``x_{p+1}`` with the
  target's states at ``p``, at position ``p + 1``) -- the prompt after
  prefill, the accepted prefix plus the bonus token after each verify --
  appending their K/V to the drafter's own cache (one
  :class:`~mtpflow.targets.cache.SlotKVCache`, rows keyed by request) and
  keeping each row's last output, from which the next block's first draft
  comes; the chain entries of the last block are dropped first, so the cache
  holds exactly the accepted context (rolled back like the target's);
* :meth:`Eagle3Drafter.propose` drafts the first token from that output and
  chains the rest: the drafted token's embedding with the fed-back state, at
  its own position, attending to the context and to the block's own chain
  (a sliding window stays anchored at the block's first position, as in
  speculators' training-time test);
* :meth:`Eagle3Drafter.propose_tree` drafts a tree instead (EAGLE-2's
  dynamic trees, or a static shape): one step per depth for the whole
  frontier, each node's K/V appended to the drafter's cache and seen only by
  its own descendants; :meth:`commit` drops those slots as it drops a
  chain's.

Drafts are chosen by argmax over the draft vocabulary and mapped to target
ids with ``d2t``; the rejection sampler verifies them with a one-hot ``q``.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from ...state import DraftBlock
from ...targets.base import read_config
from ...targets.cache import SlotKVCache
from ..base import RowCaches, TreeBuilder, load_weights, tree_visibility_step
from .config import Eagle3Config, check_compatible, is_eagle3, safetensors_shapes
from .model import Eagle3Model


class Eagle3Drafter:
    kind = "eagle3"
    model_types = ()  # recognised by matches(): Speculators configs carry no model_type of their own
    needs = frozenset()  # an instance needs its checkpoint's three target layers
    #: ``mtpflow train --kind eagle3`` (mtpflow.api.TrainableDrafter)
    train_kind, trainer = "eagle3", "mtpflow.drafters.eagle3.train:Eagle3Trainer"

    def __init__(self, model: Eagle3Model, cfg: Eagle3Config, target):
        self.model, self.cfg, self.target = model, cfg, target
        self.needs = frozenset(f"layer:{i}" for i in cfg.aux_layer_ids)
        self.window = cfg.sliding_window
        self.reset()

    def reset(self) -> None:
        # one cache (the decoder layer's) and, per row, the step-0 output at its
        # last context pair ("last_out", [B, H]): the next block's first draft
        self.rows = RowCaches()
        self.chain = 0  # chain slots at the end of the cache (the last block's drafts)

    @property
    def cache(self) -> SlotKVCache:
        return self.rows.caches[0]

    @property
    def last_out(self):
        return self.rows.extras["last_out"]

    # -- the checkpoint -------------------------------------------------------------------
    @classmethod
    def matches(cls, config: dict) -> bool:
        return is_eagle3(config)

    @classmethod
    def check(cls, target_config: dict, drafter_config: dict, drafter_path=None):
        return check_compatible(target_config, drafter_config, drafter_path)

    @classmethod
    def recommended_block_size(cls, config: dict, path=None) -> int | None:
        methods = (config.get("speculators_config") or {}).get("proposal_methods") or []
        n = methods[0].get("speculative_tokens") if methods else None
        return int(n) + 1 if isinstance(n, int) and n >= 0 else None

    @classmethod
    def load(cls, path, target, options) -> "Eagle3Drafter":
        path = Path(path)
        cfg = check_compatible(target.config, read_config(path), path)
        shapes = safetensors_shapes(path)
        has_embed = "embed_tokens.weight" in shapes
        model = Eagle3Model(cfg, has_embed=has_embed, has_t2d="t2d" in shapes)
        # a full-vocabulary head may come without a mapping: draft id = target id
        load_weights(model, path, options.dtype, "EAGLE-3 checkpoint", defaults={"d2t": mx.zeros((cfg.draft_vocab_size,), mx.int32)})
        return cls(model, cfg, target)

    # -- pieces of a step -----------------------------------------------------------------
    def embed(self, tokens):
        m = self.model
        if "embed_tokens" in m:
            return m.embed_tokens(tokens)
        return self.target.embed_table(tokens)  # the target's own table, unscaled (as vLLM / SGLang)

    def _mask(self, kpos, qpos, anchor):
        """``[B, 1, Lq, S]``: valid keys at positions ``<= qpos`` and, with a
        window, ``> anchor - W`` (``anchor``: the query's step-0 position)."""
        k = kpos[:, None, :]
        m = (k >= 0) & (k <= qpos[:, :, None])
        if self.window is not None:
            m = m & (k > anchor[:, :, None] - self.window)
        return m[:, None]

    def _append(self, cache: SlotKVCache, k, v, positions):
        """Append ``k, v [B, kvh, L, hd]`` at explicit slot ``positions [B, L]`` (-1: empty)."""
        cache.offset = mx.zeros((k.shape[0],), dtype=mx.int32)
        keys, values = cache.update_and_fetch(k, v)
        L = k.shape[2]
        cache.positions[:, cache.idx - L : cache.idx] = positions
        return keys, values

    def _context(self, cache: SlotKVCache, tokens, g, positions):
        """Step 0 over context pairs (``tokens [B, L]`` with ``g [B, L, n*Ht]`` at
        ``positions [B, L]``, -1 = no pair): appends their K/V, returns the outputs."""
        layer = self.model.layer
        h0 = self.model.first_hidden(g)
        safe = mx.maximum(positions, 0)
        q, k, v, res = layer.project(self.embed(tokens), h0, safe)
        keys, values = self._append(cache, k, v, positions)
        kpos = cache.positions[:, : cache.idx]
        mask = self._mask(kpos, positions, positions)
        # a row with no pair here still sees its own slot: no empty softmax
        S, L = cache.idx, positions.shape[1]
        own = (mx.arange(S)[None, :] == (S - L + mx.arange(L))[:, None])[None, None]
        return layer.finish(q, keys, values, mask | own, res)

    def _taps(self, state):
        return mx.concatenate([state.taps[i] for i in self.cfg.aux_layer_ids], axis=-1)

    # -- the engine's calls ---------------------------------------------------------------
    def prefilled(self, session, state) -> None:
        """New rows: step 0 over their prompts (pairs ``x_{p+1}``, ``g_p``)."""
        tokens = mx.concatenate([state.fwd_tokens[:, 1:], state.last_tokens[:, None]], axis=1)
        pos = state.fwd_positions
        positions = mx.where(pos >= 0, pos + 1, -1)
        extra = session.max_block_size + 8
        cache = SlotKVCache(window=self.window, retain=None if self.window is None else self.window + 1 + extra)
        out = self._context(cache, tokens, self._taps(state), positions)
        last = out[:, -1]
        mx.async_eval(cache.keys, cache.values, last)
        self.rows.add([r.request for r in state.rows], [cache], {"last_out": last})

    def _drop_chain(self) -> None:
        """Drop the last proposal's chain (or tree) slots, the last ``chain``
        of every row, before the rows change: a proposal never committed (a
        round that failed after drafting) leaves them behind."""
        if self.chain:
            self.cache.trim(self.chain)
            self.chain = 0

    def commit(self, session, state, accepted) -> None:
        """After a verify: drop the block's chain, take in the accepted pairs."""
        self._drop_chain()
        self.rows.sync(state.rows)
        counts = mx.array(accepted.counts, dtype=mx.int32)
        k1 = state.fwd_tokens.shape[1]
        rel = mx.arange(k1, dtype=mx.int32)[None]
        ahead = mx.concatenate([state.fwd_tokens[:, 1:], state.last_tokens[:, None]], axis=1)
        tokens = mx.where(rel == counts[:, None], state.last_tokens[:, None], ahead)
        pos = state.fwd_positions
        positions = mx.where(pos >= 0, pos + 1, -1)
        out = self._context(self.cache, tokens, self._taps(state), positions)
        self.rows.extras["last_out"] = mx.take_along_axis(out, counts[:, None, None], axis=1)[:, 0]
        rows = [r.position for r in state.rows]
        session.target.compact(self.rows.caches, n_valid_max=max(rows), min_positions=rows)
        mx.async_eval(self.cache.keys, self.cache.values, self.last_out)

    def propose(self, session, state, shared, n_draft: int) -> DraftBlock:
        B = state.size
        if n_draft <= 0:
            return DraftBlock(tokens=mx.zeros((B, 0), mx.int32), n_draft=0)
        self._drop_chain()
        self.rows.sync(state.rows)
        m, layer = self.model, self.model.layer
        logits, h = m.head(self.last_out)
        tok = m.to_target(mx.argmax(logits, axis=-1))
        out = [tok]
        anchor = state.positions[:, None]  # the bonus token's position: step 0 of this block
        for j in range(1, n_draft):
            pos = anchor + j
            q, k, v, res = layer.project(self.embed(tok)[:, None], h[:, None], pos)
            keys, values = self._append(self.cache, k, v, pos)
            mask = self._mask(self.cache.positions[:, : self.cache.idx], pos, anchor)
            o = layer.finish(q, keys, values, mask, res)[:, 0]
            logits, h = m.head(o)
            tok = m.to_target(mx.argmax(logits, axis=-1))
            out.append(tok)
        self.chain = n_draft - 1
        return DraftBlock(tokens=mx.stack(out, axis=1), n_draft=n_draft)

    def propose_tree(self, session, state, shared, shape) -> DraftBlock:
        """A tree of candidates (:class:`~mtpflow.state.TreeShape`), as
        EAGLE-2 grows one: the first depth from the last context output, then
        one drafting step per depth over the whole frontier, each node fed
        its token's embedding with its parent's state at its depth's
        position.  Its K/V go to the drafter's cache; a node attends to the
        context and to its own ancestors' slots only, so every node's
        distribution is the one a chain through its path would give."""
        B = state.size
        self._drop_chain()
        self.rows.sync(state.rows)
        m, layer, cache = self.model, self.model.layer, self.cache
        grow = TreeBuilder(shape, B)
        logits, h = m.head(self.last_out)
        lg = logits[:, None]  # [B, 1, Vd]: the root's children
        h = h[:, None]
        anchor = state.positions[:, None]
        context = cache.idx
        anc = None  # ancestor-or-self rows of the frontier over the tree slots appended
        for d in range(shape.levels):
            choice, parent = grow.expand(d, lg)
            tok = m.to_target(choice)
            grow.add(d, tok, parent)
            if d == shape.levels - 1:
                break
            F = tok.shape[1]
            pos = mx.broadcast_to(anchor + d + 1, (B, F))
            q, k, v, res = layer.project(self.embed(tok), mx.take_along_axis(h, parent[:, :, None], axis=1), pos)
            keys, values = self._append(cache, k, v, pos)
            anc = tree_visibility_step(anc, parent)
            seen = self._mask(cache.positions[:, :context], pos, mx.broadcast_to(anchor, (B, F)))
            o = layer.finish(q, keys, values, mx.concatenate([seen, anc[:, None]], axis=-1), res)
            lg, h = m.head(o)
        self.chain = cache.idx - context
        return grow.finish()
