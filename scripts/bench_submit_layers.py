"""mlx-lm against mtpflow's null path with ``submit_layers`` on and off, the three
interleaved in one process in shuffled order (one shared model), so a noisy host
drifts the same way for all three.

    python scripts/bench_submit_layers.py [REPEATS] [TARGET] [BENCH FLAGS...]

Prints each engine's median tokens/s, the ratio of medians to mlx-lm and the
paired median ratio (docs/benchmarks.md, "What limits speed on this CPU").  mlx-lm runs its own modules; mtpflow
runs with the bench's defaults (fused modules on a CPU device: ``--fuse-ops off``
after TARGET compares the two loops on the same modules, as in (r) and (s)).
"""

import argparse
import random
import statistics
import sys
import time

from mtpflow.backend.blas import ensure_fast_blas

ensure_fast_blas()

import attrs  # noqa: E402

from mtpflow import bench  # noqa: E402
from mtpflow.engine import load_session  # noqa: E402
from mtpflow.logs import null_logger  # noqa: E402

FIXTURE = "tests/fixtures/hf_gemma4/pair_e/target"


def batch_one_engines(target: str, *flags: str):
    """``(args, prompts, mlx_lm b1, mtpflow-null b1)`` on ``target``: the tiny prompts, 64 tokens
    (scripts/bench_host_cost.py uses them too)."""
    p = argparse.ArgumentParser()
    bench.add_bench_arguments(p)
    args = p.parse_args(["--target", target, "--block-sizes", "1", "--batch-sizes", "1", "--max-tokens", "64",
                         "--prompts", "tiny", "--no-plots", *flags])
    session = load_session(bench._config(args), log=null_logger())
    texts, _ = bench.load_prompt_texts(args.prompts)
    prompts = bench.encode_prompts(session.tokenizer, texts, False)
    mlx, mtp = bench.build_variants(args, session, prompts)
    return args, prompts, mlx, mtp


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    args, prompts, mlx, mtp = batch_one_engines(sys.argv[2] if len(sys.argv) > 2 else FIXTURE, *sys.argv[3:])

    def null_path(mode):  # the null variant's session with [generation] submit_layers = mode
        cfg = mtp.session.config
        s = attrs.evolve(mtp.session, config=attrs.evolve(cfg, generation=attrs.evolve(cfg.generation, submit_layers=mode)))
        return bench.MTPFlowVariant(f"mtpflow {mode}", 1, 1, mtp.kind, s, mtp.ignore_eos)

    engines = {"mlx_lm": mlx, "mtpflow on": null_path("on"), "mtpflow off": null_path("off")}

    def run(v):
        t = time.perf_counter()
        n = v.run(prompts, args.max_tokens, bench.RoundCollector())["tokens"]
        return n / (time.perf_counter() - t)

    for v in engines.values():  # warm up
        run(v)
    res = {k: [] for k in engines}
    for i in range(repeats):
        jobs = list(engines)
        random.Random(i).shuffle(jobs)
        for j in jobs:
            res[j].append(run(engines[j]))
    base = res["mlx_lm"]
    for k, xs in res.items():
        paired = statistics.median(x / b for x, b in zip(xs, base))
        print(f"{k:12s} {statistics.median(xs):8.1f} tok/s  ratio of medians {statistics.median(xs) / statistics.median(base):.3f}"
              f"  paired median {paired:.3f}")


if __name__ == "__main__":
    main()
