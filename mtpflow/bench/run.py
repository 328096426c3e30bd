"""``mtpflow bench``'s run: load, measure, report; and ``python -m mtpflow.bench``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .measure import VERIFY_CONTEXT, _measure, verify_cost
from .options import BenchError, _config, add_bench_arguments, apply_preset
from .plots import _plots
from .prompt_sets import encode_prompts, load_prompt_texts
from .report import ONE_REPEAT, _json_default, _meta, _results, format_table
from .variants import build_variants

#: the first line of the package's docstring: ``python -m mtpflow.bench --help``'s description
DESCRIPTION = "``mtpflow bench``: throughput of speculative decoding against plain mlx-lm."


def run_bench(args) -> int:
    from ..backend.blas import ensure_fast_blas

    blas = ensure_fast_blas()  # a no-op when mtpflow's CLI did it already
    started = time.perf_counter()
    args = apply_preset(args)
    if args.repeats < 1 or args.max_tokens < 1 or args.warmup < 0:
        raise BenchError("--repeats and --max-tokens must be >= 1, --warmup >= 0")
    if not args.no_plots:
        from .._extras import require

        require("bench", "matplotlib")

    texts, chat_set = load_prompt_texts(args.prompts)
    if args.num_prompts:
        texts = texts[: args.num_prompts]
    cfg = _config(args)
    session = _load_bench_session(cfg)
    tok = session.tokenizer
    chat = {"on": True, "off": False}.get(args.chat_template, chat_set)
    chat = bool(chat and tok is not None and getattr(tok, "chat_template", None))
    if args.chat_template == "on" and not chat:
        raise BenchError("--chat-template on: the target's tokenizer has no chat template")
    prompts = encode_prompts(tok, texts, chat)
    variants = build_variants(args, session, prompts)
    if not variants:
        raise BenchError("nothing to run (no drafter and both baselines disabled)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    acc, peaks, failed, warmed = _measure(args, variants, prompts)
    curve = verify_cost(session) if getattr(args, "verify_cost", False) else None
    results, baselines = _results(variants, acc, peaks, failed)
    result = {
        "meta": _meta(args, cfg, session, prompts, chat, blas, warmed),
        "baselines": {str(b): v.name for b, v in baselines.items()},
        "variants": results,
    }
    if curve is not None:
        result["verify_cost"] = {"context": VERIFY_CONTEXT, "batch": 1, "curve": curve}
    result["wall_s"] = round(time.perf_counter() - started, 3)
    ok = [d for d in results if "failed" not in d]
    result["plots"] = []
    (out / "bench.json").write_text(json.dumps(result, indent=2, default=_json_default))  # the figures first
    print(format_table(result), file=sys.stderr)
    if args.repeats == 1:  # (also in bench.json's meta)
        print(f"warning: {ONE_REPEAT}", file=sys.stderr)
    if not args.no_plots:
        result["plots"] = _plots({**result, "variants": ok}, out)
        (out / "bench.json").write_text(json.dumps(result, indent=2, default=_json_default))
    print(str(out / "bench.json"))
    return 0


def _load_bench_session(cfg):
    """The session the variants share; its load warnings go to stderr."""
    import warnings

    from ..logs import null_logger
    from ..session import load_session

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        session = load_session(cfg, log=null_logger())
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    return session


def main(argv: list[str] | None = None) -> int:  # ``python -m mtpflow.bench``
    from ..backend.blas import ensure_fast_blas

    ensure_fast_blas()
    p = argparse.ArgumentParser(prog="mtpflow bench", description=DESCRIPTION)
    add_bench_arguments(p)
    args = p.parse_args(argv)
    try:
        return run_bench(args)
    except BenchError as exc:
        print(f"mtpflow: error: {exc}", file=sys.stderr)
        return 2
