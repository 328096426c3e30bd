#!/usr/bin/env python3
"""The README's Quick-start commands, as written there.

    python3 scripts/quickstart.py run    # the first command: run the main job
    python3 scripts/quickstart.py test   # the second: install and run the tests

``.ci/run`` and ``tests/test_fresh_venv.py`` run what this prints, so they
run exactly what a newcomer copies from the README.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def commands(text: str | None = None) -> dict[str, str]:
    """``{"venv": ..., "run": ..., "test": ...}`` from the README's Quick start:
    the lines of its ``bash`` blocks, in order."""
    text = README.read_text() if text is None else text
    m = re.search(r"^## Quick start\n(.*?)(?=^## )", text, re.S | re.M)
    if not m:
        raise SystemExit("README.md has no '## Quick start' section")
    lines = []
    for block in re.findall(r"^```bash\n(.*?)^```", m.group(1), re.S | re.M):
        lines += [ln.split("  #")[0].strip() for ln in block.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if len(lines) != 3:
        raise SystemExit(f"README.md's Quick start should hold 3 commands (virtualenv, run, test); found {len(lines)}")
    return dict(zip(("venv", "run", "test"), lines))


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("venv", "run", "test"):
        raise SystemExit("usage: quickstart.py venv|run|test")
    print(commands()[sys.argv[1]])
