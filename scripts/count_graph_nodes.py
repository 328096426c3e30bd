"""How many graph nodes one decoding step of a target submits, on mlx-lm's own modules and on
mtpflow's fused ones (:mod:`mtpflow.backend.fusion`).

    python scripts/count_graph_nodes.py [--model smollm2-135m] [--tokens 1,2,3] [--context 30] [--kinds]

The step is the target's forward over ``n`` new tokens on a cache of ``--context`` tokens plus
its LM head, as a chain verify (``n`` = 1: a step of the null path) builds it; the count is of
the lazy graph ``mx.export_to_dot`` writes for the logits, before they are evaluated.  On a CPU
the thread that submits a graph pays a few microseconds per node (docs/benchmarks.md, "What
limits speed on this CPU"), so this is the figure the fused modules cut.  ``--kinds`` also lists
the fused graph's nodes by kind, most frequent first.
"""

from __future__ import annotations

import argparse
import collections
import io
import re


def labels(out) -> list[str]:
    import mlx.core as mx

    f = io.StringIO()
    mx.export_to_dot(f, out)
    return re.findall(r'label\s*=\s*"([A-Za-z_]+)', f.getvalue())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tokens", default="1,2,3")
    p.add_argument("--context", type=int, default=30)
    p.add_argument("--kinds", action="store_true", help="list the fused graph's nodes by kind")
    args = p.parse_args(argv)
    try:
        sizes = [int(x) for x in args.tokens.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1 or args.context < 1:
        p.error("--tokens: comma-separated sizes >= 1, e.g. 1,2,3; --context >= 1")

    from mtpflow.backend.blas import ensure_fast_blas

    ensure_fast_blas()
    import mlx.core as mx

    from mtpflow.backend import fusion
    from mtpflow.config import load_config
    from mtpflow.engine import load_session, resolve_model

    cfg = load_config(overrides={"model": {"model": str(resolve_model(args.model))}, "generation": {"fuse_ops": "on"}})
    target = load_session(cfg, load_tokenizer=False).target
    cache, _ = target.prefill([list(range(10, 10 + args.context))])
    mx.eval([c.keys for c in cache] + [c.values for c in cache])
    saved = [(c.idx, c.dense) for c in cache]
    start = mx.array([args.context], dtype=mx.int32)

    def step(n: int) -> list[str]:
        for _ in range(2):  # the first call of a size computes what the fused modules keep
            for c, (idx, dense) in zip(cache, saved):
                c.idx, c.dense = idx, dense
            target.set_offsets(cache, start)
            hidden, _ = target.forward_with_taps(mx.array([list(range(7, 7 + n))], dtype=mx.int32), cache)
            out = target.logits(hidden)
            got = labels(out)
            mx.eval(out)
        return got

    with fusion.stock(target.model):
        stock = {n: len(step(n)) for n in sizes}
    fused = {n: step(n) for n in sizes}
    print(f"{args.model}: graph nodes of a forward + LM head over n tokens (context {args.context})")
    print("     n     stock     fused")
    for n in sizes:
        print(f"  {n:4d}  {stock[n]:8d}  {len(fused[n]):8d}")
    if args.kinds:
        for n in sizes:
            kinds = collections.Counter(fused[n]).most_common()
            print(f"  n = {n}: " + ", ".join(f"{k} {c}" for k, c in kinds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
