"""The built-in round stages (see :func:`mtpflow.hookspecs.mtpflow_round_protocol`).

A plugin replaces a stage by implementing the same hook with ``tryfirst=True``
and returning a result; these implementations then do not run.
"""

from __future__ import annotations

import time

import attrs
import mlx.core as mx

from mtpflow import hookimpl
from mtpflow.api import (
    BudgetDrafter, LookaheadSafe, PeekingBlockPolicy, PrefillingDrafter, TreeDrafter, has,
)
from mtpflow.backend.shapes import bucketed_forward, bucketed_tree_forward
from mtpflow.logs import debug_enabled
from mtpflow.state import (
    AcceptResult,
    BatchState,
    DraftBlock,
    Lookahead,
    RoundRecord,
    RowState,
    SharedKV,
    TreeShape,
    VerifyResult,
)

PAD_ID = 0


def _finish(row: RowState, new: list[int]) -> list[int]:
    """Append ``new`` to the row, cut at a stop id (not emitted) or ``max_tokens``."""
    out = []
    req = row.request
    for tok in new:
        if tok in req.stop_ids:
            row.finished, row.finish_reason = True, "stop"
            break
        out.append(tok)
        if len(row.generated) + len(out) >= req.max_tokens:
            row.finished, row.finish_reason = True, "length"
            break
    row.generated.extend(out)
    return out


@hookimpl
def mtpflow_prefill(session, requests):
    pc = session.prefix_cache
    usable = not session.tap_layers and not has(session.drafter, PrefillingDrafter)
    if pc is not None and usable and all(r.media is None for r in requests):
        hits = {}
        for i, r in enumerate(requests):
            found = pc.lookup(r.prompt)
            if found is not None:
                hits[i] = found
        if hits:
            return _prefill_with_prefixes(session, requests, hits)
    return _prefill(session, requests)


def _prefill_with_prefixes(session, requests, hits: dict):
    """Rows with a cached prefix prefill only their suffix (one row each, on a
    copy of the cached K/V); the others prefill together; the parts merge."""
    from mtpflow.targets.cache import merge_caches

    target = session.target
    misses = [r for i, r in enumerate(requests) if i not in hits]
    caches, hidden, rows_req = [], [], []
    if misses:
        part = _prefill(session, misses, sample=False)
        caches.append(part.cache)
        hidden.append(part.hidden)
        rows_req += misses
    for i, (n, cache) in hits.items():
        r = requests[i]
        h = target.extend(cache, r.prompt[n:], n, step=session.config.batch.prefill_step_size)
        caches.append(cache)
        hidden.append(h)
        rows_req.append(r)
    cache = merge_caches(caches) if len(caches) > 1 else caches[0]
    return _first_tokens(session, rows_req, cache, mx.concatenate(hidden, axis=0))


def _prefill(session, requests, sample: bool = True):
    target = session.target
    # identical prompts (n samples of one prompt) are prefilled once
    unique: dict[tuple, int] = {}
    index = [unique.setdefault((tuple(r.prompt), id(r.media) if r.media is not None else None), len(unique)) for r in requests]
    prompts = [list(p) for p, _ in unique]
    media = None
    if any(r.media is not None for r in requests):  # a multimodal prompt: the adapter builds its embeddings
        first = {}
        for r, i in zip(requests, index):
            first.setdefault(i, r.media)
        media = [first[i] for i in range(len(prompts))]
    layers = session.tap_layers
    kw = {"media": media} if media is not None else {}
    out = target.prefill(
        prompts, extra=session.max_block_size + 8, step=session.config.batch.prefill_step_size, pad_id=PAD_ID,
        taps=layers, **kw,
    )
    cache, last_hidden = out[0], out[1]
    taps = out[2] if layers else {}
    if layers:
        L = max(len(p) for p in prompts)
        fwd_tokens = mx.array([[PAD_ID] * (L - len(p)) + p for p in prompts], dtype=mx.int32)
        fwd_positions = mx.array([[-1] * (L - len(p)) + list(range(len(p))) for p in prompts], dtype=mx.int32)
    if len(prompts) != len(requests):
        sel = mx.array(index, dtype=mx.int32)
        for c in cache:
            c.select(sel)
        last_hidden = last_hidden[sel]
        if layers:
            fwd_tokens, fwd_positions = fwd_tokens[sel], fwd_positions[sel]
            taps = {k: v[sel] for k, v in taps.items()}
    if not sample:  # the caller samples the first tokens of a merged batch
        return BatchState(rows=[], cache=cache, last_tokens=None, hidden=last_hidden, positions=None)
    state = _first_tokens(session, requests, cache, last_hidden)
    if layers:
        state.fwd_tokens, state.fwd_positions, state.taps = fwd_tokens, fwd_positions, taps
    if has(session.drafter, PrefillingDrafter):
        session.drafter.prefilled(session, state)  # a drafter with its own cache takes in the new rows' prompts
    return state


def _first_tokens(session, requests, cache, last_hidden) -> BatchState:
    """The first sampled token of every new row (one host sync), and its state."""
    target = session.target
    rows = [RowState(request=r, position=len(r.prompt)) for r in requests]
    session.sampler.prepare(rows, target.vocab_size)
    first = session.sampler.first(target.logits(last_hidden), None)
    mx.eval(first, last_hidden)
    for row, tok in zip(rows, first.tolist()):
        _finish(row, [tok])
    return BatchState(
        rows=rows,
        cache=cache,
        last_tokens=first,
        hidden=last_hidden,
        positions=mx.array([r.position for r in rows], dtype=mx.int32),
    )


@hookimpl
def mtpflow_bind_shared_kv(session, state):
    # only what the drafter declared it needs
    needs = session.drafter.needs if session.drafter is not None else frozenset()
    return SharedKV(
        kv=session.target.shared_kv(state.cache) if "shared_kv" in needs else {},
        bonus_position=state.positions,
        hidden=state.hidden,
        last_tokens=state.last_tokens,
    )


@hookimpl
def mtpflow_draft_block(session, state, shared, block_size, tree):
    if tree is not None and has(session.drafter, TreeDrafter):
        block = session.drafter.propose_tree(session, state, shared, tree)
    else:
        block = session.drafter.propose(session, state, shared, block_size - 1)
    if all(r.request.speculative for r in state.rows):
        return block
    # rows of requests with speculative=False accept nothing
    return attrs.evolve(block, active=mx.array([r.request.speculative for r in state.rows]))


def tree_inputs(state, draft):
    """``(parents, depth, visible)`` of a tree draft's verified inputs (root first)."""
    from mtpflow.sampling import tree_visibility

    B = state.size
    parents = mx.concatenate([mx.full((B, 1), -1, mx.int32), draft.parents.astype(mx.int32)], axis=1)
    depth = mx.concatenate([mx.zeros((B, 1), mx.int32), draft.depth.astype(mx.int32)], axis=1)
    return parents, depth, tree_visibility(parents, draft.max_depth)


@hookimpl
def mtpflow_verify(session, state, draft):
    target = session.target
    if draft.n_draft == 0 and not draft.is_tree:  # a null round verifies the last token alone
        inputs = state.last_tokens[:, None]
    else:
        inputs = mx.concatenate([state.last_tokens[:, None], draft.tokens.astype(mx.int32)], axis=1)
    target.set_offsets(state.cache, state.positions)
    if draft.is_tree:
        # one forward over every node: each at root + depth, seeing its ancestors only
        _, depth, visible = tree_inputs(state, draft)
        hidden, taps = bucketed_tree_forward(target, inputs, state.cache, state.positions[:, None] + depth, visible,
                                             session.tap_layers, session.submit_layers, session.config.generation.bucket_shapes)
    else:
        hidden, taps = bucketed_forward(target, inputs, state.cache, session.tap_layers, session.submit_layers,
                                        session.config.generation.bucket_shapes)
    return VerifyResult(logits=target.logits(hidden), hidden=hidden, inputs=inputs, taps=taps)


@hookimpl
def mtpflow_accept(session, state, draft, verify):
    return session.sampler.accept(verify.logits, draft, state)


@hookimpl
def mtpflow_advance(session, state, draft, verify, accepted):
    counts, toks = accepted.counts, accepted.tokens
    k = draft.n_draft
    null = k == 0 and not verify.taps  # nothing drafted: every row keeps its one verified slot
    ahead = state.lookahead if null else None  # the next round's inputs are this round's outcome
    keep = None if null else mx.array([n + 1 for n in counts], dtype=mx.int32)
    next_pos = (state.positions + 1 if ahead is None else ahead.positions) if null else state.positions + keep
    if accepted.path is not None:
        # a tree: keep the root and the accepted path, drop every other branch
        path = [[0] + p[:n] for p, n in zip(accepted.path, counts)]  # verified-input indices, in depth order
        kept = [[False] * (k + 1) for _ in counts]
        for row, idx in zip(kept, path):
            for i in idx:
                row[i] = True
        trim = k - max(max(i) for i in path)
        keep_mask = mx.array(kept)
        for c in state.cache:
            c.keep(k + 1, keep_mask, next_pos, trim)
        D = max(len(p) for p in path)
        order = mx.array([p + [p[-1]] * (D - len(p)) for p in path], dtype=mx.int32)  # [B, D]
        last_idx = mx.take_along_axis(order, (keep - 1)[:, None], axis=1)[:, 0]
        state.hidden = mx.take_along_axis(verify.hidden, last_idx[:, None, None], axis=1)[:, 0]
        if verify.taps:  # the accepted path as a chain, for a drafter that reads target layers
            state.fwd_tokens = mx.take_along_axis(verify.inputs, order, axis=1)
            state.taps = {t: mx.take_along_axis(v, order[:, :, None], axis=1) for t, v in verify.taps.items()}
            rel = mx.arange(D, dtype=mx.int32)[None]
            state.fwd_positions = mx.where(rel < keep[:, None], state.positions[:, None] + rel, -1)
    elif null:
        if ahead is None:  # else: its successor already holds the next slot
            for c in state.cache:
                c.rollback(1, keep, next_pos, 0, False)
        state.hidden = verify.hidden[:, 0]
    else:
        trim = k - max(counts)
        ragged = min(counts) != max(counts)
        if state.lookahead is None:  # else: a null round whose successor already holds the next slot
            for c in state.cache:
                c.rollback(k + 1, keep, next_pos, trim, ragged, kept=[n + 1 for n in counts])
        state.hidden = mx.take_along_axis(verify.hidden, (keep - 1)[:, None, None], axis=1)[:, 0]
        if verify.taps:  # the verified block, for a drafter that reads target layers
            rel = mx.arange(k + 1, dtype=mx.int32)[None]
            state.fwd_tokens, state.taps = verify.inputs, verify.taps
            state.fwd_positions = mx.where(rel < keep[:, None], state.positions[:, None] + rel, -1)
    if ahead is None:
        state.last_tokens = mx.array([t[n] for t, n in zip(toks, counts)], dtype=mx.int32)
    else:
        state.last_tokens = ahead.last_tokens  # the same tokens, already on the device
    state.positions = next_pos
    emitted = []
    for row, t, n in zip(state.rows, toks, counts):
        row.position += n + 1
        emitted.append(_finish(row, t[: n + 1]))
    if session.drafter_commit is not None:
        session.drafter_commit(session, state, accepted)  # the drafter's own state follows acceptance
    if state.lookahead is None:
        session.target.compact(
            state.cache, n_valid_max=max(r.position for r in state.rows), min_positions=[r.position for r in state.rows]
        )
    state.round += 1
    return emitted


def _next_round_null(session, state, remaining: int) -> bool:
    """Whether this null round may build the next one before its sync: the
    next round will (most likely) draft nothing, every row goes on after this
    round, and the sampler reads nothing the host learns only at the sync
    (mlx-lm processors, repetition penalties and grammars read the tokens)."""
    if remaining < 2 or any(r.finished or r.request.max_tokens - len(r.generated) < 2 for r in state.rows):
        return False
    if not _lookahead_allowed(session, state):
        return False
    if session.drafter is None or not any(r.request.speculative for r in state.rows):
        return True
    budget = remaining - 1 if _drafts_to_budget(session.drafter) else remaining - 2
    if budget <= 0:
        return True
    return has(session.block_policy, PeekingBlockPolicy) and session.block_policy.peek(session.stats) == 1


def _next_round_same_chain(session, state, n_draft: int) -> bool:
    """Whether this drafting round may build the next one, a chain of as many
    drafts, before its sync: whatever this round accepts, every row goes on
    and the next block fits its budget; the block policy expects the same
    block; the drafter, the sampler and the stage plugins read nothing the
    host learns only at the sync; and every cache rolls back lazily."""
    if n_draft == 0 or session.tap_layers or session.drafter_commit is not None:
        return False
    if not _copes(session.drafter, state):
        return False
    if not has(session.block_policy, PeekingBlockPolicy) or session.block_policy.peek(session.stats) != n_draft + 1:
        return False
    if any(r.finished or not r.request.speculative or r.request.max_tokens - len(r.generated) < 2 * n_draft + 2
           for r in state.rows):
        return False
    if not all(getattr(c, "lazy_rollback", False) for c in state.cache):
        return False
    due = getattr(session.target, "compact_due", None)
    if due is None or due(state.cache, max(r.position for r in state.rows)):
        return False  # the next advance compacts the cache (this round's leaves it alone)
    return _lookahead_allowed(session, state)


def _copes(obj, state) -> bool:
    """Whether ``obj`` says it copes with the lookahead (:class:`~mtpflow.api.LookaheadSafe`)."""
    return has(obj, LookaheadSafe) and bool(obj.lookahead_safe(state))


def _lookahead_allowed(session, state) -> bool:
    """What every lookahead needs: no per-stage timing, and a sampler and stage
    plugins that read nothing the host learns only at the sync."""
    return not session.config.trace.sync_timing and _copes(session.sampler, state) and _hooks_allow_lookahead(session, state)


def _drafts_to_budget(drafter) -> bool:
    return has(drafter, BudgetDrafter) and bool(drafter.drafts_to_budget)


#: the stages a lookahead calls early (verify, accept) or changes (advance)
_LOOKAHEAD_HOOKS = ("mtpflow_verify", "mtpflow_accept", "mtpflow_advance")


def _hooks_allow_lookahead(session, state) -> bool:
    """A plugin implementing (or wrapping) one of those stages sees them in
    round order unless it says, through ``lookahead_safe(state)``, that it
    copes with the next round's verify and accept arriving before this
    round's advance and emit."""
    return all(_copes(plugin, state) for plugin in _stage_plugins(session.hook))


_stage_memo: tuple = (None, ())


def _stage_plugins(hook) -> tuple:
    """The plugins other than this module implementing a lookahead stage (the
    hook lists are read every round: remembered until one of them changes)."""
    import sys

    global _stage_memo
    impls = [impl for name in _LOOKAHEAD_HOOKS for impl in getattr(hook, name).get_hookimpls()]
    key = tuple(impls)  # held, so compared by identity safely (HookImpl has no __eq__)
    if _stage_memo[0] != key:
        here = sys.modules[__name__]
        _stage_memo = (key, tuple(impl.plugin for impl in impls if impl.plugin is not here))
    return _stage_memo[1]


def _lookahead(session, state, draft, acc) -> None:
    """Build the next null round's verify on this round's lazy tokens and start
    it: its graph building overlaps this round's compute.  The cache is first
    compacted as this round's advance would (every row moves one position),
    then the next forward's K/V take the slot after it."""
    nxt = [r.position + 1 for r in state.rows]
    session.target.compact(state.cache, n_valid_max=max(nxt), min_positions=nxt)
    hook = session.hook
    # the next round's inputs, for its verify and accept only (cheaper than a copy of the state);
    # this round's advance adopts them as the batch's next state
    last, positions = state.last_tokens, state.positions
    nxt_last, nxt_pos = acc.tokens[:, 0], positions + 1
    state.last_tokens, state.positions = nxt_last, nxt_pos
    try:
        verify = hook.mtpflow_verify(session=session, state=state, draft=draft)
        accepted = hook.mtpflow_accept(session=session, state=state, draft=draft, verify=verify)
    finally:
        state.last_tokens, state.positions = last, positions
    state.lookahead = Lookahead(rows=tuple(state.rows), verify=verify, accepted=accepted,
                                last_tokens=nxt_last, positions=nxt_pos)
    mx.async_eval(accepted.counts, accepted.tokens, verify.hidden)


def _lookahead_chain(session, state, draft, verify, acc) -> None:
    """Build the next drafting round (as many drafts as this one) on this
    round's lazy outcome and start it: its draft and verify graphs are built
    while this round computes.  The cache is rolled back lazily (the rejected
    slots become holes, every row's offset the lazy next position), then the
    next round's draft reads the accepted context and its verify appends its
    slots after this round's."""
    hook = session.hook
    k = draft.n_draft
    counts = acc.counts
    keep = counts + 1
    nxt_pos = state.positions + keep
    for c in state.cache:
        c.rollback(k + 1, keep, nxt_pos, 0, True)
    nxt_last = mx.take_along_axis(acc.tokens, counts[:, None], axis=1)[:, 0]
    nxt_hidden = mx.take_along_axis(verify.hidden, counts[:, None, None], axis=1)[:, 0]
    saved = state.last_tokens, state.positions, state.hidden
    state.last_tokens, state.positions, state.hidden = nxt_last, nxt_pos, nxt_hidden
    try:
        shared = hook.mtpflow_bind_shared_kv(session=session, state=state)
        nxt = hook.mtpflow_draft_block(session=session, state=state, shared=shared, block_size=k + 1, tree=None)
        nverify = hook.mtpflow_verify(session=session, state=state, draft=nxt)
        accepted = hook.mtpflow_accept(session=session, state=state, draft=nxt, verify=nverify)
    finally:
        state.last_tokens, state.positions, state.hidden = saved
    state.lookahead = Lookahead(rows=tuple(state.rows), verify=nverify, accepted=accepted, last_tokens=nxt_last,
                                positions=nxt_pos, draft=nxt)
    mx.async_eval(accepted.counts, accepted.tokens, nverify.hidden)


_null_drafts: dict = {}


def _null_draft(B: int) -> DraftBlock:
    """The (immutable) empty draft of a round that drafts nothing, one per batch size."""
    d = _null_drafts.get(B)
    if d is None:
        d = _null_drafts[B] = DraftBlock(tokens=mx.zeros((B, 0), dtype=mx.int32), n_draft=0)
    return d


@hookimpl
def mtpflow_round_protocol(session, state):
    hook = session.hook
    t0 = time.perf_counter()
    index = state.round
    block = session.block_policy.block_size(session.stats)
    tree = block if isinstance(block, TreeShape) else None
    # never draft past the longest remaining budget: drafts + bonus fit it (as
    # transformers); a drafter with `drafts_to_budget` drafts up to the budget
    # itself (as mlx-lm and z-lab's dflash_generate, whose blocks must match)
    remaining = max(r.request.max_tokens - len(r.generated) for r in state.rows)
    drafting = session.drafter is not None and any(r.request.speculative for r in state.rows)
    budget = remaining if _drafts_to_budget(session.drafter) else remaining - 1
    if tree is not None and (tree.levels > budget or not session.trees_supported(state)):
        block, tree = min(tree.levels, max(budget, 0)) + 1, None  # too deep for the budget: a chain
    n_draft = (tree.nodes if tree is not None else max(0, min(block - 1, budget))) if drafting else 0
    B = state.size
    ahead = state.lookahead
    if ahead is not None and (tree is not None or n_draft != ahead.n_draft or len(ahead.rows) != B
                              or any(a is not b for a, b in zip(ahead.rows, state.rows))):
        state.settle()  # the round built ahead is not this one
    if state.lookahead is not None and n_draft > 0:
        draft = state.lookahead.draft  # drafted by the previous round, already computing
    elif n_draft > 0:
        shared = hook.mtpflow_bind_shared_kv(session=session, state=state)
        draft = hook.mtpflow_draft_block(session=session, state=state, shared=shared, block_size=n_draft + 1, tree=tree)
        n_draft = draft.n_draft
        if session.config.trace.sync_timing:
            mx.eval(draft.tokens)
        else:
            mx.async_eval(draft.tokens)
    else:
        draft = _null_draft(B)
    t1 = time.perf_counter()
    ahead, state.lookahead = state.lookahead, None
    if ahead is not None:  # built by the previous round, already computing
        verify, acc = ahead.verify, ahead.accepted
    else:
        verify = hook.mtpflow_verify(session=session, state=state, draft=draft)
        acc = hook.mtpflow_accept(session=session, state=state, draft=draft, verify=verify)
    outputs = (acc.counts, acc.tokens, verify.hidden, *(() if acc.path is None else (acc.path,)))
    built_ahead = n_draft == 0 and _next_round_null(session, state, remaining)
    if built_ahead:
        if ahead is None:  # else: started by the previous round already
            mx.async_eval(*outputs)
        _lookahead(session, state, draft, acc)
    elif tree is None and _next_round_same_chain(session, state, n_draft):
        built_ahead = True
        if ahead is None:
            mx.async_eval(*outputs)
        _lookahead_chain(session, state, draft, verify, acc)
    # the round's single host synchronisation
    mx.eval(*outputs)
    t2 = time.perf_counter()
    host = AcceptResult(counts=[0] * B if n_draft == 0 else acc.counts.tolist(), tokens=acc.tokens.tolist(),
                        path=None if acc.path is None else acc.path.tolist())
    live = [not r.finished for r in state.rows]
    emitted = hook.mtpflow_advance(session=session, state=state, draft=draft, verify=verify, accepted=host)
    if state.lookahead is not None and any(r.finished for r in state.rows):
        state.settle()  # the batch changes: the next round is not the one built
    # tokens each row's target forward produced: the emitted ones, plus the
    # stop token that ended the row (it was produced, just not emitted)
    produced = [len(e) + (was and r.finish_reason == "stop") for e, r, was in zip(emitted, state.rows, live)]
    t3 = time.perf_counter()
    record = RoundRecord(
        round=index,
        batch_size=B,
        block_size=(draft.max_depth if draft.is_tree else n_draft) + 1,
        drafted=draft.max_depth if draft.is_tree else n_draft,
        accepted=list(host.counts),
        emitted=[len(e) for e in emitted],
        produced=produced,
        draft_s=t1 - t0,
        verify_s=t2 - t1,
        host_s=t3 - t2,
        syncs=2 if (n_draft > 0 and session.config.trace.sync_timing) else 1,
        nodes=n_draft,
        tree=tree.describe() if draft.is_tree and tree is not None else None,
        overlapped=ahead is not None,
        built_ahead=built_ahead,
    )
    session.stats.observe(record)
    session.block_policy.observe(record)
    hook.mtpflow_emit(session=session, record=record, emitted={r.request.id: e for r, e in zip(state.rows, emitted)})
    return record


@hookimpl
def mtpflow_emit(session, record, emitted):
    if debug_enabled(session.log):
        session.log.debug("round", **record.as_event())
