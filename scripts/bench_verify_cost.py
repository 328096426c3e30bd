"""What one verify forward costs by the number of tokens it verifies (and one matmul by its rows).

    python scripts/bench_verify_cost.py [--model smollm2-135m] [--tokens 1,2,3,5,8,11,13,15,16,17,24,32] \
        [--repeats 8] [--context 200] [--tree] [--matmul 576x1536]

The target's forward plus its LM head over ``n`` new tokens on a cache of ``--context`` tokens,
as a chain verify runs it (``--tree``: as a tree verify, with per-node RoPE positions and the
tree mask, over a tree whose node ``i`` hangs from node ``(i - 1) // 2``), the sizes interleaved
within each repeat (so the host's drift hits them alike), after one untimed pass; each timed call
first rolls the cache back to the context (host bookkeeping only, as a round's own rollback is).  With ``--matmul KxN`` it times ``x @ W.T`` for ``x [M, K]``, ``W [N, K]``
instead, M = each of ``--tokens`` (the rows one product of a verify gets at batch 1); that weight
stays in the CPU's cache, where a forward streams its weights from memory.  Prints the median
milliseconds and the ratio to the first size.  On the CPU with OpenBLAS the cost is not monotone
in the row count (docs/benchmarks.md, "Chains and trees"); this is how to see it on a machine.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tokens", default="1,2,3,5,8,11,13,15,16,17,24,32")
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--tree", action="store_true", help="time a tree verify (tree mask, per-node positions)")
    p.add_argument("--matmul", default=None, help="KxN: time one matmul by rows instead of the model")
    args = p.parse_args(argv)
    try:
        sizes = [int(x) for x in args.tokens.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        p.error("--tokens: a comma-separated list of sizes >= 1, e.g. 1,5,16")
    if args.repeats < 1 or args.context < 1:
        p.error("--repeats and --context must be >= 1")

    from mtpflow.backend.blas import ensure_fast_blas

    ensure_fast_blas()
    import mlx.core as mx

    times: dict[int, list[float]] = {n: [] for n in sizes}
    if args.matmul:
        try:
            k, n_out = (int(v) for v in args.matmul.lower().split("x"))
        except ValueError:
            k = n_out = 0
        if k < 1 or n_out < 1:
            p.error("--matmul: KxN with K, N >= 1, e.g. 576x1536")
        w = mx.random.normal((n_out, k))
        xs = {m: mx.random.normal((m, k)) for m in sizes}
        mx.eval(w, *xs.values())
        for m in sizes:  # untimed
            mx.eval(xs[m] @ w.T)
        for _ in range(args.repeats):
            for m in sizes:
                t = time.perf_counter()
                mx.eval(xs[m] @ w.T)
                times[m].append(time.perf_counter() - t)
        what = f"x[M, {k}] @ W[{n_out}, {k}].T, M ="
    else:
        from mtpflow.config import load_config
        from mtpflow.engine import load_session, resolve_model

        cfg = load_config(overrides={"model": {"model": str(resolve_model(args.model))}})
        target = load_session(cfg, load_tokenizer=False).target  # the target alone, as mtpflow runs it
        from mtpflow.sampling import tree_visibility

        cache, _ = target.prefill([list(range(100, 100 + args.context))])
        mx.eval([c.keys for c in cache] + [c.values for c in cache])
        # the slots are written in place: rolling back is resetting the slot count and offsets
        saved = [(c.idx, c.dense and not args.tree) for c in cache]
        start = mx.array([args.context], dtype=mx.int32)

        def verify(n):
            for c, (idx, dense) in zip(cache, saved):
                c.idx, c.dense = idx, dense  # a tree verify leaves the cache sparse (as its keep does)
            target.set_offsets(cache, start)
            tokens = mx.array([list(range(7, 7 + n))], dtype=mx.int32)
            if args.tree:
                parents = mx.array([[-1] + [(i - 1) // 2 for i in range(1, n)]], dtype=mx.int32)
                depth = [0]
                for i in range(1, n):
                    depth.append(depth[(i - 1) // 2] + 1)
                visible = tree_visibility(parents, max(depth))
                hidden, _ = target.forward_tree(tokens, cache, start[:, None] + mx.array([depth], dtype=mx.int32), visible)
            else:
                hidden, _ = target.forward_with_taps(tokens, cache)
            mx.eval(target.logits(hidden))

        verify(max(sizes))  # untimed: grows the cache to its largest size once, outside the timings
        for n in sizes:
            verify(n)
        for _ in range(args.repeats):
            for n in sizes:
                t = time.perf_counter()
                verify(n)
                times[n].append(time.perf_counter() - t)
        what = (f"{args.model}: {'tree' if args.tree else 'chain'} verify, forward + LM head over n tokens "
                f"(context {args.context}), n =")
    base = statistics.median(times[sizes[0]])
    print(what)
    for n in sizes:
        m = statistics.median(times[n])
        print(f"  {n:4d}  {m * 1e3:9.3f} ms  x{m / base:5.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
