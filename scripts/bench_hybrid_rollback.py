"""The rollback of a hybrid target's recurrent layers, against its verify.

For each rollback mode of :class:`mtpflow.targets.recurrent.RecurrentCache`
("steps": per-step states recorded during the verify, gathered; "replay":
a snapshot and the step inputs, replayed with a mask) it times, on a tiny
random Qwen3.5 checkpoint (tests/tiny_hybrid.py, or ``--model``):

* the verify: one target forward over ``[B, k+1]`` tokens, evaluated;
* the rollback: every layer's ``rollback`` to ragged per-row counts (every
  row keeping a different number of tokens, the costly case), evaluated;

and prints the medians and the rollback's share of the verify.

    PYTHONPATH=$PWD python scripts/bench_hybrid_rollback.py [--batch 1 4] [--block 4 8] [--reps 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from mtpflow._blas import ensure_fast_blas

ensure_fast_blas()

import mlx.core as mx  # noqa: E402

#: CPU time of the process (all threads): on a machine shared with other jobs
#: it moves far less than wall time; ``--wall`` switches to wall time
_clock = time.process_time


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a hybrid checkpoint folder (default: a tiny random Qwen3.5)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--block", type=int, nargs="+", default=[4, 8], help="tokens verified per row (k + 1)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--family", choices=("qwen3_5", "nemotron_h"), default="qwen3_5",
                    help="the tiny random checkpoint built without --model (nemotron_h: Mamba2 layers)")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--wall", action="store_true", help="time wall clock instead of process CPU time")
    ap.add_argument("--device-keep", action="store_true",
                    help="roll back from the device counts only (one gather over every step's state)")
    args = ap.parse_args(argv)
    global _clock
    if args.wall:
        _clock = time.perf_counter

    from mtpflow.targets.hybrid import Qwen3NextTarget, Qwen35Target
    from mtpflow.targets.recurrent import RecurrentCache

    path = args.model
    if path is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from tiny_hybrid import build
        from tiny_nemotron import build as build_nemotron

        tmp = Path(tempfile.mkdtemp())
        path = build_nemotron(tmp, seed=0, mtp=False) if args.family == "nemotron_h" else build(tmp, "qwen3_5", seed=0)
    from mtpflow.targets.base import read_config

    from mtpflow.targets.nemotron_h import NemotronHTarget

    mt = read_config(Path(path)).get("model_type")
    cls = {"qwen3_next": Qwen3NextTarget, "nemotron_h": NemotronHTarget}.get(mt, Qwen35Target)
    target = cls.from_path(path)
    print(f"model {path}  device {mx.default_device()}  clock {'wall' if args.wall else 'process CPU'}")
    print(f"{'mode':7} {'B':>2} {'k+1':>4} {'verify ms':>10} {'rollback ms':>12} {'share':>7}")
    for mode in ("steps", "replay"):
        target.rollback_mode = mode
        for B in args.batch:
            for T in args.block:
                prompts = [[2] + [(7 * i + 13 * b) % 2000 + 4 for i in range(args.prompt - b)] for b in range(B)]
                pos = mx.array([len(p) for p in prompts], dtype=mx.int32)
                counts = [1 + b % T for b in range(B)] if B > 1 else [T // 2]  # ragged: 1, 2, ... per row
                keep = mx.array(counts, dtype=mx.int32)
                inputs = mx.array([[5 + j for j in range(T)]] * B, dtype=mx.int32)
                tv, tr = [], []
                for rep in range(args.reps + 3):
                    cache, _ = target.prefill(prompts)  # a fresh cache each time (not timed)
                    mx.eval([c.state for c in cache])
                    target.set_offsets(cache, pos)
                    t0 = _clock()
                    h = target.forward(inputs, cache)
                    mx.eval(h, [c.state for c in cache])
                    t1 = _clock()
                    for c in cache:
                        c.rollback(T, keep, pos + keep, T - max(counts), min(counts) != max(counts),
                                   kept=None if args.device_keep else counts)
                    mx.eval([c.state for c in cache if isinstance(c, RecurrentCache)])
                    t2 = _clock()
                    if rep >= 3:
                        tv.append(t1 - t0)
                        tr.append(t2 - t1)
                v, r = statistics.median(tv) * 1e3, statistics.median(tr) * 1e3
                print(f"{mode:7} {B:>2} {T:>4} {v:>10.2f} {r:>12.3f} {100 * r / v:>6.1f}%")


if __name__ == "__main__":
    main()
