"""mlx-lm and mtpflow's null path, each on mlx-lm's own modules and on the fused ones
(:mod:`mtpflow.backend.fusion`), the four interleaved in one process in shuffled order (one
shared model), so a noisy host drifts the same way for all four.

    python scripts/bench_fusion.py [REPEATS] [TARGET]

Prints each engine's median tokens/s, the ratio of medians to stock mlx-lm and the
paired median ratio (docs/benchmarks.md, "The round loop without a drafter").  mlx-lm on the fused modules against
mtpflow on the fused modules is the round loop's own cost; mtpflow fused against
stock mlx-lm is what `mtpflow bench` reports with the defaults.
"""

import contextlib
import random
import statistics
import sys
import time

from mtpflow.backend.blas import ensure_fast_blas

ensure_fast_blas()

from bench_submit_layers import FIXTURE, batch_one_engines  # noqa: E402

from mtpflow import bench
from mtpflow.backend import fusion  # noqa: E402
from mtpflow.engine import fusable_modules  # noqa: E402


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 12
    args, prompts, mlx, mtp = batch_one_engines(sys.argv[2] if len(sys.argv) > 2 else FIXTURE, "--fuse-ops", "on")
    models = fusable_modules(mtp.session.target, mtp.session.drafter)
    assert models and all(fusion.is_fused(m) for m in models)

    def run(v, stock: bool):
        # MLXLMVariant.run always runs mlx-lm's own modules; its _run runs the model as it is
        call = v.run if (stock or v is not mlx) else v._run
        with fusion.stock(*models) if stock else contextlib.nullcontext():
            t = time.perf_counter()
            n = call(prompts, args.max_tokens, bench.RoundCollector())["tokens"]
            return n / (time.perf_counter() - t)

    engines = {"mlx_lm stock": (mlx, True), "mlx_lm fused": (mlx, False),
               "mtpflow stock": (mtp, True), "mtpflow fused": (mtp, False)}
    for v, stock in engines.values():  # warm up (and trace the fused modules)
        run(v, stock)
    res = {k: [] for k in engines}
    for i in range(repeats):
        jobs = list(engines)
        random.Random(i).shuffle(jobs)
        for j in jobs:
            res[j].append(run(*engines[j]))
    base = res["mlx_lm stock"]
    for k, xs in res.items():
        paired = statistics.median(x / b for x, b in zip(xs, base))
        print(f"{k:14s} {statistics.median(xs):8.1f} tok/s  ratio of medians {statistics.median(xs) / statistics.median(base):.3f}"
              f"  paired median {paired:.3f}")
    loop = statistics.median(res["mtpflow fused"]) / statistics.median(res["mlx_lm fused"])
    print(f"round loop on the same fused modules: mtpflow / mlx_lm = {loop:.3f}")


if __name__ == "__main__":
    main()
