"""How often greedy speculative tokens equal target-only tokens, over N prompts, in one dtype:
mtpflow (each block size, batch 1 and batch B) against its own target-only decoding, and
mlx-vlm's speculative decoding against mlx-vlm's own target-only decoding on the same
checkpoints where mlx-vlm loads them.

    python scripts/lowp_equality.py --model T --draft-model D [--dtype bfloat16] [--prompts 8] \
        [--prompt-len 24] [--max-tokens 48] [--block-sizes 3,5] [--batch 4] [--no-mlx-vlm] [--paths now] [--out eq.json]

Prompts are random token ids (seeded), so any checkpoint works without a tokenizer.  A
mismatch is reported with the first position where the two token lists differ: on a GPU, a
verify of k tokens runs other kernels than k one-token steps (docs/benchmarks.md,
"Accelerators"), and in bf16 their rounding can move a near-tie argmax.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path


def first_diff(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def use_paths(which: str):
    """``"now"``: mtpflow's attention calls as mlx-lm's loop makes them; ``"before"``: as they
    were before (a dense sliding layer's multi-token forward with an array mask, the whole prompt
    in one forward, the reference loop with array masks on every step).  Returns the reference
    decoding function to use."""
    from mtpflow.engine import target_only_greedy
    from mtpflow.targets.base import TargetAdapter
    from mtpflow.targets.cache import SlotKVCache

    SlotKVCache.causal_in_window = TargetAdapter.prefill_last_alone = which == "now"
    if which == "now":
        return target_only_greedy

    def reference_before(target, prompt, max_tokens, stop_ids=()):
        import mlx.core as mx

        cache = target.make_cache()  # never marked dense: array masks on every forward
        target.set_offsets(cache, mx.array([0], dtype=mx.int32))
        h = target.forward(mx.array([prompt], dtype=mx.int32), cache)
        out = []
        while len(out) < max_tokens:
            tok = int(mx.argmax(target.logits(h[:, -1]), axis=-1).item())
            if tok in stop_ids:
                break
            out.append(tok)
            h = target.forward(mx.array([[tok]], dtype=mx.int32), cache)
        return out

    return reference_before


def mtpflow_counts(args, prompts) -> dict:
    from mtpflow.config import load_config
    from mtpflow.engine import generate_stream, load_session, make_request
    from mtpflow.logs import null_logger

    target_only_greedy = use_paths(args.paths)

    s = load_session(load_config(overrides={
        "model": {"model": args.model, "draft_model": args.draft_model, "dtype": args.dtype},
        "draft": {"block_size": max(args.block_sizes), "policy": "fixed"},
        "batch": {"max_batch_size": args.batch},
        "generation": {"bucket_shapes": args.bucket_shapes},
    }), log=null_logger())
    refs = [target_only_greedy(s.target, p, args.max_tokens) for p in prompts]
    out = {"dtype": s.dtype, "paths": args.paths, "runs": [], "target_only_vs_mlx_lm": mlx_lm_counts(s, prompts, refs, args)}
    for k in args.block_sizes:
        s.block_policy.size = k
        for batch in sorted({1, args.batch}):
            same, diffs = 0, []
            for g in range(0, len(prompts), batch):
                reqs = [make_request(s, p, max_tokens=args.max_tokens, request_id=str(g + i))
                        for i, p in enumerate(prompts[g : g + batch])]
                for r in reqs:
                    r.stop_ids = frozenset()
                toks = {r.id: [] for r in reqs}
                for ev in generate_stream(s, reqs):
                    toks[ev.request_id].extend(ev.tokens)
                for r in reqs:
                    i = int(r.id)
                    d = first_diff(toks[r.id], refs[i])
                    same += d is None
                    if d is not None:
                        diffs.append({"prompt": i, "first_diff": d})
            out["runs"].append({"block_size": k, "batch": batch, "equal": same, "of": len(prompts), "diffs": diffs})
    return out


def mlx_lm_counts(s, prompts, refs, args) -> dict:
    """mtpflow's target-only tokens against mlx-lm's ``generate_step`` on the same model object
    (its own caches, masks and greedy pick): equal where both run the same kernels."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    same, diffs = 0, []
    for i, (p, ref) in enumerate(zip(prompts, refs)):
        steps = generate_step(mx.array(p), s.target.model, max_tokens=args.max_tokens)
        toks = [int(t) for t, _ in zip((t for t, _ in steps), range(args.max_tokens))]
        d = first_diff(toks, ref)
        same += d is None
        if d is not None:
            diffs.append({"prompt": i, "first_diff": d})
    return {"equal": same, "of": len(prompts), "diffs": diffs}


def mlx_vlm_counts(args, prompts) -> dict:
    try:
        import mlx.core as mx
        from mlx_vlm import load
        from mlx_vlm.speculative.drafters import load_drafter

        model, processor = load(args.model)
        drafter, kind = load_drafter(args.draft_model)
    except Exception as exc:  # not a layout or a pair mlx-vlm loads
        return {"unavailable": f"{type(exc).__name__}: {exc}"[:300]}
    try:
        from mlx_vlm.generate import stream_generate
    except ImportError as exc:
        return {"unavailable": str(exc)}
    if args.dtype:
        model.set_dtype(getattr(mx, args.dtype))
        drafter.set_dtype(getattr(mx, args.dtype))

    tok = getattr(processor, "tokenizer", processor)

    def run(p, **kw):  # mlx-vlm takes text: the prompt ids decoded (the same text for both of its runs)
        toks = []
        for r in stream_generate(model, processor, tok.decode(p), max_tokens=args.max_tokens, temperature=0.0, **kw):
            toks.append(int(r.token))
        return toks[: args.max_tokens]

    out = {"runs": []}
    try:
        refs = [run(p) for p in prompts]
        for k in [k for k in args.block_sizes if k >= 2]:  # mlx-vlm's block counts the bonus: 1 drafts nothing
            same, diffs = 0, []
            for i, p in enumerate(prompts):
                d = first_diff(run(p, draft_model=drafter, draft_kind=kind, draft_block_size=k), refs[i])
                same += d is None
                if d is not None:
                    diffs.append({"prompt": i, "first_diff": d})
            out["runs"].append({"block_size": k, "batch": 1, "equal": same, "of": len(prompts), "diffs": diffs})
    except Exception as exc:
        out["failed"] = f"{type(exc).__name__}: {exc}"[:300]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--draft-model", required=True)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--block-sizes", default="3,5")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-mlx-vlm", action="store_true")
    p.add_argument("--bucket-shapes", default="auto", choices=["auto", "on", "off"],
                   help="[generation] bucket_shapes for mtpflow's verifies (auto: the device's profile)")
    p.add_argument("--paths", default="now", choices=["now", "before"],
                   help="mtpflow's attention masks and prefill chunks as now (mlx-lm's) or as before (array masks, "
                        "the whole prompt in one forward)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    args.block_sizes = [int(x) for x in args.block_sizes.split(",")]
    from mtpflow.backend.blas import ensure_fast_blas

    ensure_fast_blas()
    vocab = json.loads((Path(args.model) / "config.json").read_text())
    vocab = (vocab.get("text_config") or vocab)["vocab_size"]
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(4, vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    import mlx.core as mx

    res = {"device": str(mx.default_device()), "dtype": args.dtype, "prompts": args.prompts,
           "max_tokens": args.max_tokens, "mtpflow": mtpflow_counts(args, prompts)}
    if not args.no_mlx_vlm:
        res["mlx_vlm"] = mlx_vlm_counts(args, prompts)
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
