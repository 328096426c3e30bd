"""Bucketed verify shapes (mtpflow.backend.shapes): padding a chain verify is
exact, and a run compiles a handful of verify shapes instead of one per
block size."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_session, prompt, reference
from conftest import run_requests as run

from mtpflow.backend.shapes import BUCKETS, bucket, bucketed_forward, verify_length, warm_up

PROMPTS = [prompt("e", "long"), prompt("e", "short"), prompt("e", "edge")]


def test_bucket():
    assert [bucket(n) for n in (1, 2, 3, 5, 8, 9, 33, 64, 65)] == [1, 2, 4, 8, 8, 16, 64, 64, 65]
    assert verify_length("off", 3, []) == 3 and verify_length("on", 3, []) == 4
    assert verify_length("auto", 3, []) == 3  # a CPU device: no padding (its verify cost grows with the tokens)


def test_a_padded_verify_equals_the_unpadded_one():
    """The real tokens' logits and taps are the unpadded forward's (to float32
    rounding: a product of other shapes rounds differently, as a k-token
    verify does against k one-token steps) with the same argmax, and the cache
    after it holds the same slots, positions and offsets."""
    s = make_session("e", block_size=4)
    t = s.target
    tokens = mx.array([PROMPTS[0][-3:]], dtype=mx.int32)
    out = []
    for mode, n in (("off", 3), ("on", 3), ("on", 2)):
        cache, _ = t.prefill([PROMPTS[0][:-3]], extra=16)
        t.set_offsets(cache, mx.array([len(PROMPTS[0]) - 3], dtype=mx.int32))
        seen = []
        fwd = t.forward_with_taps
        t.forward_with_taps = lambda x, *a, **kw: (seen.append(x.shape[1]), fwd(x, *a, **kw))[1]
        try:
            h, taps = bucketed_forward(t, tokens[:, :n], cache, (1, 3), s.submit_layers, mode)
        finally:
            del t.forward_with_taps
        assert seen == [n if mode == "off" else bucket(n)] and h.shape[1] == n and taps[3].shape[1] == n
        logits = t.logits(h)
        mx.eval(logits, taps)
        out.append((np.array(logits), np.array(taps[3]),
                     [(c.idx, np.array(c.offset), np.array(c.view()[0]), np.array(c.view()[2])) for c in cache]))
    (l0, t0, c0), (l1, t1, c1), (l2, _, c2) = out
    np.testing.assert_allclose(l1, l0, rtol=0, atol=1e-5)
    np.testing.assert_allclose(t1, t0, rtol=0, atol=1e-5)
    assert np.array_equal(l1.argmax(-1), l0.argmax(-1))
    for (i, o, k, p), (i0, o0, k0, p0) in zip(c1, c0):
        assert i == i0 and np.array_equal(o, o0) and np.array_equal(p, p0)
        np.testing.assert_allclose(k, k0, rtol=0, atol=1e-5)
    assert [c[0] for c in c2] == [i - 1 for i, *_ in c0]  # an unpadded 2-token forward: one slot fewer


def _verify_shapes(s):
    """Record the token shape of every target forward the verify stage runs."""
    seen, prefilling = [], []
    fwd, prefill = s.target.forward_with_taps, s.target.prefill

    def counting(tokens, *a, **kw):
        if not prefilling:
            seen.append(tuple(tokens.shape))
        return fwd(tokens, *a, **kw)

    def prefill_uncounted(*a, **kw):
        prefilling.append(1)
        try:
            return prefill(*a, **kw)
        finally:
            prefilling.pop()

    s.target.forward_with_taps, s.target.prefill = counting, prefill_uncounted
    return seen


@pytest.mark.parametrize("mode", ["on", "off"])
def test_a_bucketed_run_compiles_a_handful_of_verify_shapes(mode):
    """Block sizes 2..7 (verifies of 2..7 tokens), alone and three prompts
    together (rows leave as they finish): bucketed, the verifies take three
    lengths (2, 4, 8); unbucketed, one per block size.  Every run's tokens
    are target-only's."""
    s = make_session("e", block_size=3, generation={"bucket_shapes": mode}, batch={"max_batch_size": 4})
    seen = _verify_shapes(s)
    s.reset_stats()
    for bs in range(2, 8):
        s.block_policy.size = bs
        batch = 3 if bs in (3, 6) else 1
        reqs, out = run(s, PROMPTS[:batch], [24, 16, 16][:batch], ids=[f"{bs}-{i}" for i in range(batch)])
        for r in reqs:
            assert out[r.id] == reference(s, r.prompt, r.max_tokens), (bs, r.id)
    blocks = {int(k) for k in s.stats.as_dict()["block_sizes"]} - {1}
    assert blocks == set(range(2, 8))
    lengths = {L for _, L in seen if L > 1}
    if mode == "on":
        assert lengths == {2, 4, 8}, lengths
        assert 4 in {B for B, _ in seen} <= {1, 2, 4}, sorted(set(seen))  # 3 rows run as 4
        assert len(set(seen)) <= 9, sorted(set(seen))  # (rows) x (lengths): what a GPU compiles for
    else:
        assert lengths == blocks  # one verify shape per block size


def _tree_verify(t, cache, tokens, parents, submit, mode):
    from mtpflow.backend.shapes import bucketed_tree_forward
    from mtpflow.sampling import tree_visibility

    depth = mx.array([[0, 1, 1, 2, 2, 2]], dtype=mx.int32)[:, : tokens.shape[1]]
    visible = tree_visibility(mx.array([parents], dtype=mx.int32), 2)
    return bucketed_tree_forward(t, tokens, cache, cache[0].offset[:, None] + depth, visible, (1, 3), submit, mode)


def test_a_padded_tree_verify_equals_the_unpadded_one():
    """A tree of 6 nodes run as 8 (two padding nodes that see the cache and
    themselves only): the real nodes' logits and taps are the unpadded
    verify's, the cache after it and after accepting a side branch holds the
    same slots, positions and K/V, and the padding's slots are gone."""
    s = make_session("e", block_size=4)
    t = s.target
    tokens = mx.array([PROMPTS[0][-6:]], dtype=mx.int32)
    parents = [-1, 0, 0, 1, 2, 2]
    out = []
    for mode in ("off", "on"):
        cache, _ = t.prefill([PROMPTS[0][:-6]], extra=16)
        t.set_offsets(cache, mx.array([len(PROMPTS[0]) - 6], dtype=mx.int32))
        seen = []
        fwd = t.forward_with_taps
        t.forward_with_taps = lambda x, *a, **kw: (seen.append(x.shape[1]), fwd(x, *a, **kw))[1]
        try:
            h, taps = _tree_verify(t, cache, tokens, parents, s.submit_layers, mode)
        finally:
            del t.forward_with_taps
        assert seen == [6 if mode == "off" else 8] and h.shape[1] == 6 and taps[3].shape[1] == 6
        logits = t.logits(h)
        snap = lambda: [(c.idx, np.array(c.offset), np.array(c.view()[0]), np.array(c.view()[2])) for c in cache]  # noqa: E731
        after_verify = snap()
        base = len(PROMPTS[0]) - 6
        keep = mx.array([[True, False, True, False, False, True]])  # the root, node 2, its child 5
        for c in cache:
            c.keep(6, keep, mx.array([base + 3], dtype=mx.int32), 0)
        mx.eval(logits, taps)
        out.append((np.array(logits), np.array(taps[3]), after_verify, snap()))
    (l0, t0, v0, a0), (l1, t1, v1, a1) = out
    np.testing.assert_allclose(l1, l0, rtol=0, atol=1e-5)
    np.testing.assert_allclose(t1, t0, rtol=0, atol=1e-5)
    assert np.array_equal(l1.argmax(-1), l0.argmax(-1))
    for c0, c1 in ((v0, v1), (a0, a1)):
        for (i, o, k, p), (i0, o0, k0, p0) in zip(c1, c0):
            assert i == i0 and np.array_equal(o, o0) and np.array_equal(p, p0)
            np.testing.assert_allclose(k, k0, rtol=0, atol=1e-5)


@pytest.mark.parametrize("pair", ["e", "d"])
def test_a_bucketed_ragged_continuous_tree_run_stays_in_the_buckets(pair):
    """Trees of 11 nodes (2,2,1 plus the root), rows joining and leaving
    (continuous batching, ragged acceptance), and a batch of chains of 6
    tokens: with bucketing on, every verify runs at bucket rows and a bucket
    length (16, 8; shorter chains where a request's budget cuts the block),
    all of them shapes the warm-up ran first, and the tokens are
    target-only's."""
    from conftest import drive_with_late_joiners

    from mtpflow.engine import make_request

    s = make_session(pair, block_size=4, draft={"tree": "2,2,1"}, generation={"bucket_shapes": "on"},
                     batch={"policy": "continuous", "max_batch_size": 3})
    seen = _verify_shapes(s)
    warmed = warm_up(s)
    assert set(seen) == {(r, n) for r, n, _ in warmed} and len(seen) == len(warmed) == 12  # rows 1,2,4 x (chains 1,2,4; a 16-node tree)
    warmed = set(seen)
    seen.clear()
    first = [make_request(s, PROMPTS[0], max_tokens=18, request_id="a"), make_request(s, PROMPTS[1], max_tokens=7, request_id="b")]
    late = [make_request(s, PROMPTS[2], max_tokens=12, request_id="c"), make_request(s, PROMPTS[1][:5], max_tokens=9, request_id="d")]
    out = drive_with_late_joiners(s, first, late, join_after=2, max_live=3)
    for r in first + late:
        assert out[r.id] == reference(s, r.prompt, r.max_tokens), r.id
    lengths = {L for _, L in seen}
    assert 16 in lengths and lengths <= set(BUCKETS), sorted(set(seen))  # 11-node trees run as 16 (chains near the budget)
    rows = {B for B, _ in seen}
    assert 4 in rows and rows <= set(BUCKETS), sorted(set(seen))  # 3 live rows run as 4
    assert set(seen) <= warmed, sorted(set(seen) - warmed)  # the run compiles nothing the warm-up did not
    s2 = make_session(pair, block_size=6, generation={"bucket_shapes": "on"}, batch={"max_batch_size": 3})
    seen2 = _verify_shapes(s2)
    reqs, out = run(s2, PROMPTS, [14, 9, 11])
    for r in reqs:
        assert out[r.id] == reference(s2, r.prompt, r.max_tokens), r.id
    assert {L for _, L in seen2} <= set(BUCKETS) and 8 in {L for _, L in seen2}, sorted(set(seen2))
    assert {B for B, _ in seen2} <= set(BUCKETS) and 4 in {B for B, _ in seen2}, sorted(set(seen2))


@pytest.mark.parametrize("tree", [False, True])
def test_padded_batch_rows_equal_the_unpadded_verify(tree):
    """Three ragged rows verified as four (a dummy row of empty slots) and a
    3-token chain as 4 / a 6-node tree as 8: every real row's logits and
    cache slots are the unpadded verify's, and the dummy row is gone."""
    s = make_session("e", block_size=4)
    t = s.target
    seqs = [PROMPTS[0][:-3], PROMPTS[1][:-3], PROMPTS[2][:-3]]
    n = 6 if tree else 3
    tokens = mx.array([p[-n:] for p in PROMPTS], dtype=mx.int32)
    out = []
    for mode in ("off", "on"):
        cache, _ = t.prefill(seqs, extra=16)
        t.set_offsets(cache, mx.array([len(p) for p in seqs], dtype=mx.int32))
        seen = []
        fwd = t.forward_with_taps
        t.forward_with_taps = lambda x, *a, **kw: (seen.append(tuple(x.shape)), fwd(x, *a, **kw))[1]
        try:
            if tree:
                from mtpflow.backend.shapes import bucketed_tree_forward
                from mtpflow.sampling import tree_visibility

                depth = mx.array([[0, 1, 1, 2, 2, 2]] * 3, dtype=mx.int32)
                visible = tree_visibility(mx.array([[-1, 0, 0, 1, 2, 2]] * 3, dtype=mx.int32), 2)
                h, _ = bucketed_tree_forward(t, tokens, cache, cache[0].offset[:, None] + depth, visible, (), s.submit_layers, mode)
            else:
                h, _ = bucketed_forward(t, tokens, cache, (), s.submit_layers, mode)
        finally:
            del t.forward_with_taps
        assert seen == [(3, n) if mode == "off" else (4, 8 if tree else 4)] and h.shape[:2] == (3, n)
        logits = t.logits(h)
        mx.eval(logits)
        out.append((np.array(logits), [(c.idx, np.array(c.offset), np.array(c.view()[0]), np.array(c.view()[2])) for c in cache]))
    (l0, c0), (l1, c1) = out
    np.testing.assert_allclose(l1, l0, rtol=0, atol=1e-5)
    assert np.array_equal(l1.argmax(-1), l0.argmax(-1))
    for (i, o, k, p), (i0, o0, k0, p0) in zip(c1, c0):
        assert i == i0 and np.array_equal(o, o0) and np.array_equal(p, p0) and k.shape == k0.shape
        np.testing.assert_allclose(k, k0, rtol=0, atol=1e-5)
