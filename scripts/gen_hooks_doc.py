#!/usr/bin/env python3
"""Write docs/hooks.md from mtpflow/hookspecs.py (its specs, signatures and docstrings).

    python scripts/gen_hooks_doc.py          # rewrite docs/hooks.md
    python scripts/gen_hooks_doc.py --check  # exit 1 if it is out of date

tests/test_docs.py runs the check, so the reference never drifts from the code.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "hooks.md"

HEADER = """# Hook reference

Every hook mtpflow calls lives in `mtpflow/hookspecs.py`; this page is generated from it
(`python scripts/gen_hooks_doc.py`). Implement any of them in a module or object decorated with
`from mtpflow.api import hookimpl`, and expose it through the `mtpflow` entry-point group of your
package (see `plugins/mtpflow-echo/` and `plugins/mtpflow-fixed-temp/`). What each registry accepts
is a `typing.Protocol` in `mtpflow.api`; the host checks registrations against it. Specs only grow
by new keyword arguments; an implementation may accept fewer arguments.
"""


def render() -> str:
    sys.path.insert(0, str(ROOT))
    from mtpflow import hookspecs

    hooks = [(n, f) for n, f in vars(hookspecs).items() if n.startswith("mtpflow_") and callable(f)]
    parts = [HEADER]
    for name, fn in hooks:
        opts = getattr(fn, "mtpflow_spec", {})
        kinds = [k for k in ("firstresult", "historic") if opts.get(k)]
        mark = f"*{', '.join(kinds)}*\n\n" if kinds else ""
        parts.append(f"## `{name}`\n\n```python\n{name}{inspect.signature(fn)}\n```\n\n{mark}{inspect.getdoc(fn)}\n")
    return "\n".join(parts)


if __name__ == "__main__":
    text = render()
    if "--check" in sys.argv:
        if DOC.read_text() != text:
            print("docs/hooks.md is out of date: run python scripts/gen_hooks_doc.py", file=sys.stderr)
            sys.exit(1)
    else:
        DOC.write_text(text)
