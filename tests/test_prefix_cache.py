"""Prefix caching across requests: a prompt that starts with a finished row's
sequence prefills only its suffix, and the output does not change."""

from __future__ import annotations

import json

from conftest import FIXTURES, make_session

from mtpflow.engine import generate, generate_stream, make_request

PROMPT = json.loads((FIXTURES / "pair_e" / "generate_long.json").read_text())["prompt_ids"]


def _turns(session, n_turns=3):
    """A multi-turn chat: each turn re-sends the history plus a new 'user' message."""
    history, outs = list(PROMPT[:20]), []
    for t in range(n_turns):
        res = generate(session, history, max_tokens=14)
        outs.append(res.tokens)
        history = history + res.tokens + [100 + t, 200 + t, 300 + t]
    return outs


def test_multi_turn_output_is_unchanged_and_the_history_is_reused():
    cached = make_session("e", block_size=4, batch={"prefix_cache_mb": 64})
    plain = make_session("e", block_size=4)
    assert _turns(cached) == _turns(plain)
    pc = cached.prefix_cache
    assert pc.hits == 2 and pc.tokens_reused >= 2 * 33  # turns 2 and 3 reused at least turn 1's 20 + 13 tokens
    assert plain.prefix_cache is None


def test_a_batch_of_hits_and_misses_and_a_long_prefix_past_the_sliding_window():
    s = make_session("e", block_size=5, batch={"prefix_cache_mb": 64})
    plain = make_session("e", block_size=5)
    assert s.target.sliding_window == 16
    first = generate(s, PROMPT, max_tokens=20).tokens  # 40 + 20 tokens: longer than the window
    follow = PROMPT + first + [7, 8, 9]
    other = PROMPT[5:17]
    reqs = [make_request(s, follow, max_tokens=16, request_id="hit"), make_request(s, other, max_tokens=16, request_id="miss")]
    got = {r.id: [] for r in reqs}
    for ev in generate_stream(s, reqs):
        got[ev.request_id].extend(ev.tokens)
    assert got["hit"] == generate(plain, follow, max_tokens=16).tokens
    assert got["miss"] == generate(plain, other, max_tokens=16).tokens
    assert s.prefix_cache.hits >= 1


def test_trees_and_the_null_path_with_a_prefix_cache():
    for kw in ({"draft": {"tree": "3,2"}}, {"with_drafter": False}):
        s = make_session("d", block_size=4, batch={"prefix_cache_mb": 64}, **kw)
        plain = make_session("d", block_size=4, **kw)
        assert _turns(s, 2) == _turns(plain, 2)
        assert s.prefix_cache.hits == 1


def test_the_lru_is_bounded():
    s = make_session("e", block_size=4, batch={"prefix_cache_mb": 1})
    pc = s.prefix_cache
    pc.max_bytes = 200_000  # a couple of rows of this tiny target
    for i in range(6):
        generate(s, [5 + i] + PROMPT[:30], max_tokens=10)
    assert 0 < len(pc.entries) < 6 and pc.bytes <= pc.max_bytes


def test_the_cap_bounds_the_memory_really_held():
    """An entry holds its own row, not the batch cache it was cut from: MLX's
    active memory grows by the entries' counted bytes, within the cap."""
    import gc

    import mlx.core as mx

    from mtpflow.prefix_cache import PrefixCache
    from mtpflow.targets.cache import SlotKVCache

    B, H, D, layers = 16, 2, 32, 2  # a batch row of 64 slots: 2 * (2 * 2*64*32*4 + 64*4) = 65 KiB
    pc = PrefixCache(max_bytes=512 * 1024)
    gc.collect()
    before = mx.get_active_memory()
    for i in range(12):  # each batch cache is 16 rows of 256 slots (4 MiB): 12 of them would be 48 MiB
        T = 64 if i % 2 else 256  # a strided view of the used slots, or all of them
        cache = []
        for _ in range(layers):
            c = SlotKVCache()
            c.offset = mx.zeros((B,), dtype=mx.int32)
            c.update_and_fetch(mx.random.normal((B, H, T, D)), mx.random.normal((B, H, T, D)))
            cache.append(c)
        pc.store([i] + list(range(1, T)), cache, row=i % B)
        del cache, c
    gc.collect()
    held = mx.get_active_memory() - before
    assert 0 < len(pc.entries) < 12 and pc.bytes <= pc.max_bytes
    assert held <= pc.max_bytes + 64 * 1024, f"{held} bytes held for a cap of {pc.max_bytes}"
    assert held >= 0.9 * pc.bytes
