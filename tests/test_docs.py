"""Every hook is documented with its exact signature and has a test of its own."""

import inspect
import re
from pathlib import Path

import pytest

from mtpflow import hookspecs

ROOT = Path(__file__).parent.parent
HOOKS = sorted(n for n in vars(hookspecs) if n.startswith("mtpflow_"))


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_documented_with_exact_signature(hook):
    docs = (ROOT / "docs" / "hooks.md").read_text()
    sig = f"{hook}{inspect.signature(getattr(hookspecs, hook))}"
    assert f"## `{hook}`" in docs
    assert sig in docs, f"docs/hooks.md must show `{sig}`"


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_spec_documents_params_return_and_version(hook):
    doc = inspect.getdoc(getattr(hookspecs, hook))
    assert ".. versionadded::" in doc and ":return:" in doc
    for p in inspect.signature(getattr(hookspecs, hook)).parameters:
        assert f":param {p}:" in doc


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_has_a_test(hook):
    here = Path(__file__).name
    texts = [p.read_text() for p in (ROOT / "tests").glob("test_*.py") if p.name != here]
    assert any(re.search(rf"\b{hook}\b", t) for t in texts), f"no test mentions {hook}"
