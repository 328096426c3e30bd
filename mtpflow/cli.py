"""The ``mtpflow`` command line.

Nothing at module level imports mlx: OpenBLAS has to be loaded first
(:func:`mtpflow._blas.ensure_fast_blas`), so every heavy import happens inside
the command functions.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path


class CLIError(Exception):
    pass


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="target: local folder or Hugging Face repo id (default: the built-in pair, smollm2-135m + smollm2-135m-mtp); also a packaged name: smollm2-135m, gemma3-270m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b")
    p.add_argument("--draft-model", help="drafter: local folder or Hugging Face repo id")
    p.add_argument("--draft-kind", help="drafter kind (detected from the drafter's config.json when omitted)")
    p.add_argument("--draft-block-size", type=int, help="tokens verified per round: drafts + 1")
    p.add_argument("--config", help="TOML config file (flags override it)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="weights dtype (default float32)")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="mtpflow", description="Multi-token-prediction speculative decoding on MLX.")
    parser.add_argument("--version", action="version", version=f"mtpflow {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text (speculative when a drafter is given)")
    _add_model_args(g)
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", "-p", help="prompt text ('-' reads stdin)")
    src.add_argument("--prompts-file", help="file with one prompt per line (decoded as one batch)")
    g.add_argument("--prompt-ids", help="comma-separated prompt token ids instead of text")
    g.add_argument("--max-tokens", "-m", type=int, help="tokens to generate (default 256)")
    g.add_argument("--temp", type=float, help="sampling temperature (0 = greedy)")
    g.add_argument("--top-p", type=float)
    g.add_argument("--top-k", type=int)
    g.add_argument("--min-p", type=float)
    g.add_argument("--seed", type=int)
    g.add_argument("--chat-template", action="store_true", default=None,
                   help="wrap the prompt in the tokenizer's chat template (on by default for the built-in default model)")
    g.add_argument("--no-chat-template", dest="chat_template", action="store_false", help="never wrap the prompt")
    g.add_argument("--trace", help="write one JSON line per round to this file")
    g.add_argument("--json", action="store_true", help="print one JSON object (text, tokens, stats)")

    sub.add_parser("plugins", help="list installed plugins as JSON")

    d = sub.add_parser("doctor", help="report BLAS, device and versions")
    from .doctor import add_doctor_arguments

    add_doctor_arguments(d)

    s = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API with speculative decoding")
    from .server import add_serve_arguments

    add_serve_arguments(s)

    b = sub.add_parser("bench", help="benchmark speculative decoding side by side with plain mlx-lm")
    from .bench import add_bench_arguments

    add_bench_arguments(b)

    t = sub.add_parser("train", help="train a KV-sharing assistant drafter against a frozen target")
    from .train.loop import add_train_arguments

    add_train_arguments(t)

    e = sub.add_parser("eval", help="measure a drafter's tau and acceptance per position")
    from .train.eval import add_eval_arguments

    add_eval_arguments(e)

    c = sub.add_parser("convert", help="convert a GGUF file into an mlx-lm model folder")
    try:
        from .convert.cli import add_arguments as add_convert_arguments

        add_convert_arguments(c)
    except ImportError:  # pragma: no cover
        pass
    return parser


def _config_from_args(args):
    from .config import load_config

    overrides = {
        "model": {"model": args.model, "draft_model": args.draft_model, "draft_kind": args.draft_kind, "dtype": args.dtype},
        "draft": {"block_size": args.draft_block_size},
    }
    if hasattr(args, "temp"):
        overrides["sampling"] = {
            "temperature": args.temp, "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p, "seed": args.seed,
        }
        overrides["generation"] = {"max_tokens": args.max_tokens}
        overrides["trace"] = {"file": args.trace}
    return load_config(args.config, overrides)


def _trace_logger(path: str):
    """A structlog logger writing JSON lines to ``path`` (no global configure)."""
    import structlog

    fh = open(path, "a", buffering=1)  # closed by cmd_generate
    return fh, structlog.wrap_logger(
        structlog.WriteLogger(fh),
        processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso"), structlog.processors.JSONRenderer()],
    )


def _quiet_logger():
    """A logger whose info() is a no-op (no rendering cost per round)."""
    import logging

    import structlog

    return structlog.wrap_logger(None, wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


DEFAULT_PROMPT = "Explain in a few sentences why the sky is blue."


def _encode(session, text: str, chat: bool) -> list[int]:
    from .engine import encode_prompt

    if session.tokenizer is None:
        raise CLIError("this model has no tokenizer; pass --prompt-ids")
    if chat and not getattr(session.tokenizer, "chat_template", None):
        raise CLIError("this tokenizer has no chat template; drop --chat-template")
    return encode_prompt(session.tokenizer, text, chat)


def cmd_generate(args) -> int:
    cfg = _config_from_args(args)
    trace_fh, log = _trace_logger(cfg.trace.file) if cfg.trace.file else (None, _quiet_logger())
    try:
        return _generate(args, cfg, log)
    finally:
        if trace_fh is not None:
            trace_fh.close()


def _generate(args, cfg, log) -> int:
    import time

    from .engine import generate_stream, load_session, make_request

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        session = load_session(cfg, log=log)
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    builtin = cfg.model.model is None  # the built-in default: an instruct model, chat template on
    if args.chat_template is None:
        args.chat_template = builtin

    if args.prompt_ids:
        try:
            prompts = [[int(x) for x in args.prompt_ids.split(",") if x.strip()]]
        except ValueError:
            raise CLIError("--prompt-ids must be comma-separated integers") from None
    elif args.prompts_file:
        lines = [ln for ln in Path(args.prompts_file).read_text().splitlines() if ln.strip()]
        if not lines:
            raise CLIError(f"{args.prompts_file} holds no prompt")
        prompts = [_encode(session, ln, args.chat_template) for ln in lines]
    else:
        text = args.prompt if args.prompt is not None else DEFAULT_PROMPT
        if text == "-":
            text = sys.stdin.read()
        prompts = [_encode(session, text, args.chat_template)]
    vocab = session.target.vocab_size
    for p in prompts:
        if not p:
            raise CLIError("the prompt encodes to no tokens")
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise CLIError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
    reqs = [make_request(session, p, request_id=str(i)) for i, p in enumerate(prompts)]
    outs: dict[str, list[int]] = {r.id: [] for r in reqs}
    reasons: dict[str, str | None] = {}
    stream = len(reqs) == 1 and not args.json and session.tokenizer is not None
    printed = 0
    t0 = time.perf_counter()
    for ev in generate_stream(session, reqs):
        outs[ev.request_id].extend(ev.tokens)
        if ev.finished:
            reasons[ev.request_id] = ev.finish_reason
        if stream:
            text = session.tokenizer.decode(outs[ev.request_id])
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = len(text)
    elapsed = time.perf_counter() - t0
    stats = session.stats.as_dict()
    ntok = sum(len(v) for v in outs.values())
    stats.update(
        elapsed_s=round(elapsed, 4),
        tokens_per_s=round(ntok / elapsed, 2) if elapsed > 0 else None,
        draft_kind=session.draft_kind,
        block_size=cfg.draft.block_size if session.drafter is not None else 1,
    )
    decode = (lambda t: session.tokenizer.decode(t)) if session.tokenizer is not None else (lambda t: None)
    if args.json:
        results = [
            {"text": decode(outs[r.id]), "tokens": outs[r.id], "finish_reason": reasons.get(r.id), "prompt_tokens": len(r.prompt)}
            for r in reqs
        ]
        obj = dict(results[0]) if len(results) == 1 else {"results": results}
        obj["stats"] = stats
        print(json.dumps(obj))
    else:
        if stream:
            print()
        else:
            for r in reqs:
                print(decode(outs[r.id]) if session.tokenizer is not None else outs[r.id])
        print(
            f"[{ntok} tokens, {stats['tokens_per_s']} tok/s, tau {stats['tau']}, acceptance {stats['acceptance_rate']}]",
            file=sys.stderr,
        )
    return 0


def cmd_plugins(args) -> int:
    from .plugins import get_plugins

    print(json.dumps(get_plugins().describe(), indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    from . import _blas

    r = _blas.ensure_fast_blas()  # before anything imports mlx
    if r.get("status") == "mlx_already_imported" and argv is None:
        _blas.reexec_with_preload()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "plugins":
            return cmd_plugins(args)
        if args.command == "doctor":
            from .doctor import main_doctor

            return main_doctor(args)
        if args.command == "serve":
            from .server import run_serve

            return run_serve(args)
        if args.command == "bench":
            from .bench import run_bench

            return run_bench(args)
        if args.command == "train":
            from .train.loop import run_train

            return run_train(args)
        if args.command == "eval":
            from .train.eval import run_eval

            return run_eval(args)
        if args.command == "convert":
            from .convert.cli import run as run_convert

            return run_convert(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `mtpflow plugins | head`
        sys.stderr.close()
        return 0
    except Exception as exc:  # one line, no traceback, non-zero exit
        if _is_user_error(exc):
            print(f"mtpflow: error: {exc}", file=sys.stderr)
            return 2
        raise
    parser.error(f"unknown command {args.command}")
    return 2


def _is_user_error(exc: BaseException) -> bool:
    from .config import ConfigError
    from .plugins import PluginError

    user = (CLIError, ConfigError, PluginError, FileNotFoundError, ValueError, OSError)
    return isinstance(exc, user)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
