"""Multi-turn chat with and without the prefix cache: time to first token of turn 2.

    python scripts/bench_prefix_cache.py [--model smollm2-135m] [--draft-model smollm2-135m-mtp] \
        [--cache-mb 256] [--repeats 3] [--out ttft.json]

Turn 1 is a long user message (the first MT-Bench first turns joined) answered with 48 tokens; turn 2
re-sends that history plus a new question, as a chat client does.  Each setting loads its own session
(prefix cache off, then ``--cache-mb`` MiB), runs turn 1 once, then times turn 2's first token
``--repeats`` times (the first timed run of the cached session reads turn 1's stored K/V; later runs
also reuse turn 2's own).  Prints one JSON object: both settings' TTFTs, the speed-up of the medians,
and whether turn 2's first 8 tokens are the same with and without the cache.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft-model", default="smollm2-135m-mtp")
    ap.add_argument("--cache-mb", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args(argv)

    from mtpflow.backend.blas import ensure_fast_blas

    ensure_fast_blas()
    from mtpflow.bench import load_prompt_texts
    from mtpflow.config import load_config
    from mtpflow.engine import generate, generate_stream, load_session, make_request
    from mtpflow.logs import null_logger

    texts, _ = load_prompt_texts("mtbench")
    res: dict = {"model": args.model, "draft_model": args.draft_model}
    answers = {}
    for mb in (0, args.cache_mb):
        s = load_session(load_config(overrides={"model": {"model": args.model, "draft_model": args.draft_model},
                                                "batch": {"prefix_cache_mb": mb}}), log=null_logger())
        tok = s.tokenizer
        msgs = [{"role": "user", "content": " ".join(texts[:6])}]
        p1 = list(tok.apply_chat_template(msgs, add_generation_prompt=True))
        out1 = generate(s, p1, max_tokens=48).tokens
        msgs += [{"role": "assistant", "content": tok.decode(out1)}, {"role": "user", "content": texts[7]}]
        p2 = list(tok.apply_chat_template(msgs, add_generation_prompt=True))
        ttft = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            got = []
            for ev in generate_stream(s, [make_request(s, p2, max_tokens=8)]):
                if not got:
                    ttft.append(time.perf_counter() - t0)
                got.extend(ev.tokens)
            answers[mb] = got
        res["cache_mb_" + str(mb)] = {"turn1_prompt_tokens": len(p1), "turn2_prompt_tokens": len(p2),
                                      "ttft_s": [round(x, 3) for x in ttft],
                                      "prefix_cache": s.prefix_cache.describe() if s.prefix_cache else None}
    off, on = (statistics.median(res[f"cache_mb_{mb}"]["ttft_s"]) for mb in (0, args.cache_mb))
    res["speedup_median"] = round(off / on, 2)
    res["same_tokens"] = answers[0] == answers[args.cache_mb]
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0 if res["same_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
