"""A small set of verify shapes, so a GPU compiles kernels for a handful of them.

MLX's GPU backends compile kernels (and plan matmuls) per input shape; a run
whose verifies take every length from 2 to 17 pays a compile for each.  With
``[generation] bucket_shapes`` on, a chain verify of ``L`` tokens runs as
``bucket(L)`` tokens: the real ones, then padding.  That is exact:

* every padding token comes after every real token, and a real token's
  attention sees only positions up to its own (the cache's causal and
  sliding-window masks), so no real token's output depends on the padding;
* the padding's cache slots are the last ones, and are trimmed right after the
  forward (:meth:`~mtpflow.targets.cache.SlotKVCache.trim`), before anything
  reads the cache;
* the hidden states, taps and logits are cut back to the ``L`` real tokens.

A tree verify of ``N`` nodes runs as ``bucket(N)`` nodes the same way: the
padding nodes come after the real ones, sit at the root's position and see
the cache and themselves only; no real node sees them (``visible`` is
``False`` in their columns), so the real nodes' outputs are the unpadded
ones, and their slots are trimmed before acceptance reads the cache.

A verify over ``B`` live rows runs as ``bucket(B)`` rows: the dummy rows get
padding tokens, offset 0 and empty cache slots (position -1), so each sees
only its own new slots; attention never mixes rows, and the dummy rows are
cut from the outputs and the cache after the forward.  Padding the cache rows
copies each layer's K/V once per such verify (see :func:`_pad_rows`).

``tests/test_shapes.py`` checks the real tokens' logits against an unpadded
verify and counts the distinct verify shapes of a run.
"""

from __future__ import annotations

#: the verify lengths a bucketed run uses (longer ones run unpadded)
BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def bucket(n: int) -> int:
    """The smallest bucket ``>= n`` (``n`` itself above the largest)."""
    for b in BUCKETS:
        if b >= n:
            return b
    return n


def verify_length(mode: str, n: int, cache) -> int:
    """The length a chain (or tree) verify of ``n`` tokens runs at: ``bucket(n)`` when
    ``mode`` (``[generation] bucket_shapes``) is on for this device and every
    cache layer can drop the padding again (position-tracked KV slots; a
    recurrent state would have absorbed it), else ``n``."""
    if n <= 1:
        return n
    from .profiles import tuning_on

    if not tuning_on("bucket_shapes", mode):
        return n
    from ..targets.cache import SlotKVCache

    if not all(type(c) is SlotKVCache for c in cache):
        return n
    return bucket(n)


def bucketed_forward(target, tokens, cache, layers=(), submit: bool = False, mode: str = "auto", pad_id: int = 0):
    """``target.forward_with_taps(tokens, cache, layers)`` over ``tokens [B, n]``
    padded to :func:`verify_length`; the padding's cache slots are trimmed and
    its outputs cut off, so the caller sees an ``n``-token forward."""
    import mlx.core as mx

    B, n = tokens.shape
    padded, rows = verify_length(mode, n, cache), verify_length(mode, B, cache)
    if padded != n or rows != B:
        tokens = mx.pad(tokens, ((0, rows - B), (0, padded - n)), constant_values=pad_id)
    _pad_rows(cache, rows)
    hidden, taps = target.forward_with_taps(tokens, cache, layers, submit=submit)
    if padded == n and rows == B:
        return hidden, taps
    for c in cache:  # the padding's slots are the last ones
        c.trim(padded - n)
    _cut_rows(cache, B)
    return hidden[:B, :n], {t: v[:B, :n] for t, v in taps.items()}


def bucketed_tree_forward(target, tokens, cache, positions, visible, layers=(), submit: bool = False,
                          mode: str = "auto", pad_id: int = 0):
    """``target.forward_tree(tokens, cache, positions, visible, layers)`` over
    ``tokens [B, N]`` padded to :func:`verify_length` nodes: each padding node
    sits at the root's position and sees the cache and itself only, no real
    node sees it, its slot is trimmed and its outputs cut off."""
    import mlx.core as mx

    B, n = tokens.shape
    padded, rows = verify_length(mode, n, cache), verify_length(mode, B, cache)
    if (padded == n and rows == B) or visible.shape[-1] != n:  # a tree grown over earlier slots runs as it is
        return target.forward_tree(tokens, cache, positions, visible, layers, submit=submit)
    extra = padded - n
    tokens = mx.pad(tokens, ((0, rows - B), (0, extra)), constant_values=pad_id)
    positions = mx.concatenate([positions, mx.repeat(positions[:, :1], extra, axis=1)], axis=1)
    positions = mx.pad(positions, ((0, rows - B), (0, 0)))
    own = mx.arange(padded)[:, None] == mx.arange(padded)[None, :]  # [P, P]
    node = own & (mx.arange(padded) >= n)[:, None]  # a padding node sees itself
    visible = mx.pad(visible, ((0, 0), (0, extra), (0, extra)), constant_values=False) | node[None]
    visible = mx.concatenate([visible, mx.broadcast_to(own[None], (rows - B, padded, padded))], axis=0)  # a dummy row: a chain of selves
    _pad_rows(cache, rows)
    hidden, taps = target.forward_tree(tokens, cache, positions, visible, layers, submit=submit)
    for c in cache:  # the padding's slots are the last ones
        c.trim(extra)
    _cut_rows(cache, B)
    return hidden[:B, :n], {t: v[:B, :n] for t, v in taps.items()}


def _pad_rows(cache, rows: int) -> None:
    """Append dummy batch rows to every cache layer, up to ``rows``: empty
    slots (position -1) and offset 0, so a dummy row sees nothing but its own
    new slots and no real row sees it (attention is per row).  This copies
    each layer's K/V once; :func:`_cut_rows` drops the rows again."""
    import mlx.core as mx

    B = cache[0].offset.shape[0] if cache else rows
    if rows == B:
        return
    offset = mx.pad(cache[0].offset, (0, rows - B))  # one array shared by every layer, as set_offsets leaves it
    for c in cache:
        if c.offset is offset or c.keys is None:  # a layer listed twice, or one that holds nothing
            c.offset = offset
            continue
        c.keys, c.values = (mx.pad(a, ((0, rows - B),) + ((0, 0),) * (a.ndim - 1)) for a in (c.keys, c.values))
        c.positions = mx.pad(c.positions, ((0, rows - B), (0, 0)), constant_values=-1)
        c.offset = offset


def _cut_rows(cache, B: int) -> None:
    """Drop the dummy rows :func:`_pad_rows` appended (every row past ``B``)."""
    for c in cache:
        if c.keys is not None and c.keys.shape[0] != B:
            c.keys, c.values, c.positions = c.keys[:B], c.values[:B], c.positions[:B]
        if c.offset.shape[0] != B:
            c.offset = c.offset[:B]


def reachable_shapes(session, max_rows: int | None = None) -> list[tuple[int, int, bool]]:
    """The bucketed verify shapes ``(rows, tokens, tree)`` a run of ``session``
    can reach: chains up to the block size (the fixed policy's) or the
    configured maximum (any other policy's), each configured
    tree's node count (root included), rows up to the batch policy's maximum
    (``max_rows`` overrides it)."""
    from ..builtins.policies import configured_trees

    cfg = session.config
    d = cfg.draft
    max_block = d.block_size if d.policy == "fixed" and d.block_size else max(k for k in (d.block_size, d.max_block_size, 1) if k)
    rows = sorted({bucket(b) for b in range(1, (max_rows or cfg.batch.max_batch_size) + 1)})
    chains = sorted({bucket(k) for k in range(1, max_block + 1)})
    trees = sorted({bucket(t.nodes + 1) for t in configured_trees(cfg)})
    return [(r, n, False) for r in rows for n in chains] + [(r, n, True) for r in rows for n in trees]


def warm_up(session, max_rows: int | None = None, skip: set | None = None) -> set:
    """Run one verify forward of every shape :func:`reachable_shapes` lists (on
    a throw-away cache), so a GPU compiles its kernels before the first timed
    decode.  Does nothing unless ``[generation] bucket_shapes`` is on for this
    device.  ``skip``: shapes already warmed (another session on the same
    target); returns the shapes warmed, ``skip`` included."""
    import mlx.core as mx

    from .profiles import tuning_on

    done = set(skip or ())
    mode = session.config.generation.bucket_shapes
    if not tuning_on("bucket_shapes", mode):
        return done
    target = session.target
    by_rows: dict[int, list] = {}
    for r, n, tree in reachable_shapes(session, max_rows):
        if (r, n, tree) not in done:
            by_rows.setdefault(r, []).append((n, tree))
    for r, shapes in by_rows.items():
        cache, _ = target.prefill([[0] * 4] * r, extra=max(n for n, _ in shapes))
        if verify_length(mode, 3, cache) == 3:  # bucketing off here: nothing to warm
            return done
        for n, tree in shapes:
            target.set_offsets(cache, mx.full((r,), 4, mx.int32))
            tokens = mx.zeros((r, n), mx.int32)
            if tree:
                chain = mx.broadcast_to(mx.tril(mx.ones((n, n), mx.bool_))[None], (r, n, n))
                pos = mx.full((r, 1), 4, mx.int32) + mx.arange(n, dtype=mx.int32)[None]
                h, taps = target.forward_tree(tokens, cache, pos, chain, session.tap_layers, submit=session.submit_layers)
            else:
                h, taps = target.forward_with_taps(tokens, cache, session.tap_layers, submit=session.submit_layers)
            mx.eval(target.logits(h), taps)
            for c in cache:
                c.trim(n)
            done.add((r, n, tree))
    return done
