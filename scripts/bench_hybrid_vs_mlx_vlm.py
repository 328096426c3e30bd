"""mtpflow next to mlx-vlm 0.7.10 on the same tiny hybrid checkpoint with its own MTP head.

Runs greedy speculative decoding with the checkpoint's ``mtp.*`` head on a
Qwen3.5 checkpoint (default: the parity fixture
``tests/fixtures/native_mtp/qwen3_5``) in both, and prints: whether the
tokens are the same, tokens per second of each and their ratio, τ, and the
share of mtpflow's rounds spent rolling the recurrent layers back (the
rollback is timed separately on the same verify shapes).  mlx-vlm runs in its
own virtualenv (``--ref-python``), one prompt at a time (its
``generate_step``); mtpflow decodes the batch together.

The two sides take turns: mlx-vlm's worker stays up and decodes the prompts
once per request, then mtpflow does, ``--reps`` times; the ratio is the median
of the per-turn ratios, so load from other jobs on a shared machine falls on
both sides alike.  Each side's clock covers decoding only (mlx-vlm's drafter
is loaded before its clock starts, mtpflow's session before the first turn).

    PYTHONPATH=$PWD python scripts/bench_hybrid_vs_mlx_vlm.py [--batch 1 4] [--block 3] [--max-tokens 48] [--reps 15]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: process CPU time (all threads) of each side: on a machine shared with other
#: jobs it moves far less than wall time (``--wall`` switches)
_clock = time.process_time
PROMPTS = [[2, 17, 300, 41, 99, 5, 77, 120, 64, 8, 33], [2, 501, 502], [2, 9, 9, 9, 150, 23, 7], [2, 100, 3, 77, 21, 64],
           [2, 44, 45, 46, 47, 48], [2, 400, 401], [2, 7, 7, 300, 12], [2, 250, 251, 252, 99, 98, 97, 96]]


def worker(model: str, block: int, max_tokens: int) -> None:
    """mlx-vlm's side (run with the reference interpreter): for each line of
    prompts (JSON) on stdin, decode them one at a time and print one JSON line."""
    import sys

    import mlx.core as mx
    from mlx_vlm.generate.ar import generate_step
    from mlx_vlm.speculative.drafters import load_drafter
    from mlx_vlm.utils import load_model

    target = load_model(Path(model))
    target.set_dtype(mx.float32)
    for line in sys.stdin:
        prompts = json.loads(line)
        drafters = []
        for _ in prompts:  # a drafter holds one generation's state: a fresh one per prompt
            dm, kind = load_drafter(model, kind="mtp")
            dm.set_dtype(mx.float32)
            drafters.append(dm)
        t0 = _clock()
        toks_all = [[int(t) for t, _ in generate_step(mx.array([p]), target, None, None, max_tokens=max_tokens,
                                                       draft_model=dm, draft_kind=kind, draft_block_size=block,
                                                       prefill_step_size=None, temperature=0.0)]
                    for p, dm in zip(prompts, drafters)]
        dt = _clock() - t0
        acc = [int(a) for dm in drafters for a in dm.accept_lens]
        print(json.dumps({"tokens": toks_all, "seconds": dt, "tau": 1 + sum(acc) / max(len(acc), 1)}), flush=True)


def mtpflow_side(model: str, prompts: list, block: int, max_tokens: int):
    """mtpflow's side: a function that decodes ``prompts`` together once and
    returns ``{tokens, seconds, tau}``."""
    import attrs

    from mtpflow._blas import ensure_fast_blas

    ensure_fast_blas()
    from mtpflow.config import load_config
    from mtpflow.engine import generate_stream, load_session, make_request
    from mtpflow.logs import null_logger

    s = load_session(load_config(overrides={"model": {"model": model, "draft_kind": "mtp"},
                                            "draft": {"block_size": block, "policy": "fixed"},
                                            "batch": {"max_batch_size": len(prompts)}}), log=null_logger())

    def turn() -> dict:
        s.reset_stats()
        reqs = [attrs.evolve(make_request(s, p, max_tokens=max_tokens, request_id=str(i)), stop_ids=frozenset())
                for i, p in enumerate(prompts)]
        toks = {r.id: [] for r in reqs}
        t0 = _clock()
        for ev in generate_stream(s, reqs):
            toks[ev.request_id].extend(ev.tokens)
        dt = _clock() - t0
        st = s.stats.as_dict()
        return {"tokens": [toks[str(i)] for i in range(len(prompts))], "seconds": dt,
                "tau": 1 + st["accepted_tokens"] / max(st["drafts"], 1)}

    return turn


def rollback_share(model: str, B: int, block: int) -> float:
    """The recurrent layers' rollback (ragged keeps) over the verify of ``block`` tokens, median of 20."""
    import statistics

    import mlx.core as mx

    from mtpflow.targets.hybrid import Qwen35Target
    from mtpflow.targets.recurrent import RecurrentCache

    t = Qwen35Target.from_path(model)
    prompts = [PROMPTS[b % len(PROMPTS)] for b in range(B)]
    pos = mx.array([len(p) for p in prompts], dtype=mx.int32)
    counts = [1 + b % block for b in range(B)] if B > 1 else [max(1, block // 2)]
    keep = mx.array(counts, dtype=mx.int32)
    tv, tr = [], []
    for rep in range(23):
        cache, _ = t.prefill(prompts)
        mx.eval([c.state for c in cache])
        t.set_offsets(cache, pos)
        t0 = _clock()
        mx.eval(t.forward(mx.array([[5] * block] * B, dtype=mx.int32), cache), [c.state for c in cache])
        t1 = _clock()
        for c in cache:
            c.rollback(block, keep, pos + keep, block - max(counts), min(counts) != max(counts))
        mx.eval([c.state for c in cache if isinstance(c, RecurrentCache)])
        if rep >= 3:
            tv.append(t1 - t0)
            tr.append(_clock() - t1)
    return statistics.median(tr) / statistics.median(tv)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "tests" / "fixtures" / "native_mtp" / "qwen3_5"))
    ap.add_argument("--ref-python", default="/work/ref-vlm/bin/python")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--block", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=15, help="turns of each side (after one warm-up turn each)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--wall", action="store_true", help="time wall clock instead of process CPU time")
    args = ap.parse_args(argv)
    global _clock
    if args.wall:
        _clock = time.perf_counter
    if args.worker:
        worker(args.model, args.block, args.max_tokens)
        return
    print(f"model {args.model}  block {args.block}  max_tokens {args.max_tokens}  {args.reps} turns each, interleaved  "
          f"clock {'wall' if args.wall else 'process CPU'}")
    print(f"{'B':>2} {'same':>5} {'mlx-vlm tok/s':>14} {'mtpflow tok/s':>14} {'ratio':>6} {'tau vlm':>8} {'tau ours':>9} {'rollback/verify':>16}")
    for B in args.batch:
        prompts = [PROMPTS[b % len(PROMPTS)] for b in range(B)]
        ref = subprocess.Popen([args.ref_python, __file__, "--worker", "--model", args.model, "--block", str(args.block),
                                "--max-tokens", str(args.max_tokens)] + (["--wall"] if args.wall else []),
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

        def theirs() -> dict:
            ref.stdin.write(json.dumps(prompts) + "\n")
            ref.stdin.flush()
            return json.loads(ref.stdout.readline())

        ours = mtpflow_side(args.model, prompts, args.block, args.max_tokens)
        a, b = theirs(), ours()  # warm-up turns
        pairs = []
        for _ in range(args.reps):
            a, b = theirs(), ours()
            pairs.append((a["seconds"], b["seconds"]))
        ref.stdin.close()
        ref.wait()
        n = sum(len(t) for t in b["tokens"])
        tv, to = n / statistics.median(p[0] for p in pairs), n / statistics.median(p[1] for p in pairs)
        ratio = statistics.median(p[0] / p[1] for p in pairs)
        share = rollback_share(args.model, B, args.block)
        print(f"{B:>2} {str(b['tokens'] == a['tokens']):>5} {tv:>14.1f} {to:>14.1f} {ratio:>5.2f}x "
              f"{a['tau']:>8.3f} {b['tau']:>9.3f} {100 * share:>15.1f}%")


if __name__ == "__main__":
    main()
