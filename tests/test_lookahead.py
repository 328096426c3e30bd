"""The null path's lookahead: a round that drafts nothing builds the next
round's verify before its own sync (as mlx-lm's ``generate_step``).  Outputs
must be exactly those without it: greedy equals target-only, seeded sampling is
the same stream, and ragged, stopping and joining rows drop a stale lookahead."""

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


def test_late_joiners_settle_the_lookahead(s1):
    first = [make_request(s1, prompt("e", "short"), max_tokens=24)]
    late = [make_request(s1, prompt("e", "long"), max_tokens=16), make_request(s1, prompt("e", "short")[2:], max_tokens=9)]
    s1.reset_stats()
    out = drive_with_late_joiners(s1, first, late, join_after=5)
    for r in first + late:
        assert out[r.id] == reference(s1, r.prompt, r.max_tokens), r.id
    assert s1.stats.overlapped > 0


class _Alternating:
    """A block policy whose ``peek`` always promises a null round but which
    drafts every third round: each such round must drop the round built ahead."""

    def __init__(self):
        self.n = 0

    def block_size(self, stats):
        self.n += 1
        return 3 if self.n % 3 == 0 else 1

    def peek(self, stats):
        return 1

    def observe(self, record):
        pass


def test_a_wrong_peek_costs_a_verify_not_a_token():
    s = make_session("e", block_size=1)
    s.block_policy = _Alternating()
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
