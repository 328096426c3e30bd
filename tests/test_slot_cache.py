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
