"""What each target forward computes, path by path: the query / key lengths and the mask
every ``mx.fast.scaled_dot_product_attention`` call gets, the RoPE offsets' type, the dtypes
of every matmul's inputs, and (for mtpflow's rounds against its reference loop) whether the
logits of each step are bitwise equal.

    python scripts/trace_forward.py --model T --draft-model D [--dtype bfloat16] [--prompt-len 24] \
        [--max-tokens 8] [--profile cuda] [--json out.json]

Paths: ``engine b1`` / ``engine b4`` (mtpflow's rounds at block size 1), ``target_only_greedy``
(mtpflow's reference loop), ``mlx_lm`` (mlx-lm's ``generate_step`` on the same model object and
its own caches), ``verify_curve`` (the forward ``mtpflow bench`` times for its verify-cost curve,
2 tokens) and ``drafting round`` (a block-2 round's verify).  ``--profile cuda`` runs the CUDA
profile's tunings (no fused CPU fallbacks, bucketed shapes), so the ops are those a GPU runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
from collections import Counter
from pathlib import Path


def _mask_kind(mask) -> str:
    import mlx.core as mx

    if mask is None:
        return "None"
    if isinstance(mask, str):
        return repr(mask)
    if isinstance(mask, mx.array):
        return f"array {mask.dtype} {tuple(mask.shape)}"
    return type(mask).__name__


@contextlib.contextmanager
def recording():
    """Patch SDPA, RoPE, Linear and the tied head; yields the list of forwards, each
    ``{"tokens": shape, "sdpa": [...], "rope": Counter, "matmul": Counter}``."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models import gemma4_text

    forwards: list[dict] = []

    def cur():
        if not forwards:
            forwards.append({"tokens": None, "sdpa": [], "rope": Counter(), "matmul": Counter()})
        return forwards[-1]

    sdpa, rope = mx.fast.scaled_dot_product_attention, mx.fast.rope
    lin_call, as_linear, model_call = nn.Linear.__call__, nn.Embedding.as_linear, gemma4_text.Gemma4TextModel.__call__

    def sdpa_rec(q, k, v, *a, mask=None, **kw):
        cur()["sdpa"].append({"q": tuple(q.shape), "k": tuple(k.shape), "mask": _mask_kind(mask),
                              "dtype": f"{q.dtype}/{k.dtype}"})
        return sdpa(q, k, v, *a, mask=mask, **kw)

    def rope_rec(x, *a, offset=0, **kw):
        kind = f"array {tuple(offset.shape)} {offset.dtype}" if isinstance(offset, mx.array) else type(offset).__name__
        cur()["rope"][kind] += 1
        return rope(x, *a, offset=offset, **kw)

    def lin_rec(self, x):
        cur()["matmul"][f"{x.dtype} @ {self.weight.dtype}"] += 1
        return lin_call(self, x)

    def head_rec(self, x):
        cur()["matmul"][f"head {x.dtype} @ {self.weight.dtype}"] += 1
        return as_linear(self, x)

    def model_rec(self, inputs=None, *a, **kw):
        forwards.append({"tokens": None if inputs is None else tuple(inputs.shape), "sdpa": [], "rope": Counter(),
                         "matmul": Counter()})
        return model_call(self, inputs, *a, **kw)

    mx.fast.scaled_dot_product_attention, mx.fast.rope = sdpa_rec, rope_rec
    nn.Linear.__call__, nn.Embedding.as_linear, gemma4_text.Gemma4TextModel.__call__ = lin_rec, head_rec, model_rec
    try:
        yield forwards
    finally:
        mx.fast.scaled_dot_product_attention, mx.fast.rope = sdpa, rope
        nn.Linear.__call__, nn.Embedding.as_linear, gemma4_text.Gemma4TextModel.__call__ = lin_call, as_linear, model_call


def summarize(forwards: list[dict]) -> list[dict]:
    """One line per forward: tokens, per-layer ``mask | q len x key len``, RoPE offsets, matmul dtypes."""
    out = []
    for f in forwards:
        out.append({
            "tokens": f["tokens"],
            "sdpa": [f"{s['mask']} | q {s['q'][2]} k {s['k'][2]} | {s['dtype']}" for s in f["sdpa"]],
            "rope": dict(f["rope"]),
            "matmul": dict(f["matmul"]),
        })
    return out


@contextlib.contextmanager
def logits_log(target):
    """Every ``target.logits`` output, evaluated later (``[B, V]`` or ``[B, L, V]``)."""
    got = []
    orig = target.logits

    def rec(h):
        out = orig(h)
        got.append(out)
        return out

    target.logits = rec
    try:
        yield got
    finally:
        del target.logits


def step_logits(got) -> list:
    """Per decoding step, row 0's logits ``[V]`` (a forward's last position)."""
    return [g[0] if g.ndim == 2 else g[0, -1] for g in got]


def run(args) -> dict:
    import mlx.core as mx

    from mtpflow.config import load_config
    from mtpflow.engine import generate_stream, load_session, make_request, target_only_greedy
    from mtpflow.logs import null_logger

    gen = {}
    if args.profile == "cuda":
        gen = {"fuse_ops": "off", "submit_layers": "off", "bucket_shapes": "on"}
    s = load_session(load_config(overrides={
        "model": {"model": args.model, "draft_model": args.draft_model, "dtype": args.dtype},
        "draft": {"block_size": 1, "policy": "fixed"}, "batch": {"max_batch_size": 4}, "generation": gen,
    }), log=null_logger())
    t = s.target
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(4, t.vocab_size) for _ in range(args.prompt_len)] for _ in range(4)]
    n = args.max_tokens
    res: dict = {"dtype": s.dtype, "profile": args.profile, "paths": {}}

    def engine(batch, block):
        s.block_policy.size = block
        reqs = [make_request(s, p, max_tokens=n, request_id=str(i)) for i, p in enumerate(prompts[:batch])]
        for r in reqs:
            r.stop_ids = frozenset()
        toks = {r.id: [] for r in reqs}
        with recording() as fw, logits_log(t) as lg:
            for ev in generate_stream(s, reqs):
                toks[ev.request_id].extend(ev.tokens)
        return fw, lg, toks["0"]

    fw, lg_engine, tok_engine = engine(1, 1)
    res["paths"]["engine b1"] = summarize(fw[:3])
    fw, _, _ = engine(4, 1)
    res["paths"]["engine b4"] = summarize(fw[:3])
    with recording() as fw, logits_log(t) as lg_ref:
        tok_ref = target_only_greedy(t, prompts[0], n)
    res["paths"]["target_only_greedy"] = summarize(fw[:3])

    from mlx_lm.generate import generate_step

    with recording() as fw:
        tok_lm = [int(tk) for tk, _ in zip((x for x, _ in generate_step(mx.array(prompts[0]), t.model, max_tokens=n)), range(n))]
    res["paths"]["mlx_lm"] = summarize(fw[:3])

    from mtpflow.bench import verify_cost

    with recording() as fw:
        verify_cost(s, lengths=(2,), context=2 * args.prompt_len, repeats=1)
    res["paths"]["verify_curve"] = summarize([f for f in fw if f["tokens"] == (1, 2)][:1])
    fw, _, _ = engine(1, 2)
    res["paths"]["drafting round"] = summarize([f for f in fw if f["tokens"] == (1, 2)][:1])

    a, b = step_logits(lg_engine), step_logits(lg_ref)
    mx.eval(a, b)
    res["logits_bitwise"] = [bool(mx.array_equal(x, y).item()) for x, y in zip(a, b)]
    res["logits_max_abs"] = [float(mx.abs(x.astype(mx.float32) - y.astype(mx.float32)).max().item()) for x, y in zip(a, b)]
    res["tokens"] = {"engine b1": tok_engine, "target_only_greedy": tok_ref, "mlx_lm": tok_lm}
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--draft-model", required=True)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--prompt-len", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", default="cuda", choices=["cuda", "device"],
                   help="cuda: the CUDA profile's tunings; device: this device's own")
    p.add_argument("--json")
    args = p.parse_args(argv)
    res = run(args)
    text = json.dumps(res, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
