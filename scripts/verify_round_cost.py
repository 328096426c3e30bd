"""Where a drafting round's verify time goes: the same target forward (``K`` tokens plus the LM
head, batch 1) timed three ways, each with one ``mx.eval`` boundary, medians over alternated
repeats.

* ``same context``: on one cache of ``C`` tokens, the new slots trimmed after each call, so every
  call sees the same key length (what ``mtpflow bench``'s verify-cost curve times);
* ``growing context``: the cache grows by one token per call, so every call sees a key length
  it has not seen before, as consecutive decoding rounds do;
* ``round``: the verify stage of real drafting rounds (``[trace] sync_timing``: the draft is
  evaluated first, so ``verify_s`` holds the verify forward, the acceptance and the sync).

    python scripts/verify_round_cost.py --model T --draft-model D [--block 2] [--context 128] \
        [--repeats 20] [--dtype bfloat16] [--json out.json]

On a GPU whose attention library plans a kernel per key length (cuDNN's SDPA graphs are cached
by shape), ``growing context`` costs more than ``same context``; on a CPU they cost the same.
``MLX_CUDA_USE_CUDNN_SDPA=0`` turns MLX's cuDNN attention off, to tell the two apart.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


class _Rounds:
    """Keeps every round record (an ``mtpflow_emit`` observer)."""

    def __init__(self):
        self.records = []

    from mtpflow import hookimpl as _hookimpl

    @_hookimpl
    def mtpflow_emit(self, session, record, emitted):
        self.records.append(record)


def forward_times(t, k: int, context: int, repeats: int) -> dict:
    """Milliseconds (median) of a ``k``-token forward plus the head at a fixed and a growing context."""
    import mlx.core as mx

    V = t.vocab_size
    ids = [(7 * i + 3) % V for i in range(context + 2 * repeats + 8)]
    tokens = mx.array([[(11 * i + 5) % V for i in range(k)]], dtype=mx.int32)

    def prefill(n):
        cache, _ = t.prefill([ids[:n]], extra=k + 8)
        mx.eval([c.state for c in cache])
        return cache

    def once(cache, pos, trim):
        t.set_offsets(cache, mx.array([pos], dtype=mx.int32))
        t0 = time.perf_counter()
        h, _ = t.forward_with_taps(tokens, cache, ())
        mx.eval(t.logits(h))
        dt = time.perf_counter() - t0
        for c in cache:
            c.trim(trim)
        return dt

    same, grow = prefill(context), prefill(context)
    once(same, context, k)  # warm the shape
    once(grow, context, k - 1)
    pos = context + 1
    a, b = [], []
    for _ in range(repeats):
        a.append(once(same, context, k))
        b.append(once(grow, pos, k - 1))  # keeps one of the new slots: the next call sees one key more
        pos += 1
    return {"same_context_ms": round(1e3 * statistics.median(a), 3),
            "growing_context_ms": round(1e3 * statistics.median(b), 3)}


def round_times(args) -> dict:
    from mtpflow.config import load_config
    from mtpflow.engine import generate_stream, load_session, make_request
    from mtpflow.logs import null_logger

    rounds = _Rounds()
    s = load_session(load_config(overrides={
        "model": {"model": args.model, "draft_model": args.draft_model, "dtype": args.dtype},
        "draft": {"block_size": args.block, "policy": "fixed"}, "trace": {"sync_timing": True},
    }), log=null_logger(), extra_plugins=[rounds])
    V = s.target.vocab_size

    def run(block):
        s.block_policy.size = block
        rounds.records.clear()
        req = make_request(s, [(13 * i + 1) % V for i in range(args.context)], max_tokens=args.repeats + 2, request_id="0")
        req.stop_ids = frozenset()
        for _ in generate_stream(s, [req]):
            pass
        return [r for r in rounds.records if r.drafted == block - 1][1:]  # the first round warms its shapes

    run(args.block)  # warm-up pass
    null, spec = run(1), run(args.block)
    med = lambda rs, f: round(1e3 * statistics.median([getattr(r, f) for r in rs]), 3) if rs else None  # noqa: E731
    return {"round_verify_ms": med(spec, "verify_s"), "round_draft_ms": med(spec, "draft_s"),
            "null_round_verify_ms": med(null, "verify_s"), "rounds": len(spec),
            "accepted_per_round": round(statistics.mean(sum(r.accepted) for r in spec), 3) if spec else None,
            "session": s}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--draft-model", required=True)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--block", type=int, default=2, help="the drafting rounds' block size (verify of this many tokens)")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json")
    args = p.parse_args(argv)
    from mtpflow.backend.blas import ensure_fast_blas

    ensure_fast_blas()
    import mlx.core as mx

    res = round_times(args)
    s = res.pop("session")
    res.update(forward_times(s.target, args.block, args.context, args.repeats))
    res = {"device": str(mx.default_device()), "dtype": s.dtype, "block": args.block, "context": args.context,
           "cudnn_sdpa": os.environ.get("MLX_CUDA_USE_CUDNN_SDPA", "default"), **res}
    text = json.dumps(res, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
