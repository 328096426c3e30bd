"""``mtpflow convert``: GGUF file or packaged GGUF -> mlx-lm model folder.

Wire it with::

    sub = subparsers.add_parser("convert", help="convert a GGUF to an mlx-lm folder")
    mtpflow.convert.cli.add_arguments(sub)
    ...
    return mtpflow.convert.cli.run(args)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--gguf/--package`` (one required), ``--out``, ``--dtype``."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--gguf", metavar="FILE", help="path of a GGUF file (this or --package is required)")
    source.add_argument(
        "--package",
        metavar="NAME",
        help="packaged GGUF shipped in PyPI wheels (smollm2-135m, gemma3-270m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b; this or --gguf is required)",
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        default=None,
        help="output folder (default: a cache folder under $MTPFLOW_CACHE or "
        "~/.cache/mtpflow/gguf, reused when the GGUF is unchanged)",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "float16", "bfloat16"),
        help="weight dtype of the converted model (default: float32)",
    )


def run(args: argparse.Namespace) -> int:
    """Convert as asked by ``args``; print a one-line JSON summary.

    Returns 0 on success, 2 on a :class:`~mtpflow.convert.gguf.GGUFError`
    (the error is printed as one line on stderr).
    """
    from mtpflow.convert.gguf import (
        GGUFError,
        convert_gguf,
        find_packaged_gguf,
        load_gguf_cached,
    )

    start = time.perf_counter()
    try:
        src = find_packaged_gguf(args.package) if args.package else Path(args.gguf)
        if args.out:
            out = convert_gguf(src, args.out, dtype=args.dtype)
        else:
            out = load_gguf_cached(src, dtype=args.dtype)
    except GGUFError as exc:
        print(f"mtpflow convert: error: {exc}", file=sys.stderr)
        return 2
    config = json.loads((out / "config.json").read_text())
    summary = {
        "out": str(out),
        "source": str(src),
        "arch": config.get("model_type"),
        "dtype": args.dtype,
        "seconds": round(time.perf_counter() - start, 2),
    }
    print(json.dumps(summary))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point: ``python -m mtpflow.convert.cli``."""
    parser = argparse.ArgumentParser(prog="mtpflow convert", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
