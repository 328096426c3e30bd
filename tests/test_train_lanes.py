"""Training lanes (``--lanes``, :mod:`mtpflow.train.lanes`): the parts of a batch
evaluated side by side on worker threads give the losses of the same parts
evaluated one after another, never share an unevaluated array, and hand a
lane's error to the caller."""

from __future__ import annotations

import json
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mtpflow.train import lanes as lanes_mod
from mtpflow.train.run import train

FIX = Path(__file__).parent / "fixtures"
PAIR_E = FIX / "hf_gemma4" / "pair_e" / "target"
E3, DF = FIX / "eagle3", FIX / "dflash"
RUN = dict(batch_size=4, unroll=2, warmup=2, lr=3e-3, progress=False, checkpoint_every=100, log_every=100, steps=4)

#: kind, target, drafter options, extra settings: every built-in kind, the assistant with and without
#: a draft vocabulary (its head caches the target rows of the vocabulary)
CASES = {
    "assistant": ("assistant", PAIR_E, {"num_hidden_layers": 1, "intermediate_size": 64}, {}),
    "assistant-draft-vocab": ("assistant", PAIR_E, {"num_hidden_layers": 1, "intermediate_size": 64,
                                                    "draft_vocab_size": 64}, {}),
    "eagle3": ("eagle3", E3 / "target", {"draft_vocab_size": 512}, {"anchors": 4, "targets": "hard"}),
    "dflash": ("dflash", DF / "target", {"block_size": 4, "num_hidden_layers": 1}, {"anchors": 4}),
    "mtp": ("mtp", E3 / "target", {"depth": 2}, {"max_len": 64}),
}


def _losses(out: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (out / "train_log.jsonl").read_text().splitlines()]


def _graph_nodes(arrays, path: Path) -> set[str]:
    """The ids of the unevaluated operations ``arrays`` depend on."""
    mx.export_to_dot(str(path), arrays)
    return set(re.findall(r"\{ (\d+) \[label =", path.read_text()))


@pytest.mark.parametrize("case", sorted(CASES))
def test_lane_parts_share_no_unevaluated_array_and_match_the_parts_one_after_another(case, tmp_path, monkeypatch):
    """Every part a worker evaluates is a graph of its own (a shared lazy array would be
    evaluated by two threads at once), and two lanes give the losses of the same two parts
    evaluated one after another (``--grad-accum 2 --lanes 1``)."""
    kind, target, opts, extra = CASES[case]
    settings = dict(RUN, kind=kind, **extra)
    held: list = []
    seen = {"parallel_steps": 0, "groups": 0}
    submit, wait = lanes_mod.Lanes.submit, lanes_mod.Lanes.wait

    def held_submit(self, i, arrays):
        if self.inline:
            return submit(self, i, arrays)
        held.append((i, arrays))

    def checked_wait(self):
        if held:
            seen["groups"] += 1
            graphs = [_graph_nodes(a, tmp_path / f"part{k}.dot") for k, (_, a) in enumerate(held)]
            assert len(held) == 2 and all(graphs)
            assert not graphs[0] & graphs[1], f"{case}: the lanes share {len(graphs[0] & graphs[1])} lazy arrays"
            for i, a in held:
                submit(self, i, a)
            held.clear()
        return wait(self)

    monkeypatch.setattr(lanes_mod.Lanes, "submit", held_submit)
    monkeypatch.setattr(lanes_mod.Lanes, "wait", checked_wait)
    lanes = train(target, opts, "selfgen:16:32", tmp_path / "lanes", lanes=2, **settings)
    assert lanes["train_speed"]["lanes"] == 2
    assert seen["groups"] == 2 * (RUN["steps"] - 1)  # batches, then gradients, of every step after the first
    parts = train(target, opts, "selfgen:16:32", tmp_path / "parts", lanes=1, grad_accum=2, **settings)
    assert parts["train_speed"]["lanes"] == 1
    got, want = _losses(tmp_path / "lanes"), _losses(tmp_path / "parts")
    assert len(got) == RUN["steps"]
    assert np.allclose(got, want, rtol=0, atol=1e-6), (got, want)


def test_a_resumed_run_with_lanes_equals_an_uninterrupted_one(tmp_path):
    """The first step of a sitting runs its parts inline, the others side by side: the same sums,
    so a run stopped after step 3 and resumed logs the losses of one that never stopped."""
    kind, target, opts, extra = CASES["assistant"]
    settings = dict(RUN, kind=kind, steps=6, checkpoint_every=3, **extra)
    train(target, opts, "selfgen:16:32", tmp_path / "straight", lanes=2, **settings)
    train(target, opts, "selfgen:16:32", tmp_path / "resumed", lanes=2, **dict(settings, stop_at=3))
    assert len(_losses(tmp_path / "resumed")) == 3
    train(target, opts, "selfgen:16:32", tmp_path / "resumed", lanes=2, **settings)
    got, want = _losses(tmp_path / "resumed"), _losses(tmp_path / "straight")
    assert len(got) == 6 and np.allclose(got, want, rtol=0, atol=1e-6), (got, want)


def test_lane_count_follows_the_profile_the_ranks_and_the_rows(monkeypatch):
    from mtpflow.backend import profiles
    from mtpflow.train.config import TrainConfig

    monkeypatch.setattr(lanes_mod.os, "cpu_count", lambda: 8)
    cpu = profiles.PROFILES["cpu"]
    monkeypatch.setattr(profiles, "current", lambda: cpu)
    assert cpu.train_lanes == 0
    assert lanes_mod.lane_count(0, rows=16) == 8  # one per core
    assert lanes_mod.lane_count(0, rows=16, ranks=4) == 2  # the cores shared by the ranks on the machine
    assert lanes_mod.lane_count(0, rows=3) == 3  # never more than the rows
    assert lanes_mod.lane_count(1, rows=16) == 1 and lanes_mod.lane_count(5, rows=16) == 5
    monkeypatch.setattr(profiles, "current", lambda: profiles.PROFILES["cuda"])
    assert lanes_mod.lane_count(0, rows=16) == 1  # one GPU stream
    with pytest.raises(ValueError, match="lanes must be >= 0"):
        TrainConfig(lanes=-1)


def test_blas_threads_sets_and_restores_openblas():
    """In a process of its own on OpenBLAS (the tests' process may run MKL, whose TBB pool is
    shared by the lanes' threads and needs no setting)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from mtpflow.backend.blas import find_blas_library

    if not sys.platform.startswith("linux") or find_blas_library() is None:
        pytest.skip("OpenBLAS not installed")
    code = (
        "import ctypes\n"
        "from mtpflow.backend.blas import ensure_fast_blas, blas_threads\n"
        "assert ensure_fast_blas()['status'] == 'loaded'\n"
        "import mlx.core\n"
        "lib = ctypes.CDLL(None)\n"
        "before = lib.openblas_get_num_threads()\n"
        "with blas_threads(1):\n"
        "    assert lib.openblas_get_num_threads() == 1\n"
        "assert lib.openblas_get_num_threads() == before\n"
        "print('ok', before)\n"
    )
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "MTPFLOW_BLAS": "openblas", "PYTHONPATH": str(repo)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr


def test_a_lanes_error_reaches_the_caller_and_the_lanes_stay_usable():
    """A part that uses another lane's unevaluated array fails in its worker; :meth:`Lanes.wait`
    raises it as one line that says what to do, and the lanes evaluate the next parts."""
    lanes = lanes_mod.Lanes(2)
    try:
        with lanes.stream(0):
            other = mx.arange(4) * 2  # built on lane 0's stream, never evaluated there
        with lanes.stream(1):
            uses_it = other + 1
        lanes.submit(1, uses_it)
        with pytest.raises(RuntimeError, match="another lane built and did not evaluate.*--lanes 1"):
            lanes.wait()
        with lanes.stream(0):
            good = mx.arange(4) * 2
        with lanes.stream(1):
            again = mx.ones(3) + 1
        lanes.submit(0, good)
        lanes.submit(1, again)
        lanes.wait()
        assert good.tolist() == [0, 2, 4, 6] and again.tolist() == [2.0, 2.0, 2.0]
    finally:
        lanes.close()
