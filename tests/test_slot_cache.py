"""The slot cache's dense fast path: a cache with no holes gives a single query
no mask (and a sliding layer only its last ``window`` slots), as mlx-lm's own
caches do.  It must compute exactly what the general, position-masked path
computes, and anything that may leave a hole must leave the fast path."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_session, reference

from mtpflow.engine import generate_stream, make_request
from mtpflow.targets.base import TargetAdapter


@pytest.fixture(scope="module")
def target():
    return make_session("e", block_size=1, with_drafter=False).target


def decode(target, prompts, n, dense):
    """Greedy decode ``n`` steps of equal-length ``prompts`` one query at a time,
    compacting as the engine does; the hidden state of every step."""
    cache, h = target.prefill(prompts)
    for c in cache:
        assert c.dense
        c.dense = dense
    L = len(prompts[0])
    pos = mx.array([L] * len(prompts), dtype=mx.int32)
    tok = mx.argmax(target.logits(h), axis=-1).astype(mx.int32)
    out = []
    for i in range(n):
        target.set_offsets(cache, pos)
        h = target.forward(tok[:, None], cache)[:, -1]
        out.append(np.array(h))
        tok = mx.argmax(target.logits(h), axis=-1).astype(mx.int32)
        pos = pos + 1
        target.compact(cache, n_valid_max=L + i + 1, min_positions=[L + i + 1] * len(prompts))
        mx.eval(tok, *[c.keys for c in cache], *[c.positions for c in cache])
        assert all(c.dense == dense for c in cache)
    return out, cache


@pytest.mark.parametrize("rows", [1, 3])
def test_dense_path_equals_the_masked_path_past_the_window_and_compactions(target, rows):
    base = list(range(7, 27))
    prompts = [[(t + 31 * r) % 2000 + 3 for t in base] for r in range(rows)]
    fast, cache = decode(target, prompts, 140, True)
    slow, _ = decode(target, prompts, 140, False)
    sliding = [c for c in cache if c.window is not None]
    assert sliding and any(c.idx > c.window for c in sliding)  # the window sliced, compactions ran
    for i, (a, b) in enumerate(zip(fast, slow)):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-5, err_msg=f"step {i}")


def test_ragged_rows_and_trees_leave_the_fast_path(target):
    cache, _ = target.prefill([[5, 6, 7], [8, 9, 10]])
    assert all(c.dense for c in cache)
    c = cache[0]
    target.set_offsets(cache, mx.array([3, 3], dtype=mx.int32))
    target.forward(mx.array([[1, 2, 3], [4, 5, 6]], dtype=mx.int32), cache)
    c.rollback(3, mx.array([1, 3]), mx.array([4, 6]), 0, ragged=True)  # rows keep different counts
    assert not c.dense and all(x.dense for x in cache[1:])
    assert not any(x.dense for x in target.prefill([[5, 6, 7], [8, 9]])[0])  # left padding
    assert not any(x.dense for x in target.make_cache())  # only a prefill vouches for it


def test_generation_on_dense_and_padded_batches_matches_target_only():
    s = make_session("e", block_size=3)
    same = [list(range(9, 30)), list(range(40, 61))]  # equal lengths: dense until a ragged acceptance
    reqs = [make_request(s, p, max_tokens=48) for p in same]
    out = {r.id: [] for r in reqs}
    for ev in generate_stream(s, reqs):
        out[ev.request_id].extend(ev.tokens)
    for r, p in zip(reqs, same):
        assert out[r.id] == reference(s, p, 48)


def test_softcap_is_the_plain_formula(target):
    x = mx.random.normal((2, 5, 17)) * 40
    cap = target.softcap or 30.0
    t = TargetAdapter.__new__(TargetAdapter)
    t.softcap = cap
    np.testing.assert_allclose(np.array(t.softcapped(x)), np.array(mx.tanh(x / cap) * cap), atol=1e-5)


@pytest.mark.parametrize("window", [None, 4])
def test_a_tree_mask_over_earlier_tree_slots(window):
    """``visible [B, N, T + N]``: the cache's last ``T`` slots are tree nodes an
    earlier forward appended, seen only where ``visible`` says (and inside the
    window by position); the slots before them are context, seen by position
    (empty ones never)."""
    from mtpflow.targets.cache import SlotKVCache

    rng = np.random.default_rng(0)
    B, N, T, ctx = 2, 3, 4, 9
    c = SlotKVCache(window=window)
    c.offset = mx.zeros((B,), dtype=mx.int32)
    # context positions 0..8 with holes (-1), then T tree slots at depths 1, 1, 2, 2 past position 8
    pos = np.tile(np.arange(ctx), (B, 1))
    pos[0, 3] = pos[1, [0, 5]] = -1
    tree_pos = np.array([9, 9, 10, 10])
    c.update_and_fetch(mx.zeros((B, 1, ctx + T, 2)), mx.zeros((B, 1, ctx + T, 2)))
    c.positions[:, : ctx + T] = mx.array(np.concatenate([pos, np.tile(tree_pos, (B, 1))], axis=1), dtype=mx.int32)
    q = np.array([[11, 11, 12], [11, 11, 11]])
    visible = rng.random((B, N, T + N)) < 0.5
    c._tree = (mx.array(q, dtype=mx.int32), mx.array(visible))
    got = np.array(c.make_mask(N))[:, 0]
    assert got.shape == (B, N, ctx + T + N)
    keys = np.concatenate([pos, np.tile(tree_pos, (B, 1)), q], axis=1)
    for b in range(B):
        for i in range(N):
            for j in range(ctx + T + N):
                k = keys[b, j]
                want = (k >= 0 and k <= q[b, i]) if j < ctx else bool(visible[b, i, j - ctx])
                if window is not None:
                    want = want and k > q[b, i] - window
                assert got[b, i, j] == want, (b, i, j)
