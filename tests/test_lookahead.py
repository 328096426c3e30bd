"""The lookahead: a round that drafts nothing builds the next round's verify
before its own sync (as mlx-lm's ``generate_step``), and a drafting round the
next round of as many drafts, on its own lazy outcome.  Outputs must be exactly
those without it: greedy equals target-only, seeded sampling is the same
stream, the verifies see the same states, and ragged, stopping and joining rows
and a wrong peek drop a stale lookahead."""

import pytest
from conftest import RoundLog, drive_with_late_joiners, make_session, prompt, reference

from mtpflow.builtins import stages
from mtpflow.engine import generate_stream, make_request
from mtpflow.state import SamplingParams


@pytest.fixture(scope="module")
def s1():
    return make_session("e", block_size=1)


def run(session, reqs):
    session.reset_stats()
    out = {r.id: [] for r in reqs}
    finish = {}
    for ev in generate_stream(session, reqs):
        out[ev.request_id].extend(ev.tokens)
        if ev.finish_reason is not None:
            finish[ev.request_id] = ev.finish_reason
    return out, finish


def no_lookahead(monkeypatch):
    monkeypatch.setattr(stages, "_next_round_null", lambda *a, **k: False)


def test_null_rounds_overlap_and_match_target_only(s1):
    for name in ("short", "long"):  # "long" runs past the 16-token sliding window
        ids = prompt("e", name)
        req = make_request(s1, ids, max_tokens=40)
        out, finish = run(s1, [req])
        assert out[req.id] == reference(s1, ids, 40)
        assert finish[req.id] == "length"
        st = s1.stats.as_dict()
        # every round but the first adopts the one built ahead of it; the last builds none
        assert st["overlapped_rounds"] == s1.stats.rounds - 1 > 30
        assert s1.stats.syncs == s1.stats.rounds


def _records(session, reqs):
    log = RoundLog()
    session.plugins.pm.register(log, name="test-round-log")
    try:
        run(session, reqs)
    finally:
        session.plugins.pm.unregister(log)
    return log.records


def test_round_records_say_which_round_built_the_next(s1):
    """``built_ahead`` marks the round that built the next round's verify and started it (its
    sync also waited on that forward; the adaptive policy measures such runs as a whole), and
    ``overlapped`` the round that adopted it.  One row ending by length adopts every look-ahead;
    a row that stops drops the one built in its last round, which still says it built one."""
    records = _records(s1, [make_request(s1, prompt("e", "short"), max_tokens=24)])
    assert len(records) > 20
    for before, after in zip(records, records[1:]):
        assert before.built_ahead == after.overlapped
    assert not records[-1].built_ahead

    ref = reference(s1, prompt("e", "long"), 30)
    req = make_request(s1, prompt("e", "long"), max_tokens=30)
    req.stop_ids = frozenset({ref[12]})
    records = _records(s1, [req, make_request(s1, prompt("e", "short"), max_tokens=30)])
    for before, after in zip(records, records[1:]):
        assert after.overlapped <= before.built_ahead  # only a round built ahead is adopted
    dropped = [i for i, (b, a) in enumerate(zip(records, records[1:])) if b.built_ahead and not a.overlapped]
    assert dropped, [(r.built_ahead, r.overlapped) for r in records]


def test_long_generation_past_the_window_many_times(s1):
    ids = prompt("e", "long") * 3
    req = make_request(s1, ids, max_tokens=100)
    out, _ = run(s1, [req])
    assert out[req.id] == reference(s1, ids, 100)
    assert s1.stats.overlapped > 90


def test_ragged_budgets_and_stops_drop_the_stale_lookahead(s1):
    ids = [prompt("e", "short"), prompt("e", "long"), prompt("e", "short")[3:]]
    budgets = [7, 30, 19]
    reqs = [make_request(s1, p, max_tokens=n) for p, n in zip(ids, budgets)]
    # a stop token the target produces mid-way for the third row
    ref3 = reference(s1, ids[2], 19)
    reqs[2].stop_ids = frozenset({ref3[11]})
    out, finish = run(s1, reqs)
    assert out[reqs[0].id] == reference(s1, ids[0], 7)
    assert out[reqs[1].id] == reference(s1, ids[1], 30)
    stop_at = ref3.index(ref3[11])
    assert out[reqs[2].id] == ref3[:stop_at]
    assert finish[reqs[2].id] == "stop" and finish[reqs[0].id] == "length"
    assert s1.stats.overlapped > 0


@pytest.mark.parametrize("which, budgets, join_after", [("s1", (24, 16, 9), 5), ("s3", (30, 17, 11), 4)])
def test_late_joiners_settle_the_lookahead(request, which, budgets, join_after):
    """Null rounds (``s1``) and drafting rounds (``s3``) built ahead, dropped when rows join."""
    s = request.getfixturevalue(which)
    a, b, c = budgets
    first = [make_request(s, prompt("e", "short"), max_tokens=a)]
    late = [make_request(s, prompt("e", "long"), max_tokens=b), make_request(s, prompt("e", "short")[2:], max_tokens=c)]
    s.reset_stats()
    out = drive_with_late_joiners(s, first, late, join_after=join_after)
    for r in first + late:
        assert out[r.id] == reference(s, r.prompt, r.max_tokens), r.id
    assert s.stats.overlapped > 0


class _Wavering:
    """A block policy whose ``peek`` always promises block ``promise`` but which
    runs block ``other`` every ``every``-th round: each such round must drop the
    round built ahead, with its cache slots."""

    def __init__(self, promise: int, other: int, every: int):
        self.promise, self.other, self.every, self.n = promise, other, every, 0

    def block_size(self, stats):
        self.n += 1
        return self.other if self.n % self.every == 0 else self.promise

    def peek(self, stats):
        return self.promise

    def observe(self, record):
        pass


def test_a_wrong_peek_costs_a_verify_not_a_token():
    s = make_session("e", block_size=1)
    s.block_policy = _Wavering(1, 3, 3)  # promises null rounds, drafts every third
    for name in ("short", "long"):
        ids = prompt("e", name)
        req = make_request(s, ids, max_tokens=40)
        out, _ = run(s, [req])
        assert out[req.id] == reference(s, ids, 40)
        assert s.stats.draft_tokens > 0 and s.stats.overlapped > 0


def test_seeded_sampling_is_the_same_stream_with_and_without(monkeypatch):
    s = make_session("e", block_size=1, sampling={"temperature": 0.9})
    ids = [prompt("e", "short"), prompt("e", "long")]

    def reqs():
        return [make_request(s, p, max_tokens=32, sampling=SamplingParams(temperature=1.0, seed=11 + i))
                for i, p in enumerate(ids)]

    on, _ = run(s, reqs())
    assert s.stats.overlapped > 0
    with monkeypatch.context() as m:
        no_lookahead(m)
        off, _ = run(s, reqs())
        assert s.stats.overlapped == 0
    assert list(on.values()) == list(off.values())
    assert any(o != reference(s, p, 32) for o, p in zip(on.values(), ids))  # it really sampled


def test_processors_and_sync_timing_turn_it_off():
    s = make_session("e", block_size=1, trace={"sync_timing": True})
    req = make_request(s, prompt("e", "short"), max_tokens=12)
    out, _ = run(s, [req])
    assert out[req.id] == reference(s, prompt("e", "short"), 12)
    assert s.stats.overlapped == 0


class _AcceptWatcher:
    """A plugin wrapping ``mtpflow_accept``: it must see one accept per round, in
    round order, unless it says it copes with the lookahead."""

    from mtpflow import hookimpl as _hookimpl

    def __init__(self, safe=None):
        self.calls = 0
        self.rounds = []
        if safe is not None:
            self.lookahead_safe = lambda state: safe

    @_hookimpl(wrapper=True)
    def mtpflow_accept(self, session, state, draft, verify):
        self.calls += 1
        return (yield)

    @_hookimpl
    def mtpflow_emit(self, session, record, emitted):
        self.rounds.append(self.calls)


@pytest.mark.parametrize("safe", [None, False, True])
def test_a_plugin_on_the_round_stages_turns_it_off_unless_it_copes(safe):
    from mtpflow.plugins import make_plugin_manager

    w = _AcceptWatcher(safe)
    s = make_session("e", block_size=1, plugins=make_plugin_manager([w], autoload=False))
    ids = prompt("e", "short")
    out, _ = run(s, [make_request(s, ids, max_tokens=16)])
    assert list(out.values())[0] == reference(s, ids, 16)
    if safe:
        assert s.stats.overlapped > 0 and w.rounds[0] == 2  # the next round's accept came before this emit
    else:
        assert s.stats.overlapped == 0 and w.rounds == list(range(1, s.stats.rounds + 1))


def test_a_stage_plugin_registered_later_turns_it_off_at_once():
    """The stage plugins are remembered between rounds; registering one on a
    session that already overlapped takes effect in its next generation."""
    from mtpflow.plugins import make_plugin_manager

    plugins = make_plugin_manager([], autoload=False)
    s = make_session("e", block_size=1, plugins=plugins)
    ids = prompt("e", "short")
    run(s, [make_request(s, ids, max_tokens=16)])
    assert s.stats.overlapped > 0
    w = _AcceptWatcher(False)
    plugins.pm.register(w)
    out, _ = run(s, [make_request(s, ids, max_tokens=16)])
    assert list(out.values())[0] == reference(s, ids, 16)
    assert s.stats.overlapped == 0 and w.rounds == list(range(1, s.stats.rounds + 1))
    plugins.pm.unregister(w)
    run(s, [make_request(s, ids, max_tokens=16)])
    assert s.stats.overlapped > 0


# -- drafting rounds: the next chain built before this round's sync -----------------------------


@pytest.fixture(scope="module")
def s3():
    return make_session("e", block_size=3, draft={"policy": "fixed"})


@pytest.fixture
def spoiled(s3, monkeypatch):
    """``s3`` with a drafter that is wrong now and then (the fixture's accepts nearly every
    draft): at even bonus positions from the second draft on, and at every fifth from the first,
    it proposes the next token id.  Lazy as the drafter's own output, so rounds still build ahead, and roll back."""
    import attrs
    import mlx.core as mx

    propose = s3.drafter.propose

    def spoil(session, state, shared, n_draft):
        block = propose(session, state, shared, n_draft)
        col = mx.arange(block.tokens.shape[1])[None]
        pos = shared.bonus_position[:, None]
        bad = ((pos % 2 == 0) & (col >= 1)) | (pos % 5 == 0)
        return attrs.evolve(block, tokens=mx.where(bad, (block.tokens + 1) % session.target.vocab_size, block.tokens))

    monkeypatch.setattr(s3.drafter, "propose", spoil)
    return s3


def no_chain_lookahead(monkeypatch):
    monkeypatch.setattr(stages, "_next_round_same_chain", lambda *a, **k: False)


def _drafted_overlaps(records):
    return sum(1 for r in records if r.overlapped and r.drafted > 0)


def test_drafting_rounds_overlap_and_match_target_only(spoiled):
    """A drafting round builds the next one (its draft on this round's lazy accepted tokens,
    hidden state and positions, its verify after this round's slots, rolled back lazily) before
    its sync; the output is target-only greedy's, and each round still syncs once."""
    for name in ("short", "long"):  # "long" runs past the 16-token sliding window
        ids = prompt("e", name)
        req = make_request(spoiled, ids, max_tokens=40)
        records = _records(spoiled, [req])
        assert sum(r.emitted[0] for r in records) == 40 - 1  # the first token comes with the prefill
        out, _ = run(spoiled, [make_request(spoiled, ids, max_tokens=40)])
        assert list(out.values())[0] == reference(spoiled, ids, 40)
        assert _drafted_overlaps(records) >= len(records) // 2, [(r.drafted, r.overlapped) for r in records]
        assert any(r.accepted[0] < r.drafted for r in records if r.overlapped)  # rejections rolled back lazily
        for before, after in zip(records, records[1:]):
            assert after.overlapped <= before.built_ahead
        assert spoiled.stats.syncs == spoiled.stats.rounds


def test_drafting_lookahead_ragged_rows_stops_and_budgets(spoiled):
    ids = [prompt("e", "short"), prompt("e", "long"), prompt("e", "short")[3:]]
    budgets = [9, 33, 21]
    ref3 = reference(spoiled, ids[2], 21)
    reqs = [make_request(spoiled, p, max_tokens=n) for p, n in zip(ids, budgets)]
    reqs[2].stop_ids = frozenset({ref3[13]})
    records = _records(spoiled, reqs)
    assert _drafted_overlaps(records) > 0
    assert any(len(set(r.accepted)) > 1 for r in records if r.overlapped)  # ragged acceptance, lazily
    reqs = [make_request(spoiled, p, max_tokens=n) for p, n in zip(ids, budgets)]
    reqs[2].stop_ids = frozenset({ref3[13]})
    out, finish = run(spoiled, reqs)
    assert out[reqs[0].id] == reference(spoiled, ids[0], 9)
    assert out[reqs[1].id] == reference(spoiled, ids[1], 33)
    assert out[reqs[2].id] == ref3[: ref3.index(ref3[13])]
    assert finish[reqs[2].id] == "stop" and finish[reqs[0].id] == "length"


def test_drafting_lookahead_seeded_sampling_is_the_same_stream(monkeypatch):
    s = make_session("e", block_size=3, draft={"policy": "fixed"}, sampling={"temperature": 0.9})
    ids = [prompt("e", "short"), prompt("e", "long")]

    def reqs():
        return [make_request(s, p, max_tokens=32, sampling=SamplingParams(temperature=1.0, seed=5 + i))
                for i, p in enumerate(ids)]

    on, _ = run(s, reqs())
    assert s.stats.overlapped > 0 and s.stats.draft_tokens > 0
    with monkeypatch.context() as m:
        no_chain_lookahead(m)
        off, _ = run(s, reqs())
        assert s.stats.overlapped == 0
    assert list(on.values()) == list(off.values())


def test_a_wrong_peek_drops_the_drafted_round_and_its_slots():
    s = make_session("e", block_size=3, draft={"policy": "fixed"})
    s.block_policy = _Wavering(3, 2, 4)
    for name in ("short", "long"):
        ids = prompt("e", name)
        records = _records(s, [make_request(s, ids, max_tokens=40)])
        s.block_policy = _Wavering(3, 2, 4)
        out, _ = run(s, [make_request(s, ids, max_tokens=40)])
        assert list(out.values())[0] == reference(s, ids, 40)
        dropped = [b for b, a in zip(records, records[1:]) if b.built_ahead and not a.overlapped]
        assert dropped and _drafted_overlaps(records) > 0


def test_the_cache_is_compacted_between_runs_of_lookahead(s3, monkeypatch):
    """Lazily rolled-back rounds leave their rejected slots as holes; when the target says a
    compaction is due, the round builds nothing ahead, so the next advance compacts."""
    seen = []
    due = s3.target.compact_due
    monkeypatch.setattr(s3.target, "compact_due", lambda cache, n: seen.append(due(cache, n)) or seen[-1])
    ids = prompt("e", "long") * 3
    req = make_request(s3, ids, max_tokens=120)
    out, _ = run(s3, [req])
    assert out[req.id] == reference(s3, ids, 120)
    assert True in seen and seen.count(False) > seen.count(True)
    assert s3.stats.overlapped > s3.stats.rounds // 2


def test_a_drafter_that_does_not_cope_turns_it_off(s3, monkeypatch):
    monkeypatch.setattr(type(s3.drafter), "lookahead_safe", lambda self, state: False)
    ids = prompt("e", "short")
    records = _records(s3, [make_request(s3, ids, max_tokens=24)])
    assert _drafted_overlaps(records) == 0


class _VerifyLog:
    """Keeps every verify's hidden states (a stage wrapper that copes with the lookahead)."""

    from mtpflow import hookimpl as _hookimpl

    def __init__(self):
        self.hidden = []

    def lookahead_safe(self, state):
        return True

    @_hookimpl(wrapper=True)
    def mtpflow_verify(self, session, state, draft):
        v = yield
        self.hidden.append(v.hidden)
        return v


def test_a_round_built_ahead_sees_what_the_round_after_the_sync_would(spoiled, monkeypatch):
    """Every verify's hidden states, with and without the lookahead, agree to float rounding: the
    round built ahead attends to the accepted slots only (the rejected ones are holes, masked),
    at the same positions.  Greedy tokens alone would not show a stale slot on the fixture."""
    import mlx.core as mx

    ids = prompt("e", "long")
    logs = []
    for ahead in (True, False):
        log = _VerifyLog()
        spoiled.plugins.pm.register(log, name="test-verify-log")
        try:
            with monkeypatch.context() as m:
                if not ahead:
                    no_chain_lookahead(m)
                out, _ = run(spoiled, [make_request(spoiled, ids, max_tokens=36)])
                assert (spoiled.stats.overlapped > 0) == ahead
        finally:
            spoiled.plugins.pm.unregister(log)
        assert list(out.values())[0] == reference(spoiled, ids, 36)
        logs.append(log.hidden)
    on, off = logs
    assert len(on) == len(off) > 10
    for i, (a, b) in enumerate(zip(on, off)):
        assert a.shape == b.shape and mx.allclose(a, b, atol=1e-5, rtol=1e-5).item(), i
