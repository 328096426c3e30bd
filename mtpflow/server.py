"""``mtpflow.server``: the names of :mod:`mtpflow.serve` (the OpenAI-compatible server,
``mtpflow serve``), where its modules and their description live."""

from .serve.app import create_app
from .serve.cli import (
    DEFAULT_PREFIX_CACHE_MB, add_serve_arguments, media_limits_from_args, parse_size, run_serve,
    serve_config_from_args,
)
from .serve.protocol import (
    DEFAULT_MAX_BODY_SIZE, DEFAULT_MAX_CONTEXT, DEFAULT_MAX_QUEUED, APIError, parse_body, render_chat_fallback,
)
from .serve.scheduler import RoundObserver, Scheduler

__all__ = [
    "APIError", "DEFAULT_MAX_BODY_SIZE", "DEFAULT_MAX_CONTEXT", "DEFAULT_MAX_QUEUED", "DEFAULT_PREFIX_CACHE_MB",
    "RoundObserver", "Scheduler", "add_serve_arguments", "create_app", "media_limits_from_args", "parse_body",
    "parse_size", "render_chat_fallback", "run_serve", "serve_config_from_args",
]
