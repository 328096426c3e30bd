#!/usr/bin/env python3
"""Speculative decoding of an image prompt: mtpflow against mlx-vlm's own, same target, drafter,
image, prompt and block size (greedy, EOS ignored so both emit --max-tokens).

    python scripts/bench_multimodal.py --model M --draft-model D --image IMG --prompt "..." \
        [--block-size 5] [--max-tokens 64] [--repeats 5] [--out bench-mm.json]

With no --model it runs on the test fixture (tests/fixtures/gemma4_vision on pair_e's language
model, pair_e's assistant).  Prints one JSON object: both runs' tokens/s (median over repeats,
warm-up excluded; prefill and the vision tower included, as each library's generate call does
them), whether the tokens are the same, and the ratio mtpflow / mlx-vlm.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--draft-model")
    ap.add_argument("--image", action="append", default=[])
    ap.add_argument("--prompt")
    ap.add_argument("--block-size", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args(argv)

    from mtpflow.backend.blas import ensure_fast_blas

    ensure_fast_blas()
    if args.model is None:
        sys.path.insert(0, str(ROOT / "tests"))
        import mm_fixture as F

        args.model = str(F.build(Path(tempfile.mkdtemp()) / "gemma4_vision"))
        args.draft_model = args.draft_model or str(F.drafter())
        args.image = args.image or [F.image("gradient.png")]
        args.prompt = args.prompt or F.reference()["gradient"]["prompt"]

    from mlx_vlm import generate as vlm_generate
    from mlx_vlm import load as vlm_load
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.speculative.drafters import load_drafter
    from mlx_vlm.utils import load_config as vlm_config

    from mtpflow.config import load_config
    from mtpflow.engine import generate_stream, load_session, make_request
    from mtpflow.logs import null_logger
    from mtpflow.media import encode_prompt_with_media

    n = args.max_tokens
    session = load_session(load_config(overrides={
        "model": {"model": args.model, "draft_model": args.draft_model},
        "draft": {"block_size": args.block_size, "policy": "fixed"}, "generation": {"max_tokens": n},
    }), log=null_logger())
    ids, media = encode_prompt_with_media(session, args.prompt, args.image)

    def ours():
        r = make_request(session, ids, max_tokens=n)
        r.media = media
        r.stop_ids = frozenset()
        out = []
        session.reset_stats()
        t = time.perf_counter()
        for ev in generate_stream(session, [r]):
            out.extend(ev.tokens)
        return out, time.perf_counter() - t, session.stats.as_dict().get("tau")

    model, processor = vlm_load(args.model)
    drafter, kind = load_drafter(args.draft_model)
    prompt = apply_chat_template(processor, vlm_config(args.model), args.prompt, num_images=len(args.image))
    tok = processor.tokenizer

    def theirs():
        t = time.perf_counter()
        res = vlm_generate(model, processor, prompt, image=args.image, max_tokens=n, temperature=0.0, verbose=False,
                           draft_model=drafter, draft_kind=kind, draft_block_size=args.block_size, eos_tokens=["<never>"])
        return res.text, time.perf_counter() - t

    ours()
    theirs()  # warm-up
    a, b, taus = [], [], []
    for _ in range(args.repeats):  # interleaved
        toks, dt, tau = ours()
        a.append(len(toks) / dt)
        taus.append(tau)
        text, dt = theirs()
        b.append(n / dt)
    same = text == tok.decode(toks)
    res = {
        "model": args.model, "draft_model": args.draft_model, "images": args.image, "prompt_tokens": len(ids),
        "block_size": args.block_size, "max_tokens": n, "repeats": args.repeats,
        "mtpflow": {"tokens_per_s": round(statistics.median(a), 2), "tau": taus[-1], "tokens": len(toks)},
        "mlx_vlm": {"tokens_per_s": round(statistics.median(b), 2), "draft_kind": kind},
        "same_tokens": same, "ratio": round(statistics.median(a) / statistics.median(b), 3),
    }
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
