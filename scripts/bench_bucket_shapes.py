"""Cold and warm time of a ragged run with verify-shape bucketing off and on.

One process per mode (MLX's kernel caches live in the process): a run of
block sizes 2..7, a 2,2,1 tree and batches of 1 and 3 rows (rows leave as
they finish) on a fixture pair, timed cold (every new shape compiles) and
again warm; with bucketing on, the warm-up (:func:`mtpflow.backend.shapes.warm_up`)
runs first and is timed on its own.  Also the cost of padding 3 cache rows
to 4 and cutting them back, against a 3-row verify.  Tokens are checked
against target-only.  Prints one JSON line per mode.

    PYTHONPATH=$PWD python scripts/bench_bucket_shapes.py [--pair e]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

FIX = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "hf_gemma4"


def _session(pair, mode, block, tree="off"):
    from mtpflow.config import load_config
    from mtpflow.engine import load_session
    from mtpflow.logs import null_logger

    ov = {"model": {"model": str(FIX / f"pair_{pair}" / "target"), "draft_model": str(FIX / f"pair_{pair}" / "drafter")},
          "draft": {"block_size": block, "policy": "fixed", "tree": tree}, "generation": {"bucket_shapes": mode},
          "batch": {"max_batch_size": 3}}
    return load_session(load_config(overrides=ov), log=null_logger())


def _runs(pair, mode):
    """The sessions and batches of one pass: (session, prompts, max_tokens)."""
    prompts = [json.loads((FIX / f"pair_{pair}" / f"generate_{n}.json").read_text())["prompt_ids"] for n in ("long", "short", "edge")]
    out = []
    for k in range(2, 8):
        batch = 3 if k in (3, 6) else 1
        out.append((_session(pair, mode, k), prompts[:batch], [24, 16, 16][:batch]))
    out.append((_session(pair, mode, 4, "2,2,1"), prompts, [20, 12, 16]))
    return out


def _pass(runs, check):
    from mtpflow.engine import generate_stream, make_request, target_only_greedy

    t0 = time.perf_counter()
    bad = 0
    for s, ps, ms in runs:
        reqs = [make_request(s, p, max_tokens=m, request_id=str(i)) for i, (p, m) in enumerate(zip(ps, ms))]
        got = {r.id: [] for r in reqs}
        for ev in generate_stream(s, reqs):
            got[ev.request_id].extend(ev.tokens)
        if check:
            bad += sum(got[r.id] != target_only_greedy(s.target, r.prompt, r.max_tokens, s.target.eos_ids) for r in reqs)
    return time.perf_counter() - t0, bad


def _row_copy(s):
    import mlx.core as mx

    from mtpflow.backend.shapes import _cut_rows, _pad_rows

    cache, _ = s.target.prefill([list(range(5, 405))] * 3, extra=16)
    mx.eval([c.state for c in cache])
    toks = mx.zeros((3, 4), mx.int32)

    def copy():
        _pad_rows(cache, 4)
        _cut_rows(cache, 3)
        mx.eval([c.keys for c in cache] + [c.values for c in cache] + [c.positions for c in cache])

    def verify():
        s.target.set_offsets(cache, mx.full((3,), 400, mx.int32))
        h, _ = s.target.forward_with_taps(toks, cache, ())
        mx.eval(s.target.logits(h))
        for c in cache:
            c.trim(4)

    def med(f, k=21):
        f()
        ts = []
        for _ in range(k):
            a = time.perf_counter()
            f()
            ts.append(time.perf_counter() - a)
        return round(sorted(ts)[k // 2] * 1e3, 3)

    return {"row_pad_cut_ms": med(copy), "verify_3x4_ms": med(verify)}


def one(pair, mode):
    import mlx.core as mx

    from mtpflow.backend.shapes import warm_up

    runs = _runs(pair, mode)
    t0 = time.perf_counter()
    warmed: set = set()
    for s, _, _ in runs:
        warmed = warm_up(s, 3, warmed)
    warm_s = time.perf_counter() - t0
    cold, bad = _pass(runs, True)
    warm, _ = _pass(runs, False)
    res = {"mode": mode, "device": str(mx.default_device()), "warm_up_s": round(warm_s, 2), "warmed": len(warmed),
           "cold_pass_s": round(cold, 2), "warm_pass_s": round(warm, 2),
           "mismatched_requests": bad, **_row_copy(runs[0][0])}
    print(json.dumps(res), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pair", default="e")
    p.add_argument("--mode", choices=["on", "off"])
    a = p.parse_args()
    if a.mode:
        return one(a.pair, a.mode)
    for mode in ("off", "on"):
        subprocess.run([sys.executable, __file__, "--pair", a.pair, "--mode", mode], check=True)


if __name__ == "__main__":
    main()
