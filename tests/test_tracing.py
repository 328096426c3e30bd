"""One structlog event per round, plain numbers; metrics as vLLM's SpecDecodingStats."""

import json
import subprocess
import sys

import structlog
from conftest import make_session
from structlog.testing import capture_logs

from mtpflow.engine import generate

FIELDS = {"round", "batch_size", "block_size", "drafted", "accepted", "emitted", "draft_s", "verify_s", "host_s", "syncs"}


def test_one_round_event_per_round_with_plain_numbers():
    s = make_session("e", block_size=5, log=structlog.get_logger("mtpflow"))
    with capture_logs() as logs:
        res = generate(s, list(range(5, 30)), max_tokens=30)
    rounds = [e for e in logs if e["event"] == "round"]
    assert len(rounds) == s.stats.rounds > 1
    for i, e in enumerate(rounds):
        assert FIELDS <= set(e)
        assert e["round"] == i
        assert all(type(x) is int for x in e["accepted"] + e["emitted"])
        assert type(e["draft_s"]) is float and type(e["verify_s"]) is float
        assert e["syncs"] == 1
        assert e["emitted_total"] == sum(e["emitted"])
    assert sum(e["emitted_total"] for e in rounds) + 1 == len(res.tokens)  # + the prefill token


def test_stats_are_consistent():
    s = make_session("d", block_size=4)
    res = generate(s, list(range(5, 40)), max_tokens=40)
    st = s.stats
    d = res.stats
    assert sum(st.accepted_per_position) == st.accepted_tokens
    assert all(a >= b for a, b in zip(st.accepted_per_position, st.accepted_per_position[1:]))
    assert d["mean_acceptance_length"] == round(1 + st.accepted_tokens / st.drafts, 4)
    assert d["tau"] == round(st.produced_tokens / st.row_rounds, 4) >= 1.0
    assert st.emitted_tokens + 1 == len(res.tokens)
    assert 0.0 <= d["acceptance_rate"] <= 1.0


def test_library_never_configures_structlog():
    code = (
        "import sys; sys.path.insert(0, 'tests'); import structlog, conftest;"
        "from mtpflow.engine import generate;"
        "s = conftest.make_session('e', log=structlog.get_logger('x'));"
        "generate(s, [5, 6, 7], max_tokens=4);"
        "print(structlog.is_configured())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_cli_trace_file_is_json_lines(tmp_path):
    from conftest import FIXTURES

    from mtpflow.cli import main

    trace = tmp_path / "t.jsonl"
    rc = main(["generate", "--model", str(FIXTURES / "pair_e" / "target"), "--draft-model", str(FIXTURES / "pair_e" / "drafter"),
               "--prompt-ids", "5,6,7,8,9", "--max-tokens", "12", "--trace", str(trace), "--json"])
    assert rc == 0
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    assert events and all(e["event"] == "round" and FIELDS <= set(e) for e in events)


def test_round_events_are_built_only_for_a_logger_that_keeps_them():
    import io
    import logging

    from mtpflow.logs import debug_enabled, file_logger, null_logger, round_logger
    from mtpflow.train.eval import _RoundCollector

    assert not debug_enabled(null_logger())
    assert debug_enabled(file_logger(io.StringIO()))
    assert debug_enabled(_RoundCollector())  # a catch-all stand-in that cannot say (eval's): keep the events
    log, lg = round_logger(), logging.getLogger("mtpflow.rounds")
    old = lg.level
    try:
        lg.setLevel(logging.INFO)
        assert not debug_enabled(log)
        lg.setLevel(logging.DEBUG)
        assert debug_enabled(log)
    finally:
        lg.setLevel(old)
