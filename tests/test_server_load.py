"""``python -m mtpflow.loadtest`` works (a few seconds of it; the real runs are opt-in)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from conftest import FIXTURES  # noqa: E402

PAIR = FIXTURES / "pair_e"

#: the hardening cases every run covers (issue 32: local files, image bombs, logit_bias / echo /
#: best_of / suffix, half-header connections)
HARDENING = {"image-local-file", "image-bomb", "logit_bias-bad-key", "logit_bias-out-of-range",
             "frequency_penalty-3", "echo", "best_of", "suffix", "half-header"}


def test_loadtest_smoke(tmp_path, capsys):
    from mtpflow.loadtest import main

    out = tmp_path / "report.json"
    rc = main(["--model", str(PAIR / "target"), "--draft-model", str(PAIR / "drafter"), "--clients", "6",
               "--duration", "6", "--bad-fraction", "0.4", "--faults", "--pool", "12", "--idle-wait", "0.5", "--warmup", "2",
               "--header-timeout", "1", "--half-header-share", "0.1", "--prefix-cache-mb", "8", "--check-memory",
               "--json", str(out), "--quiet"])
    report = json.loads(out.read_text())
    assert rc == 0 and report["passed"], report
    assert report["good"]["sent"] > 0 and report["good"]["ok"] == report["good"]["sent"]
    assert report["bad"]["sent"] > 0 and report["bad"]["unexpected"] == []
    assert HARDENING <= set(report["bad"]["kinds"]), report["bad"]["kinds"]
    assert report["latency_s"]["p95"] is not None and report["memory_mb"]["peak"] > 0
    mem = report["memory_mb"]
    assert mem["within_budget"] and mem["peak_after_warmup"] <= 1.25 * (mem["footprint"] + 8), mem
    assert report["open_fds"]["after_idle"] <= report["open_fds"]["startup"] + 8, report["open_fds"]
    assert report["server_metrics"]["spec_decode_num_drafts"] > 0
    assert "PASS" in capsys.readouterr().out


def test_loadtest_fails_when_outputs_differ(monkeypatch, tmp_path):
    """A good request whose output differs from its solo run fails the run."""
    import mtpflow.serve.loadtest as lt

    real = lt._text_of
    calls = {"n": 0}

    def flaky(status, data, chat, stream):
        calls["n"] += 1
        text = real(status, data, chat, stream)
        return text if calls["n"] <= 4 or text is None else text + "!"  # the solo pass is right, the load is not

    monkeypatch.setattr(lt, "_text_of", flaky)
    rc = lt.main(["--model", str(PAIR / "target"), "--draft-model", str(PAIR / "drafter"), "--clients", "2",
                  "--duration", "1", "--pool", "4", "--idle-wait", "0", "--quiet"])
    assert rc == 1
