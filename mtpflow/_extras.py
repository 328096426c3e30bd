"""Optional extras: one clear line when a command needs one that is missing.

``require("serve", "starlette", "uvicorn")`` imports nothing itself beyond
checking that the modules can be found; a missing one raises
:class:`MissingExtra`, whose message names the ``pip install`` to run (the
CLI prints it as its one-line error).
"""

from __future__ import annotations

import importlib.util

#: extra -> what it is for (the CLI's wording)
EXTRAS = {
    "serve": "mtpflow serve",
    "bench": "mtpflow bench",
    "train": "mtpflow train / eval",
    "structured": "structured output (a grammar, a JSON schema or a regex)",
}


class MissingExtra(ImportError):
    """A command needs an optional extra that is not installed."""


def require(extra: str, *modules: str) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        what = EXTRAS.get(extra, extra)
        raise MissingExtra(
            f"{what} needs the optional '{extra}' extra ({', '.join(missing)} not installed); "
            f'run: pip install "mtpflow[{extra}]"'
        )
