"""Batches with ragged acceptance, rows that leave, and rows that join."""

import pytest
from conftest import RoundLog, drive_with_late_joiners, make_session, prompt, reference

from mtpflow.engine import Batcher, generate_stream, make_request
from mtpflow.plugins import make_plugin_manager


def prompts(pair):
    base = [prompt(pair, n) for n in ("short", "edge", "long")]
    long_ = base[2]
    # lengths 3 .. 56: several past the 16-token sliding window
    return [base[0][:3], base[0], base[1], long_[:25], long_, long_ + base[1], base[1][::-1], long_[5:35]]


def ref(s, pair, p, n):
    return reference(s, p, n)


@pytest.mark.parametrize("pair", ["e", "d"])
@pytest.mark.parametrize("batch", [1, 2, 5, 8])
def test_ragged_batch_equals_target_only_per_row(pair, batch):
    rounds = RoundLog()
    s = make_session(pair, block_size=5, plugins=make_plugin_manager([rounds], autoload=False), batch={"max_batch_size": 8})
    ps = prompts(pair)[:batch]
    max_tokens = [30, 7, 45, 12, 33, 20, 26, 18][:batch]
    reqs = [make_request(s, p, max_tokens=m, request_id=str(i)) for i, (p, m) in enumerate(zip(ps, max_tokens))]
    out = {r.id: [] for r in reqs}
    for ev in generate_stream(s, reqs):
        out[ev.request_id].extend(ev.tokens)
    for r in reqs:
        assert out[r.id] == ref(s, pair, r.prompt, r.max_tokens), r.id
    if batch > 1:
        sizes = [rec.batch_size for rec in rounds.records]
        assert sizes[0] == batch and sizes[-1] < batch  # rows left as they finished
        assert sorted(sizes, reverse=True) == sizes
    if batch >= 5:
        ragged = [rec for rec in rounds.records if len(set(rec.accepted)) > 1]
        assert ragged, "rows should accept different numbers of drafts in one round"


def test_continuous_batching_admits_between_rounds():
    rounds = RoundLog()
    s = make_session("e", block_size=4, plugins=make_plugin_manager([rounds], autoload=False),
                     batch={"policy": "continuous", "max_batch_size": 3})
    ps = prompts("e")
    reqs = [make_request(s, p, max_tokens=8 + 5 * i, request_id=str(i)) for i, p in enumerate(ps)]
    out = drive_with_late_joiners(s, reqs[:2], reqs[2:], join_after=3, max_live=3)
    for r in reqs:
        assert out[r.id] == ref(s, "e", r.prompt, r.max_tokens), r.id
    sizes = [rec.batch_size for rec in rounds.records]
    assert max(sizes) == 3 and 2 in sizes[:3]


def test_cancel_frees_the_row():
    s = make_session("e", block_size=4, batch={"policy": "continuous"})
    reqs = [make_request(s, p, max_tokens=40, request_id=str(i)) for i, p in enumerate(prompts("e")[:3])]
    b = Batcher(s)
    b.add(reqs)
    b.step()
    assert b.live == 3
    assert b.cancel("1")
    evs = b.step()
    assert b.live == 2 and all(ev.request_id != "1" or ev.finish_reason == "cancelled" for ev in evs)
    assert not b.cancel("nope")


def test_speculative_false_row_decodes_with_the_target_alone():
    s = make_session("e", block_size=5)
    ps = prompts("e")
    a = make_request(s, ps[4], max_tokens=20, request_id="spec")
    b = make_request(s, ps[2], max_tokens=20, request_id="plain", speculative=False)
    out = {"spec": [], "plain": []}
    for ev in generate_stream(s, [a, b]):
        out[ev.request_id].extend(ev.tokens)
    assert out["spec"] == ref(s, "e", a.prompt, 20)
    assert out["plain"] == ref(s, "e", b.prompt, 20)


def test_first_tokens_stream_before_the_batch_round():
    """A request's first token (its prefill's) is yielded before any round runs,
    and a late joiner's before the live batch's next round."""
    s = make_session("e", block_size=4, batch={"policy": "continuous"})
    ps = prompts("e")
    a = make_request(s, ps[0], max_tokens=12, request_id="a")
    s.reset_stats()
    g = generate_stream(s, [a])
    first = next(g)
    assert first.request_id == "a" and len(first.tokens) == 1 and s.stats.rounds == 0
    g.close()

    b = Batcher(s)
    b.add([a])
    b.step()
    rounds = s.stats.rounds
    late = make_request(s, ps[1], max_tokens=12, request_id="late")
    b.add([late])
    parts = b.step_parts()
    joined = next(parts)
    assert [ev.request_id for ev in joined] == ["late"] and len(joined[0].tokens) == 1
    assert s.stats.rounds == rounds  # the batch's round has not run yet
    round_events = next(parts)
    assert s.stats.rounds == rounds + 1 and {ev.request_id for ev in round_events} <= {"a", "late"}
    out = {"a": [], "late": list(joined[0].tokens)}
    for ev in round_events:
        out[ev.request_id].extend(ev.tokens)
    while not b.idle:
        for ev in b.step():
            out[ev.request_id].extend(ev.tokens)
    assert out["late"] == reference(s, late.prompt, 12)
