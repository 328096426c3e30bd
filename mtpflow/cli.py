"""The ``mtpflow`` command line.

Nothing at module level imports mlx: OpenBLAS has to be loaded first
(:func:`mtpflow.backend.blas.ensure_fast_blas`), so every heavy import happens inside
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


class DefaultsFormatter(argparse.HelpFormatter):
    """Every flag's help states its default: ``(default: X)`` is appended
    unless the help text already says what the default is."""

    def _get_help_string(self, action):
        h = action.help or ""
        if "default" in h.lower() or action.default is argparse.SUPPRESS or not action.option_strings:
            return h
        d = action.default
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            shown = "off" if isinstance(action, argparse._StoreTrueAction) else "on"
        elif d is None:
            return h
        elif isinstance(d, (list, tuple)):
            shown = ",".join(str(x) for x in d)
        else:
            shown = str(d)
        return f"{h} (default: {shown})" if h else f"(default: {shown})"


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="target: local folder, Hugging Face repo id or packaged name (smollm2-135m, gemma3-270m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b); default: the built-in pair, smollm2-135m with its shipped drafter smollm2-135m-mtp")
    p.add_argument("--draft-model", help="drafter: local folder, Hugging Face repo id or packaged drafter name (default: none, the target decodes alone; with no --model, the built-in drafter unless --draft-kind asks for another kind)")
    p.add_argument("--draft-kind", help="drafter kind, e.g. ngram or model; an unknown kind, or one the drafter checkpoint contradicts, is an error (default: detected from the drafter's config.json)")
    p.add_argument("--draft-block-size", type=int, help="tokens verified per round: drafts + 1, fixed (default: the adaptive policy, starting at the drafter's recommended size, else 4)")
    p.add_argument("--draft-policy", help="block-size policy: adaptive, fixed or a plugin's (default: fixed when --draft-block-size is given, else adaptive)")
    p.add_argument("--draft-tree", help="verify a tree of candidates: children per depth ('4,2,1'), 'dynamic:TOPK:WIDTH:DEPTH[:NODES]' "
                                        "(EAGLE-2; NODES: verify only that many, the most probable), or 'auto' (the adaptive policy measures trees against chains) (default: off)")
    p.add_argument("--config", help="TOML config file, or the name of a shipped config (default, gemma4-e2b, gemma4-e4b, gemma4-26b-a4b, gemma4-31b); flags override it (default: none)")
    p.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"],
                   help="weights dtype (default: auto = the checkpoint's own on a GPU, float32 on a CPU)")
    p.add_argument("--set", dest="sets", action="append", metavar="KEY=VALUE", default=[],
                   help="set any config key, e.g. plugins.NAME.key=0.7 or sampling.top_k=20 (a TOML value); repeatable (default: none)")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="mtpflow", description="Multi-token-prediction speculative decoding on MLX.",
                                     formatter_class=DefaultsFormatter)
    parser.add_argument("--version", action="version", version=f"mtpflow {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name, **kw):
        return sub.add_parser(name, formatter_class=DefaultsFormatter, **kw)

    g = add("generate", help="generate text (speculative when a drafter is given)")
    _add_model_args(g)
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", "-p", help=f"prompt text, '-' reads stdin (default: {DEFAULT_PROMPT!r})")
    src.add_argument("--prompts-file", help="file with one prompt per line, decoded as one batch (default: none)")
    g.add_argument("--prompt-ids", help="comma-separated prompt token ids instead of text, never templated (default: none)")
    g.add_argument("--system-prompt", help="system message for the chat template (default: none)")
    g.add_argument("--image", action="append", default=[], metavar="PATH_OR_DATA_URL",
                   help="an image for the prompt (multimodal Gemma 4 targets; the 'vision' extra); repeatable (default: none)")
    g.add_argument("--audio", action="append", default=[], metavar="PATH_OR_DATA_URL",
                   help="an audio clip for the prompt (checkpoints with an audio tower); repeatable (default: none)")
    g.add_argument("--max-tokens", "-m", type=int, help="tokens to generate (default: 256)")
    g.add_argument("--max-context", type=int, help="limit on prompt + --max-tokens, as the server's --max-context "
                                                   "(default: the server's, 8192)")
    g.add_argument("--temp", type=float, help="sampling temperature, 0 = greedy (default: 0)")
    g.add_argument("--top-p", type=float, help="nucleus sampling, 1 = off (default: 1.0)")
    g.add_argument("--top-k", type=int, help="top-k sampling, 0 = off (default: 0)")
    g.add_argument("--min-p", type=float, help="min-p sampling, 0 = off (default: 0)")
    g.add_argument("--seed", type=int, help="random seed, 0 <= seed < 2**63 (default: none, nondeterministic)")
    g.add_argument("--chat-template", dest="chat_template", action="store_const", const=True, default=None,
                   help="require the tokenizer's chat template (an error when it has none; default: used whenever the tokenizer has one)")
    g.add_argument("--ignore-chat-template", "--no-chat-template", dest="chat_template", action="store_const", const=False,
                   help="encode the prompt as plain text, never through the chat template (default: off)")
    g.add_argument("--trace", help="write one JSON line per round to this file (default: none)")
    g.add_argument("--verbose", "-v", action="store_true", help="print every round's event to stderr")
    g.add_argument("--json", action="store_true", help="print one JSON object (text, tokens, stats)")

    add("plugins", help="list installed plugins and what they registered, as JSON")

    d = add("doctor", help="report BLAS, device and versions")
    from .doctor import add_doctor_arguments

    add_doctor_arguments(d)

    s = add("serve", help="serve an OpenAI-compatible HTTP API with speculative decoding")
    from .serve.cli import add_serve_arguments

    add_serve_arguments(s)

    b = add("bench", help="benchmark speculative decoding side by side with plain mlx-lm")
    from .bench import add_bench_arguments

    add_bench_arguments(b)

    t = add("train", help="train a drafter (assistant, EAGLE-3, DFlash, MTP module) against a frozen target")
    from .train.cli import add_train_arguments

    add_train_arguments(t)

    e = add("eval", help="measure a drafter's tau and acceptance per position")
    from .train.eval import add_eval_arguments

    add_eval_arguments(e)

    x = add("export", help="write a drafter in another format (EAGLE-3 -> Speculators, MTP heads -> native layout; for vLLM / SGLang)")
    from .export import add_arguments as add_export_arguments

    add_export_arguments(x)

    c = add("convert", help="convert a GGUF file into an mlx-lm model folder")
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
        "draft": {"block_size": args.draft_block_size, "policy": getattr(args, "draft_policy", None),
                  "tree": getattr(args, "draft_tree", None)},
    }
    if hasattr(args, "temp"):
        overrides["sampling"] = {
            "temperature": args.temp, "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p, "seed": args.seed,
        }
        overrides["generation"] = {"max_tokens": args.max_tokens}
        overrides["trace"] = {"file": args.trace}
    return load_config(args.config, overrides, sets=getattr(args, "sets", None))


DEFAULT_PROMPT = "Explain in a few sentences why the sky is blue."


def _encode(session, text: str, chat: bool | None, system: str | None) -> list[int]:
    """``chat``: ``None`` = the chat template when the tokenizer has one (as
    ``mlx_lm.generate``), ``True`` = required, ``False`` = plain text
    (:func:`mtpflow.prompts.prompt_ids`, which the Python API uses too)."""
    from .prompts import prompt_ids

    if session.tokenizer is None:
        raise CLIError("this model has no tokenizer; pass --prompt-ids")
    has = bool(getattr(session.tokenizer, "chat_template", None))
    if chat and not has:
        raise CLIError("this tokenizer has no chat template; drop --chat-template")
    if system is not None and not has:
        raise CLIError("--system-prompt needs a chat template, and this tokenizer has none")
    if chat is False and system is not None:
        raise CLIError("--system-prompt needs the chat template; drop --ignore-chat-template")
    return prompt_ids(session.tokenizer, text, chat, system)


def cmd_generate(args) -> int:
    import logging

    from .logs import enable_console, file_logger, null_logger, round_logger

    cfg = _config_from_args(args)
    if cfg.trace.file:
        trace_fh = open(cfg.trace.file, "a", buffering=1)
        log = file_logger(trace_fh)
    else:
        trace_fh = None
        log = round_logger() if args.verbose else null_logger()
    handler = enable_console(logging.DEBUG) if args.verbose else None
    try:
        return _generate(args, cfg, log)
    finally:
        if trace_fh is not None:
            trace_fh.close()
        if handler is not None:
            logging.getLogger("mtpflow").removeHandler(handler)


def _generate(args, cfg, log) -> int:
    import time

    from .engine import generate_stream
    from .prompts import make_request
    from .session import load_session

    if args.seed is not None and not 0 <= args.seed < 2**63:
        raise CLIError(f"--seed must be in [0, 2**63) (got {args.seed})")
    from .serve.protocol import DEFAULT_MAX_CONTEXT

    if args.max_context is not None and args.max_context < 2:
        raise CLIError(f"--max-context must be at least 2 (got {args.max_context})")
    limit, max_tokens = args.max_context or DEFAULT_MAX_CONTEXT, cfg.generation.max_tokens
    if max_tokens >= limit:  # no prompt fits: say so before loading anything
        raise CLIError(f"--max-tokens {max_tokens} leaves no room for a prompt in the context limit of {limit} tokens; "
                       f"ask for fewer tokens, or raise --max-context")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        session = load_session(cfg, log=log)
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)

    prompts, media = _cli_prompts(args, session)
    _check_prompts(prompts, session.target.vocab_size, max_tokens, limit)
    reqs = [make_request(session, p, request_id=str(i)) for i, p in enumerate(prompts)]
    if media is not None:
        reqs[0].media = media
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
    ntok = sum(len(v) for v in outs.values())
    stats, policy = _run_stats(session, elapsed, ntok)
    _print_results(args, session, reqs, outs, reasons, stats, policy, ntok, stream)
    return 0


def _cli_prompts(args, session) -> tuple[list[list[int]], object]:
    """The prompts' token ids (``--prompt-ids``, ``--prompts-file`` or
    ``--prompt``) and the media of an ``--image`` / ``--audio`` prompt (or ``None``)."""
    if args.prompt_ids is not None:
        try:
            prompts = [[int(x) for x in args.prompt_ids.split(",") if x.strip()]]
        except ValueError:
            raise CLIError("--prompt-ids must be comma-separated integers") from None
        if not prompts[0]:
            raise CLIError("--prompt-ids holds no token id; pass comma-separated ids, e.g. --prompt-ids 1,2,3")
    elif args.prompts_file:
        lines = [ln for ln in Path(args.prompts_file).read_text().splitlines() if ln.strip()]
        if not lines:
            raise CLIError(f"{args.prompts_file} holds no prompt")
        prompts = [_encode(session, ln, args.chat_template, args.system_prompt) for ln in lines]
    else:
        text = args.prompt if args.prompt is not None else DEFAULT_PROMPT
        if text == "-":
            text = sys.stdin.read()
        prompts = None if args.image or args.audio else [_encode(session, text, args.chat_template, args.system_prompt)]
    media = None
    if args.image or args.audio:  # through the checkpoint's processor and chat template, as mlx_vlm.generate
        from .media import encode_prompt_with_media

        if args.prompt_ids is not None or args.prompts_file:
            raise CLIError("--image / --audio go with --prompt (not --prompt-ids or --prompts-file)")
        ids, media = encode_prompt_with_media(session, text, args.image, args.audio, chat=args.chat_template,
                                              system=args.system_prompt)
        prompts = [ids]
    return prompts, media


def _check_prompts(prompts, vocab: int, max_tokens: int, limit: int) -> None:
    """Each prompt is non-empty, fits the context limit with ``max_tokens``, and stays in the vocabulary."""
    for p in prompts:
        if not p:
            raise CLIError("the prompt encodes to no tokens")
        if len(p) + max_tokens > limit:  # the server's limit (mtpflow serve --max-context)
            raise CLIError(f"prompt ({len(p)} tokens) + --max-tokens {max_tokens} exceeds the context limit of {limit} "
                           f"tokens; ask for at most {max(limit - len(p), 0)} tokens, or raise --max-context")
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise CLIError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")


def _run_stats(session, elapsed: float, ntok: int) -> tuple[dict, str | None]:
    """The stats a run prints (``--json``'s ``stats``) and its block policy."""
    from . import api

    stats = session.stats.as_dict()
    policy = session.config.draft.policy if session.drafter is not None else None
    stats.update(
        elapsed_s=round(elapsed, 4),
        tokens_per_s=round(ntok / elapsed, 2) if elapsed > 0 else None,
        draft_kind=session.draft_kind,
        drafter=session.drafter.label if api.has(session.drafter, api.LabelledDrafter) else session.draft_kind,
        block_size=session.config.draft.block_size if session.drafter is not None else 1,
        block_policy=policy,
        dtype=session.dtype,
        head=session.selection.get("head"),
        sampler=session.selection.get("sampler"),
        batch_policy=session.selection.get("batch_policy"),
        draft_tree=session.config.draft.tree if session.drafter is not None else "off",
    )
    return stats, policy


def _print_results(args, session, reqs, outs: dict, reasons: dict, stats: dict, policy, ntok: int, stream: bool) -> None:
    """The answers (unless streamed) and the stats, as text or ``--json``."""
    from .metrics import format_stats

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
            for i, r in enumerate(reqs):
                if i:
                    print("\n---")  # a blank line and a rule between answers
                print(decode(outs[r.id]) if session.tokenizer is not None else outs[r.id])
        print(format_stats(ntok, stats, policy), file=sys.stderr)


def cmd_plugins(args) -> int:
    from .plugins import get_plugins

    print(json.dumps(get_plugins().describe(), indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    from .backend import blas as _blas

    if argv is None and [a for a in sys.argv[1:] if not a.startswith("-")][:1] == ["train"]:
        # the command line's training run: before MLX starts its threads (mtpflow.backend.heap)
        from .backend.heap import retain_freed_memory

        retain_freed_memory()
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
            from .serve.cli import run_serve

            return run_serve(args)
        if args.command == "bench":
            from .bench import run_bench

            return run_bench(args)
        if args.command == "train":
            from .train.cli import run_train

            return run_train(args)
        if args.command == "eval":
            from .train.eval import run_eval

            return run_eval(args)
        if args.command == "export":
            from .export import run as run_export

            return run_export(args)
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
    from ._extras import MissingExtra
    from .config import ConfigError
    from .plugins import PluginError

    user = (CLIError, ConfigError, PluginError, MissingExtra, FileNotFoundError, ValueError, OSError)
    return isinstance(exc, user)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
