"""Which draft shapes the adaptive policy runs with ``tree = "auto"`` at batch 1, 4 and 8.

    python scripts/bench_tree_policy.py [--model smollm2-135m] [--draft-model smollm2-135m-mtp] \
        [--num-prompts 8] [--max-tokens 48] [--out tree_policy.json]

MT-Bench first turns (chat template), EOS ignored, greedy.  Prints, per batch size, the rounds,
how many ran each chain block size or tree shape, and τ.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path


class _Shapes:
    """An ``mtpflow_emit`` observer counting each round's chain size or tree shape."""

    def __init__(self):
        self.seen = collections.Counter()

    from mtpflow import hookimpl as _hookimpl

    @_hookimpl
    def mtpflow_emit(self, session, record, emitted):
        self.seen[record.tree or f"chain{record.block_size}"] += 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft-model", default="smollm2-135m-mtp")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out")
    args = ap.parse_args(argv)

    from mtpflow.backend.blas import ensure_fast_blas

    ensure_fast_blas()
    from mtpflow.bench import load_prompt_texts
    from mtpflow.config import load_config
    from mtpflow.engine import encode_prompt, generate_stream, load_session, make_request
    from mtpflow.logs import null_logger
    from mtpflow.plugins import make_plugin_manager

    texts, _ = load_prompt_texts("mtbench")
    out = {}
    for B in (1, 4, 8):
        shapes = _Shapes()
        s = load_session(load_config(overrides={
            "model": {"model": args.model, "draft_model": args.draft_model},
            "draft": {"policy": "adaptive", "block_size": 4, "tree": "auto"}, "batch": {"max_batch_size": B},
        }), plugins=make_plugin_manager([shapes]), log=null_logger())
        prompts = [encode_prompt(s.tokenizer, t, True) for t in texts[: args.num_prompts]]
        t0 = time.perf_counter()
        for g in range(0, len(prompts), B):
            reqs = [make_request(s, p, max_tokens=args.max_tokens, request_id=f"{g}-{i}") for i, p in enumerate(prompts[g:g + B])]
            for r in reqs:
                r.stop_ids = frozenset()
            for _ in generate_stream(s, reqs):
                pass
        out[B] = {"rounds": sum(shapes.seen.values()), "shapes": dict(shapes.seen.most_common()),
                  "tau": s.stats.as_dict()["tau"], "wall_s": round(time.perf_counter() - t0, 1)}
        print(B, json.dumps(out[B]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
