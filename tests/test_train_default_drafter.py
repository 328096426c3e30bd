"""scripts/train_default_drafter.py in its tiny mode on SmolLM2 (the packaged target), with prompt
files instead of the ShareGPT / MT-Bench wheels: interrupted in round 1's training, run again to the
end (curve.jsonl, OUT/best, each training step logged once), then run a third time, which finds
every stage complete and runs nothing.  About a minute on a 2-core CPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "train_default_drafter.py"

pytestmark = pytest.mark.slow

TRAIN_PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis simply.",
    "List three uses of a paperclip.", "How do I boil an egg?", "Give me a synonym for happy.",
    "What is 12 times 7?", "Name a famous painter.", "Why is the sky blue?", "Translate 'hello' to Spanish.",
    "Describe a cat in one sentence.", "What does a compiler do?",
]
EVAL_PROMPTS = ["Tell me a joke.", "What is gravity?", "Write a short poem about rain.", "How do plants grow?"]


@pytest.fixture(scope="module")
def smollm():
    from mtpflow.convert.gguf import GGUFError, find_packaged_gguf

    try:
        find_packaged_gguf("smollm2-135m")
    except GGUFError as exc:
        pytest.skip(str(exc))


def _env(tmp_path: Path, out: Path) -> dict:
    (tmp_path / "train.txt").write_text("\n".join(TRAIN_PROMPTS) + "\n")
    (tmp_path / "eval.txt").write_text("\n".join(EVAL_PROMPTS) + "\n")
    return {**os.environ, "TINY": "1", "OUT": str(out), "PROMPTS": str(tmp_path / "train.txt"),
            "EVAL_PROMPTS": str(tmp_path / "eval.txt"), "STEPS": "6", "MTPFLOW": f"{sys.executable} -m mtpflow.cli"}


def _run(env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT)], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


def _interrupt_in_training(env, out: Path) -> int:
    """Run until round 1 has logged a training step, then Ctrl-C (SIGINT) the script; its exit status."""
    p = subprocess.Popen([sys.executable, str(SCRIPT)], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    log = out / "round-01" / "train_log.jsonl"
    deadline = time.time() + 400
    while p.poll() is None and time.time() < deadline:
        if log.is_file() and log.read_text().strip():
            p.send_signal(signal.SIGINT)
            break
        time.sleep(0.2)
    return p.wait(timeout=120)


def test_tiny_rounds_resume_and_skip(tmp_path, smollm):
    out = tmp_path / "run"
    env = _env(tmp_path, out)
    rc = _interrupt_in_training(env, out)
    if rc == 130:  # (0 when the machine was quick enough to finish first)
        assert (out / "round-01" / "checkpoint" / "manifest.json").is_file()
        assert not (out / "round-01" / "eval.json").exists()

    p = _run(env)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [json.loads(x) for x in (out / "curve.jsonl").read_text().splitlines()]
    assert [x["round"] for x in lines] == [0, 1, 2]
    assert lines[0]["steps"] == 0 and lines[0]["answer_tokens"] == 0
    assert 0 < lines[1]["answer_tokens"] <= lines[2]["answer_tokens"]
    for x in lines:
        assert x["tau"] >= 1.0 and len(x["acceptance_per_position"]) == 3 and x["wall_s"] > 0
    assert [x["steps"] for x in lines[1:]] == [6, 6]
    steps = [json.loads(x)["step"] for x in (out / "round-01" / "train_log.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 7))  # resumed from the checkpoint: each step once
    best = json.loads((out / "best.json").read_text())
    assert best["round"] in (1, 2) and best["tau"] == max(x["tau"] for x in lines[1:])
    assert (out / "best" / "model.safetensors").is_file() and (out / "best" / "config.json").is_file()

    again = _run(env)  # every stage complete: nothing runs, the curve is the same
    assert again.returncode == 0, again.stderr[-3000:]
    assert "$ " not in again.stdout
    assert [json.loads(x) for x in (out / "curve.jsonl").read_text().splitlines()] == lines
