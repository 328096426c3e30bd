"""Resume that cannot go wrong silently (issue 20, item 5): checkpoints are
written as one unit and verified on load, every damaged case is a one-line
error naming the file, the log is repaired, and a run killed mid-way resumes
to the losses of an uninterrupted one."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from conftest import FIXTURES

from mtpflow.train.checkpoint import CheckpointError, load_checkpoint, read_state, repair_log, save_checkpoint
from mtpflow.train.run import train

PAIR_E = FIXTURES / "pair_e" / "target"
DRAFTER = {"num_hidden_layers": 1, "intermediate_size": 64}
RUN = dict(batch_size=4, unroll=2, warmup=2, lr=3e-3, progress=False, checkpoint_every=3, log_every=100, steps=10)


def _model_and_opt(seed: int):
    mx.random.seed(seed)
    m = nn.Linear(6, 5)
    opt = optim.AdamW(learning_rate=1e-2)
    grads = {k: mx.ones_like(v) for k, v in m.parameters().items()}
    opt.update(m, grads)  # the optimiser has state
    mx.eval(m.parameters(), opt.state)
    return m, opt


@pytest.fixture
def ckpt(tmp_path):
    m, opt = _model_and_opt(0)
    path = tmp_path / "checkpoint"
    save_checkpoint(path, m, opt, {"step": 7, "acc_ema": [0.5]})
    return path


def _error(ckpt) -> str:
    m, opt = _model_and_opt(1)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(ckpt, m, opt)
    msg = str(info.value)
    assert "\n" not in msg and "delete" in msg, msg  # one line, and what to do
    return msg


def test_checkpoint_round_trip_and_manifest(ckpt):
    m0, _ = _model_and_opt(0)
    m, opt = _model_and_opt(1)
    assert not np.array_equal(np.array(m.weight), np.array(m0.weight))
    state = load_checkpoint(ckpt, m, opt)
    assert state["step"] == 7
    assert np.array_equal(np.array(m.weight), np.array(m0.weight))
    assert sorted(p.name for p in ckpt.iterdir()) == ["manifest.json", "model.safetensors", "optimizer.safetensors",
                                                       "state.json"]
    assert not any(p.name.startswith("checkpoint.") for p in ckpt.parent.iterdir())  # no temporary folder left
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["step"] == 7 and manifest["files"]["model.safetensors"]["bytes"] == (ckpt / "model.safetensors").stat().st_size


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.safetensors"])
def test_truncated_weights_name_the_file(ckpt, name):
    f = ckpt / name
    f.write_bytes(f.read_bytes()[:100])
    msg = _error(ckpt)
    assert f"{f}: truncated: 100 bytes" in msg, msg


def test_altered_weights_and_garbage_state(ckpt):
    f = ckpt / "model.safetensors"
    b = bytearray(f.read_bytes())
    b[-3] ^= 0xFF  # same size, other content
    f.write_bytes(bytes(b))
    assert f"{f}: content differs" in _error(ckpt)
    f.write_bytes(bytes(b[:-3]) + bytes([b[-3] ^ 0xFF]) + bytes(b[-2:]))  # repaired
    s = ckpt / "state.json"
    s.write_text("garbage")
    assert str(s) in _error(ckpt)


def test_missing_state_json_is_an_error_not_a_restart(ckpt):
    (ckpt / "state.json").unlink()
    assert f"{ckpt / 'state.json'}: missing" in _error(ckpt)


def test_a_checkpoint_without_a_manifest_is_refused(ckpt):
    """Nothing to verify it against: a flipped byte would train on silently."""
    (ckpt / "manifest.json").unlink()
    f = ckpt / "model.safetensors"
    b = bytearray(f.read_bytes())
    b[-3] ^= 0xFF
    f.write_bytes(bytes(b))
    msg = _error(ckpt)
    assert f"{ckpt / 'manifest.json'}: missing" in msg and "cannot be verified" in msg, msg
    assert "model.safetensors" in msg and "state.json" in msg, msg  # what the folder holds


def test_a_swap_cut_by_a_kill_recovers_the_newest_whole_checkpoint(tmp_path):
    path = tmp_path / "checkpoint"
    m, opt = _model_and_opt(0)
    save_checkpoint(path, m, opt, {"step": 3})
    save_checkpoint(tmp_path / "later", m, opt, {"step": 6})
    # killed while writing the next one: checkpoint.new is incomplete -> the old checkpoint stands
    shutil.copytree(tmp_path / "later", tmp_path / "checkpoint.new")
    (tmp_path / "checkpoint.new" / "manifest.json").unlink()
    assert read_state(path)["step"] == 3 and not (tmp_path / "checkpoint.new").exists()
    # killed between the two renames: checkpoint.old and a complete checkpoint.new
    path.rename(tmp_path / "checkpoint.old")
    shutil.copytree(tmp_path / "later", tmp_path / "checkpoint.new")
    assert read_state(path)["step"] == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "later"]
    # ... and before checkpoint.new was complete: the old one is put back
    path.rename(tmp_path / "checkpoint.old")
    (tmp_path / "checkpoint.new").mkdir()
    assert read_state(path)["step"] == 6 and not (tmp_path / "checkpoint.old").exists()
    assert read_state(tmp_path / "nothing") is None


def test_repair_log_drops_a_cut_line_and_later_steps(tmp_path):
    log = tmp_path / "train_log.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) for s in range(1, 6)]
    log.write_text("\n".join(lines) + "\n" + lines[0][:9])  # a kill cut the 6th line
    assert repair_log(log, 4) == 4
    assert log.read_text() == "\n".join(lines[:4]) + "\n"
    assert repair_log(log, 4) == 4  # idempotent
    log.write_text(lines[0] + "\nnot json\n" + lines[1] + "\n")
    with pytest.raises(CheckpointError, match="line 2 is not a log record"):
        repair_log(log, 9)


def _log(out):
    return [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    train(PAIR_E, DRAFTER, "selfgen:16:24", out, **RUN)
    return out


def test_missing_state_json_in_a_run_is_an_error_and_the_log_is_kept(straight, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    (out / "checkpoint" / "state.json").unlink()
    before = (out / "train_log.jsonl").read_text()
    with pytest.raises(CheckpointError, match="state.json: missing"):
        train(PAIR_E, DRAFTER, "selfgen:16:24", out, **RUN)
    assert (out / "train_log.jsonl").read_text() == before  # no second run appended


def test_a_cut_log_line_is_dropped_and_the_run_resumes_to_the_same_losses(straight, tmp_path):
    out = tmp_path / "run"
    train(PAIR_E, DRAFTER, "selfgen:16:24", out, **dict(RUN, stop_at=6))
    with open(out / "train_log.jsonl", "a") as f:  # steps 7 and 8 ran, 8's line was cut by the kill
        f.write(json.dumps({"step": 7, "loss": 0.0}) + "\n" + '{"step": 8, "lo')
    train(PAIR_E, DRAFTER, "selfgen:16:24", out, **RUN)
    got, want = _log(out), _log(straight)
    assert [r["step"] for r in got] == list(range(1, 11))
    assert np.allclose([r["loss"] for r in got], [r["loss"] for r in want], rtol=0, atol=1e-6)


KILLER = textwrap.dedent("""
    import os, signal, sys
    from mtpflow.backend.blas import ensure_fast_blas
    ensure_fast_blas()
    import mtpflow.train.data as data
    from mtpflow.train.run import train
    real = data.batches
    def batches(examples, batch_size, seed, step, *a, **k):
        if step == int(sys.argv[3]):  # the process dies here, as under kill -9: nothing is flushed or cleaned up
            os.kill(os.getpid(), signal.SIGKILL)
        return real(examples, batch_size, seed, step, *a, **k)
    data.batches = batches
    train(sys.argv[1], {drafter}, "selfgen:16:24", sys.argv[2], **{run})
""")


def test_a_killed_run_resumes_to_the_losses_of_an_uninterrupted_one(straight, tmp_path):
    out = tmp_path / "killed"
    script = tmp_path / "killer.py"
    script.write_text(KILLER.format(drafter=DRAFTER, run=RUN))
    env = dict(os.environ, MTPFLOW_DISABLE_PLUGIN_AUTOLOAD="1")
    p = subprocess.run([sys.executable, str(script), str(PAIR_E), str(out), "7"], env=env, capture_output=True,
                       timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stderr.decode()[-2000:]
    assert read_state(out / "checkpoint")["step"] == 6  # steps 1-6 checkpointed, step 7 never finished
    train(PAIR_E, DRAFTER, "selfgen:16:24", out, **RUN)
    got, want = _log(out), _log(straight)
    assert [r["step"] for r in got] == list(range(1, 11))
    assert np.allclose([r["loss"] for r in got], [r["loss"] for r in want], rtol=0, atol=1e-6)
    wa, wb = mx.load(str(straight / "model.safetensors")), mx.load(str(out / "model.safetensors"))
    for k in wa:
        assert np.allclose(np.array(wa[k]), np.array(wb[k]), atol=1e-6, rtol=0), k


def test_sigterm_checkpoints_the_finished_step_and_the_run_resumes_to_the_same_losses(straight, tmp_path, monkeypatch):
    import mtpflow.train.data as data
    from mtpflow.train.optimize import TrainingInterrupted

    real = data.batches
    sent = []

    def batches(examples, batch_size, seed, step, *a, **k):
        if step == 4 and not sent:  # the signal arrives (once) while step 5 is being computed
            sent.append(step)
            os.kill(os.getpid(), signal.SIGTERM)
        return real(examples, batch_size, seed, step, *a, **k)

    monkeypatch.setattr(data, "batches", batches)
    out = tmp_path / "run"
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with pytest.raises(TrainingInterrupted) as info:
        train(PAIR_E, DRAFTER, "selfgen:16:24", out, **RUN)
    assert info.value.step == 5 and info.value.signum == signal.SIGTERM
    assert "resume from step 5" in str(info.value)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before  # the handlers are put back
    assert read_state(out / "checkpoint")["step"] == 5  # checkpoint_every 3: step 5 saved on the signal
    monkeypatch.setattr(data, "batches", real)
    train(PAIR_E, DRAFTER, "selfgen:16:24", out, **RUN)
    got, want = _log(out), _log(straight)
    assert [r["step"] for r in got] == list(range(1, 11))
    assert np.allclose([r["loss"] for r in got], [r["loss"] for r in want], rtol=0, atol=1e-6)


def test_ctrl_c_on_the_cli_checkpoints_and_says_where_it_resumes(tmp_path):
    import re
    import time

    out, errf = tmp_path / "run", tmp_path / "stderr.txt"
    env = dict(os.environ, MTPFLOW_DISABLE_PLUGIN_AUTOLOAD="1")
    cmd = [sys.executable, "-m", "mtpflow.cli", "train", "--target", str(PAIR_E), "--data", "selfgen:16:24",
           "--out", str(out), "--steps", "100000", "--checkpoint-every", "100000", "--batch-size", "4",
           "--unroll", "2", "--drafter-config", json.dumps(DRAFTER)]
    with open(errf, "w") as err:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=env)
        try:
            deadline = time.time() + 240
            while time.time() < deadline and p.poll() is None:  # the progress bar has passed step 2
                steps = [int(x) for x in re.findall(r"(\d+)/100000", errf.read_text())]
                if steps and max(steps) >= 2:
                    break
                time.sleep(0.2)
            assert p.poll() is None, errf.read_text()[-2000:]
            p.send_signal(signal.SIGINT)
            rc = p.wait(timeout=120)
        finally:
            if p.poll() is None:
                p.kill()
    text = errf.read_text()
    assert rc == 130, text[-2000:]
    assert "Traceback" not in text
    last = text.strip().splitlines()[-1]
    m = re.search(r"resume from step (\d+)$", last)
    assert m and last.startswith("mtpflow: interrupted by SIGINT"), last
    step = int(m.group(1))
    assert step >= 2 and read_state(out / "checkpoint")["step"] == step
    assert [r["step"] for r in _log(out)] == list(range(1, step + 1))
