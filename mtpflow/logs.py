"""Logging, the stdlib way for a library: silent unless the caller asks.

mtpflow logs through the standard library logger ``mtpflow`` (and its
children), which carries only a :class:`logging.NullHandler`: with logging
unconfigured nothing is printed.  Round events are ``DEBUG`` records of
``mtpflow.rounds`` whose message is the round as one JSON object; request
events of the server are ``INFO`` records of ``mtpflow.server``.  Turn them
on as for any library::

    logging.basicConfig()
    logging.getLogger("mtpflow").setLevel(logging.DEBUG)

The CLI does so for ``--verbose``; ``--trace FILE`` writes the round events
as JSON lines to a file instead.  structlog is never configured globally:
the loggers here are wrapped explicitly.
"""

from __future__ import annotations

import logging

ROOT = "mtpflow"
ROUNDS = "mtpflow.rounds"
SERVER = "mtpflow.server"

logging.getLogger(ROOT).addHandler(logging.NullHandler())


def stdlib_logger(name: str = ROUNDS):
    """A structlog logger over the stdlib logger ``name``: events below the
    logger's effective level are dropped before they are rendered."""
    import structlog

    return structlog.wrap_logger(
        logging.getLogger(name),
        wrapper_class=structlog.stdlib.BoundLogger,
        processors=[
            structlog.stdlib.filter_by_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.JSONRenderer(),
        ],
    )


def round_logger():
    """The engine's default round logger (``mtpflow.rounds``, DEBUG events)."""
    return stdlib_logger(ROUNDS)


def file_logger(fh):
    """JSON lines of every event, whatever its level, to the open file ``fh``."""
    import structlog

    return structlog.wrap_logger(
        structlog.WriteLogger(fh),
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
        processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso"), structlog.processors.JSONRenderer()],
    )


def debug_enabled(log) -> bool:
    """Whether ``log`` would keep a DEBUG event, so a caller can skip building
    one (a round's event costs about 0.1 ms).  Loggers that cannot say keep it."""
    for name in ("is_enabled_for", "isEnabledFor"):
        check = getattr(log, name, None)
        if check is not None:
            said = check(logging.DEBUG)
            return True if said is None else bool(said)  # None: a catch-all stand-in that cannot say
    return True


class NullLogger:
    """A logger whose every method is a no-op (no rendering cost per round)."""

    def bind(self, **kw):
        return self

    def is_enabled_for(self, level) -> bool:
        return False

    def __getattr__(self, name):
        return _noop


def _noop(*args, **kwargs):
    return None


def null_logger() -> NullLogger:
    return NullLogger()


def enable_console(level: int = logging.DEBUG, name: str = ROOT) -> logging.Handler:
    """For applications (the CLI's ``--verbose``, ``mtpflow serve``): print
    ``name``'s records at ``level`` and above to stderr, one line each."""
    import sys

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    log = logging.getLogger(name)
    log.addHandler(handler)
    log.setLevel(level)
    return handler
