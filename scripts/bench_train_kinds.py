"""Training tokens/s of every drafter kind, from the target per batch and from one shared feature cache.

    python scripts/bench_train_kinds.py --target smollm2-135m --data random:32:256 --steps 5

One process, the same data for every run (``random:N:L``: N rows of L random
token ids, loss on the second half, written to a JSONL file; or any data
spec): first a ``cache:`` folder is
collected once with what every kind reads (the hidden states, the assistant
kind's K/V, the union of EAGLE-3's and DFlash's layer taps); then each kind
trains ``--steps`` steps twice, recomputing the target's features per batch
("target") and reading them from the shared cache ("cache").  A run's rate is
the tokens of steps 2.. over their time (step 1 pays the graph set-up), from
its ``train_log.jsonl`` (wall clock) and over the process CPU time of those
steps.  On a shared machine compare the ratios, not the absolute figures: the
last columns are each run's rate over the assistant kind's cached rate.

    python scripts/bench_train_kinds.py --kinds assistant,mtp --sources cache --turns 3 --steps 3

``--turns N`` runs every (kind, source) N times, the kinds alternating within
a turn, and reports each ratio's median over the turns (each turn's ratio
pairs runs made one after the other, so a load change between turns cancels).
The FLOP columns are each run's last step (:mod:`mtpflow.train.flops`: three
times the drafter's forward, less once its products by frozen weights, plus the
labels' head) per token, and the rate of
steps 2.. in FLOP/s as a share of the matmul rate probed in the same process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KIND_OPTIONS = {
    "assistant": None,
    "eagle3": {"draft_vocab_size": 8192},
    "dflash": {"block_size": 8, "num_hidden_layers": 2},
    "mtp": {"depth": 2},
}


def rate(out: Path) -> float:
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    if len(log) < 2:
        return float("nan")
    return (log[-1]["tokens_seen"] - log[0]["tokens_seen"]) / max(log[-1]["elapsed_s"] - log[0]["elapsed_s"], 1e-9)


class StepCPU:
    """The process CPU time of each optimiser step of the runs made while it is
    installed (wraps ``_Loop.run_step``); :meth:`rate`: tokens per CPU second of
    a run's steps 2.. (threads of this process add up, other processes' load
    does not)."""

    def __init__(self):
        from mtpflow.train import optimize as opt_mod

        self.steps: list[tuple[float, int]] = []
        run_step = opt_mod._Loop.run_step
        steps = self.steps

        def timed(loop, *a, **kw):
            c0 = time.process_time()
            run_step(loop, *a, **kw)
            steps.append((time.process_time() - c0, loop.tokens_seen))

        opt_mod._Loop.run_step = timed

    def rate(self) -> float:
        st, self.steps[:] = list(self.steps), []
        if len(st) < 2:
            return float("nan")
        return (st[-1][1] - st[0][1]) / max(sum(c for c, _ in st[1:]), 1e-9)


def flop_figures(summary: dict, tokens_per_s: float) -> tuple[float, float]:
    """``(MFLOP per token of the last step, share of the matmul rate)`` of a run: the FLOPs per
    token times ``tokens_per_s`` (steps 2.., as the rate columns) over the probe in the summary."""
    fl = summary["train_speed"]["flops"]
    tokens = summary["tokens_seen"] / max(summary["steps"], 1)
    mflop = fl["last_step_gflop"]["total"] * 1e3 / max(tokens, 1)
    probe = fl["matmul_rate_gflops"]
    return mflop, (mflop * 1e6 * tokens_per_s / (probe * 1e9) if probe else float("nan"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--data", default="random:32:256")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--kinds", default="assistant,eagle3,dflash,mtp")
    p.add_argument("--sources", default="target,cache", help="target, cache or both (comma-separated)")
    p.add_argument("--turns", type=int, default=1, help="runs of every (kind, source); ratios: medians over them")
    p.add_argument("--lanes", default="0", help="comma-separated --lanes values, each run in every turn "
                                                "(0: the device's default; e.g. 1,0 compares without and with lanes)")
    p.add_argument("--kind-config", action="append", default=[], metavar="KIND=JSON",
                   help="a kind's drafter config instead of the defaults above (repeatable), e.g. the shipped "
                        "default drafter's: 'assistant={\"num_hidden_layers\": 1, \"draft_vocab_size\": 8192}'")
    args = p.parse_args(argv)
    for item in args.kind_config:
        kind, sep, cfg = item.partition("=")
        if not sep or kind not in KIND_OPTIONS:
            p.error(f"--kind-config {item!r}: expected KIND=JSON with KIND one of {', '.join(KIND_OPTIONS)}")
        KIND_OPTIONS[kind] = json.loads(cfg)

    from mtpflow.train.run import tap_layers, train
    from mtpflow.train.target import load_target

    target = load_target(args.target)
    if KIND_OPTIONS["eagle3"].get("draft_vocab_size"):
        KIND_OPTIONS["eagle3"]["draft_vocab_size"] = min(KIND_OPTIONS["eagle3"]["draft_vocab_size"], target.vocab_size)
    kinds = args.kinds.split(",")
    union = sorted({t for k in kinds if k in ("eagle3", "dflash") for t in tap_layers(k, target, KIND_OPTIONS[k])})
    common = dict(batch_size=args.batch_size, steps=args.steps, warmup=1, checkpoint_every=10_000, progress=False,
                  unroll=3, anchors=8, max_len=512)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.data.startswith("random:"):
            import numpy as np

            n, length = (int(x) for x in args.data.split(":")[1:3])
            rng = np.random.default_rng(0)
            f = tmp / "random.jsonl"
            f.write_text("".join(json.dumps({"tokens": rng.integers(4, target.vocab_size, length).tolist(),
                                             "loss_mask": [i >= length // 2 for i in range(length)]}) + "\n"
                                 for _ in range(n)))
            args.data = str(f)
        cache = tmp / "cache"
        # one collection for every kind (the assistant kind reads the K/V, so it collects)
        s = train(target, KIND_OPTIONS["assistant"], f"cache:{args.data}", tmp / "collect", kind="assistant",
                  cache_dir=str(cache), cache_taps=tuple(union), **dict(common, steps=1))
        print(f"collected {s['cache']['tokens']} tokens in {s['cache']['seconds']} s, taps {union}", file=sys.stderr)
        cpu = StepCPU()
        sources = {"target": args.data, "cache": f"cache:{args.data}"}
        lanes = [int(x) for x in args.lanes.split(",")]
        runs = [(k, h, n) for k in kinds for h in args.sources.split(",") for n in lanes]
        for turn in range(args.turns):
            for kind, how, n in runs:
                out = tmp / f"{kind}-{how}-{n}-{turn}"
                s = train(target, KIND_OPTIONS[kind], sources[how], out, kind=kind, cache_dir=str(cache), lanes=n,
                          **common)
                key = (kind, how) if len(lanes) == 1 else (kind, f"{how}/{s['train_speed']['lanes']}")
                wall = rate(out)
                rows.setdefault(key, []).append((wall, cpu.rate(), *flop_figures(s, wall)))
                r = rows[key][-1]
                print(f"turn {turn} {kind:9s} {key[1]:6s} {r[0]:8.1f} tokens/s {r[1]:8.1f} tokens/CPU-s "
                      f"{r[2]:7.1f} MFLOP/token {r[3]:5.2f} of matmul", file=sys.stderr)
    report(rows, args.turns)
    return 0


def report(rows: dict, turns: int) -> None:
    """The table: median rates, and the median over turns of each turn's ratio to assistant (cache)."""
    ref = next((runs for (kind, how), runs in rows.items() if kind == "assistant" and how.startswith("cache")), None)

    def ratio(runs, col):
        if not ref:
            return float("nan")
        return statistics.median(r[col] / a[col] for r, a in zip(runs, ref))

    print(f"{'kind':9s} {'from':6s} {'tokens/s':>9s} {'tok/CPU-s':>10s} {'MFLOP/tok':>10s} {'matmul':>7s} "
          f"{'/ assistant(cache), wall':>25s} {'CPU':>6s}   (medians over {turns} turn(s))")
    for (kind, how), runs in rows.items():
        med = [statistics.median(r[c] for r in runs) for c in range(4)]
        print(f"{kind:9s} {how:6s} {med[0]:9.1f} {med[1]:10.1f} {med[2]:10.1f} {med[3]:7.2f} "
              f"{ratio(runs, 0):25.2f} {ratio(runs, 1):6.2f}")
    print(json.dumps({f"{k}/{h}": [[round(x, 3) for x in r] for r in runs] for (k, h), runs in rows.items()}))


if __name__ == "__main__":
    from mtpflow._blas import ensure_fast_blas
    from mtpflow.backend.heap import retain_freed_memory

    retain_freed_memory()  # as `mtpflow train` does (MTPFLOW_HEAP=system: glibc's own heap)
    ensure_fast_blas()
    sys.exit(main())
