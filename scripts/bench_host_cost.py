"""Where the host thread's CPU time goes per token: mlx-lm against mtpflow's null path
(``submit_layers`` off, so each graph is submitted by one call; ``fuse_ops`` off, so both run
mlx-lm's own modules and the same graph), interleaved in shuffled order.

    python scripts/bench_host_cost.py [REPEATS] [TARGET]

On ``mlx[cpu]`` the thread that calls ``mx.eval`` / ``mx.async_eval`` pays for submitting every
node of the graph, so the host thread, not the compute, bounds a tiny model's tokens/s. Its CPU
time (``time.thread_time``, which a neighbour's load barely moves, unlike wall time) splits into:
submitting graphs (inside ``mx.eval`` / ``mx.async_eval``), building the model's graph (inside the
text model's ``__call__``) and all other Python (docs/benchmarks.md, "What limits speed on this CPU").
"""

import collections
import random
import sys
import time

from mtpflow.backend.blas import ensure_fast_blas

ensure_fast_blas()

import mlx.core as mx  # noqa: E402
from bench_submit_layers import FIXTURE, batch_one_engines  # noqa: E402  (this folder)

from mtpflow import bench  # noqa: E402

spent = collections.Counter()


def timed(name, fn):
    def wrapper(*a, **k):
        c = time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            spent[name] += time.thread_time() - c

    return wrapper


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    args, prompts, mlx, mtp = batch_one_engines(sys.argv[2] if len(sys.argv) > 2 else FIXTURE, "--submit-layers", "off", "--fuse-ops", "off")
    session = mtp.session
    assert not session.submit_layers
    # every caller looks these up on the module at call time (mlx-lm's generate_step as well)
    mx.eval, mx.async_eval = timed("submit", mx.eval), timed("submit", mx.async_eval)
    inner = type(session.target.inner)
    inner.__call__ = timed("build", inner.__call__)
    engines = {"mlx_lm": mlx, "mtpflow": mtp}
    for v in engines.values():
        v.run(prompts, args.max_tokens, bench.RoundCollector())
    tot = {k: collections.Counter() for k in engines}
    for i in range(repeats):
        jobs = list(engines)
        random.Random(i).shuffle(jobs)
        for k in jobs:
            spent.clear()
            c, w = time.thread_time(), time.perf_counter()
            n = engines[k].run(prompts, args.max_tokens, bench.RoundCollector())["tokens"]
            spent["host"] += time.thread_time() - c
            spent["wall"] += time.perf_counter() - w
            spent["tokens"] += n
            tot[k].update(spent)
    print("ms per token      wall   host thread = submitting + building the model + other Python")
    for k, a in tot.items():
        ms = {x: 1000 * a[x] / a["tokens"] for x in ("wall", "host", "submit", "build")}
        other = ms["host"] - ms["submit"] - ms["build"]
        print(f"{k:12s} {ms['wall']:9.3f} {ms['host']:9.3f}     {ms['submit']:9.3f}  {ms['build']:9.3f}  {other:9.3f}")


if __name__ == "__main__":
    main()
