"""``mtpflow serve``'s flags and its start: check the flags and the address, bind the
socket, load the model, serve (see :mod:`mtpflow.serve`)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from .app import create_app
from .protocol import DEFAULT_MAX_BODY_SIZE, DEFAULT_MAX_CONTEXT, DEFAULT_MAX_QUEUED, MAX_TIME
from .scheduler import _evolve

#: ``--prefix-cache-mb``: MiB of finished requests' K/V kept for reuse
DEFAULT_PREFIX_CACHE_MB = 256


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------
def parse_size(text: str) -> int:
    """Bytes from ``"8388608"``, ``"512K"``, ``"8M"`` or ``"1G"`` (binary units)."""
    s = str(text).strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(s[-1:], 1)
    try:
        n = float(s[:-1] if mult != 1 else s) * mult
    except ValueError:
        raise ValueError(f"not a size: {text!r} (e.g. 8M, 512K, 1048576)") from None
    if not n >= 1:
        raise ValueError(f"a size must be at least 1 byte (got {text!r})")
    return int(n)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``mtpflow serve``."""
    parser.add_argument("--model", help="target: local folder or Hugging Face repo id (default: the built-in pair, smollm2-135m + smollm2-135m-mtp); also a packaged name: smollm2-135m, gemma3-270m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b")
    parser.add_argument("--draft-model", help="drafter folder or repo id (default: $MTPFLOW_DRAFT_MODEL)")
    parser.add_argument("--draft-kind", help="drafter kind (default: $MTPFLOW_DRAFT_KIND, else detected)")
    parser.add_argument("--draft-block-size", type=int, help="tokens verified per round (default: $MTPFLOW_DRAFT_BLOCK_SIZE)")
    parser.add_argument("--config", help="TOML config file or a shipped config's name; flags override it (default: none)")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="weights dtype (default float32)")
    parser.add_argument("--set", dest="sets", action="append", metavar="KEY=VALUE", default=[],
                        help="set any config key, e.g. plugins.NAME.key=0.7 (a TOML value); repeatable (default: none)")
    parser.add_argument("--prefix-cache-mb", type=int, default=DEFAULT_PREFIX_CACHE_MB,
                        help="keep the target's K/V of finished requests (an LRU of this many MiB, the memory really "
                             f"held) so a multi-turn chat prefills only its new turn; 0 = off (default "
                             f"{DEFAULT_PREFIX_CACHE_MB})")
    parser.add_argument("--log-level", choices=["warning", "info", "debug"], default="info",
                        help="info: one line per request; debug: also every round (default info)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    parser.add_argument("--max-batch-size", type=int, help="rows decoded together (default: config, 8)")
    parser.add_argument("--served-model-name", help="model name clients must send (default: the target folder name)")
    parser.add_argument("--max-context", type=int, default=None,
                        help=f"limit on prompt + max_tokens per request (default {DEFAULT_MAX_CONTEXT})")
    parser.add_argument("--max-queued", type=int, default=None,
                        help=f"rows that may wait for a place in the batch; past it requests get 503 with "
                             f"Retry-After (default {DEFAULT_MAX_QUEUED})")
    parser.add_argument("--max-body-size", default=None,
                        help=f"largest request body, e.g. 8M or 512K; past it 413 (default "
                             f"{DEFAULT_MAX_BODY_SIZE // 2**20}M)")
    parser.add_argument("--request-timeout", type=float, default=None,
                        help="seconds a request may take from arrival, queue included: the default and the ceiling "
                             "of the request field max_time (default: none)")
    from ..media import DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_REQUEST_PIXELS

    parser.add_argument("--allowed-local-media-path", metavar="DIR", default=None,
                        help="let requests name local image files under DIR (absolute, relative to DIR, or file://; "
                             "symlinks are resolved and must stay inside); default: none, images come as data: URLs")
    parser.add_argument("--max-image-pixels", type=int, default=DEFAULT_MAX_IMAGE_PIXELS,
                        help=f"width x height of one image, read from its header; past it 400 before decoding "
                             f"(default {DEFAULT_MAX_IMAGE_PIXELS}, 4096 x 4096)")
    parser.add_argument("--max-request-pixels", type=int, default=DEFAULT_MAX_REQUEST_PIXELS,
                        help=f"pixels of all the images of one request (default {DEFAULT_MAX_REQUEST_PIXELS})")
    from .http import (DEFAULT_BODY_TIMEOUT, DEFAULT_HEADER_TIMEOUT, DEFAULT_KEEP_ALIVE, DEFAULT_LIMIT_CONCURRENCY,
                             DEFAULT_MAX_HEADER_SIZE)

    parser.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT,
                        help=f"seconds a connection may take to send its request line and headers; then it is closed "
                             f"(default {DEFAULT_HEADER_TIMEOUT:g})")
    parser.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT,
                        help=f"seconds a request body may go without a byte before the connection is closed "
                             f"(default {DEFAULT_BODY_TIMEOUT:g})")
    parser.add_argument("--timeout-keep-alive", type=int, default=DEFAULT_KEEP_ALIVE,
                        help=f"seconds an idle keep-alive connection stays open (default {DEFAULT_KEEP_ALIVE})")
    parser.add_argument("--max-header-size", default=None,
                        help=f"largest request line + headers, e.g. 16K; past it 400 (default "
                             f"{DEFAULT_MAX_HEADER_SIZE // 1024}K)")
    parser.add_argument("--limit-concurrency", type=int, default=DEFAULT_LIMIT_CONCURRENCY,
                        help=f"open connections + requests in progress past which new requests get 503; 0 = no limit "
                             f"(default {DEFAULT_LIMIT_CONCURRENCY})")


def serve_config_from_args(args):
    """The :class:`~mtpflow.config.Config` for ``args`` (flags, then env vars, then the file)."""
    from ..config import ConfigError, load_config

    block = args.draft_block_size
    if block is None and os.environ.get("MTPFLOW_DRAFT_BLOCK_SIZE"):
        raw = os.environ["MTPFLOW_DRAFT_BLOCK_SIZE"]
        try:
            block = int(raw)
        except ValueError:
            raise ConfigError(f"MTPFLOW_DRAFT_BLOCK_SIZE must be an integer (got {raw!r})") from None
    if args.max_batch_size is not None and args.max_batch_size < 1:
        raise ConfigError("--max-batch-size must be >= 1")
    if args.max_context is not None and args.max_context < 2:
        raise ConfigError("--max-context must be >= 2")
    if getattr(args, "max_queued", None) is not None and args.max_queued < 0:
        raise ConfigError("--max-queued must be >= 0")
    if getattr(args, "max_body_size", None) is not None:
        try:
            parse_size(args.max_body_size)
        except ValueError as exc:
            raise ConfigError(f"--max-body-size: {exc}") from None
    rt = getattr(args, "request_timeout", None)
    if rt is not None and not 0 < rt <= MAX_TIME:
        raise ConfigError(f"--request-timeout must be in (0, {MAX_TIME:.0f}] seconds")
    overrides = {
        "model": {
            "model": args.model,
            "draft_model": args.draft_model or os.environ.get("MTPFLOW_DRAFT_MODEL") or None,
            "draft_kind": args.draft_kind or os.environ.get("MTPFLOW_DRAFT_KIND") or None,
            "dtype": getattr(args, "dtype", None),
        },
        "draft": {"block_size": block},
        "batch": {"max_batch_size": args.max_batch_size, "prefix_cache_mb": getattr(args, "prefix_cache_mb", None)},
    }
    cfg = load_config(args.config, overrides, sets=getattr(args, "sets", None))
    if cfg.batch.policy == "static":
        cfg = _evolve(cfg, batch=_evolve(cfg.batch, policy="continuous"))
    return cfg


def media_limits_from_args(args):
    """The :class:`~mtpflow.media.MediaPolicy` of the flags, checked."""
    from ..config import ConfigError
    from ..media import DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_REQUEST_PIXELS, MediaPolicy

    root = getattr(args, "allowed_local_media_path", None)
    if root is not None and not Path(root).expanduser().is_dir():
        raise ConfigError(f"--allowed-local-media-path {root!r} is not a directory")
    per_image = getattr(args, "max_image_pixels", DEFAULT_MAX_IMAGE_PIXELS)
    per_request = getattr(args, "max_request_pixels", DEFAULT_MAX_REQUEST_PIXELS)
    if per_image < 1 or per_request < 1:
        raise ConfigError("--max-image-pixels and --max-request-pixels must be >= 1")
    return MediaPolicy(local_root=root, max_image_pixels=per_image, max_request_pixels=per_request)


def _http_limits(args) -> dict:
    """uvicorn's limits from the flags (:func:`mtpflow.serve.http.uvicorn_config`), checked."""
    from ..config import ConfigError
    from .http import (DEFAULT_BODY_TIMEOUT, DEFAULT_HEADER_TIMEOUT, DEFAULT_KEEP_ALIVE, DEFAULT_LIMIT_CONCURRENCY,
                       DEFAULT_MAX_HEADER_SIZE)

    ht = getattr(args, "header_timeout", DEFAULT_HEADER_TIMEOUT)
    if not 0 < ht <= MAX_TIME:
        raise ConfigError(f"--header-timeout must be in (0, {MAX_TIME:.0f}] seconds")
    bt = getattr(args, "body_timeout", DEFAULT_BODY_TIMEOUT)
    if not 0 < bt <= MAX_TIME:
        raise ConfigError(f"--body-timeout must be in (0, {MAX_TIME:.0f}] seconds")
    ka = getattr(args, "timeout_keep_alive", DEFAULT_KEEP_ALIVE)
    if ka < 1:
        raise ConfigError("--timeout-keep-alive must be >= 1 second")
    lc = getattr(args, "limit_concurrency", DEFAULT_LIMIT_CONCURRENCY)
    if lc < 0:
        raise ConfigError("--limit-concurrency must be >= 0 (0 = no limit)")
    size = DEFAULT_MAX_HEADER_SIZE
    if getattr(args, "max_header_size", None):
        try:
            size = parse_size(args.max_header_size)
        except ValueError as exc:
            raise ConfigError(f"--max-header-size: {exc}") from None
    return {"header_timeout": ht, "body_timeout": bt, "timeout_keep_alive": ka, "limit_concurrency": lc or None,
            "max_header_size": size}


def run_serve(args) -> int:
    """``mtpflow serve``: check the flags, bind the address, load the model and serve until interrupted."""
    from .._extras import require

    require("serve", "starlette", "uvicorn")
    import logging

    from ..logs import enable_console
    from .http import bind, serve, uvicorn_config

    enable_console(getattr(logging, args.log_level.upper()))
    cfg = serve_config_from_args(args)
    limits = _http_limits(args)
    media = media_limits_from_args(args)
    sock = bind(args.host, args.port)  # a bad or busy address fails now, not after the model loaded
    try:
        app = create_app(cfg, served_model_name=args.served_model_name, max_context=args.max_context,
                         max_queued=getattr(args, "max_queued", None),
                         max_body_size=parse_size(args.max_body_size) if getattr(args, "max_body_size", None) else None,
                         request_timeout=getattr(args, "request_timeout", None), media=media)
    except BaseException:
        sock.close()
        raise
    host = f"[{args.host}]" if ":" in args.host else args.host
    name = app.state.served_model_name

    def listening(port: int) -> None:
        print(f"mtpflow: serving {name!r} on http://{host}:{port}/v1", flush=True)

    serve(uvicorn_config(app, log_level="info" if args.log_level != "warning" else "warning", **limits), sock,
          listening)
    return 0
