"""Rough edges of the library and the CLI (issue 32): each a one-line error or
an honest output instead of a traceback, a silent fallback or a silent skip."""

from __future__ import annotations

import json

import pytest
from test_cli import E_DRAFTER, E_TARGET, FIX, PROMPT, assert_user_error, generate, run

D_TARGET = FIX / "pair_d" / "target"  # a Gemma 4 MoE target (enable_moe_block)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_moe_target_on_the_cpu_is_one_line_before_loading(capsys, monkeypatch, dtype):
    from mtpflow.plugins import get_plugins

    cls = get_plugins().targets.get("gemma4")

    def no_load(*a, **k):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(cls, "from_path", no_load)
    rc, out, err = generate(capsys, "--dtype", dtype, "--prompt-ids", "5,6,7", model=D_TARGET, max_tokens=3)
    assert_user_error(rc, err, "mixture-of-experts", "float32", dtype)
    assert out == ""


def test_float32_moe_and_half_precision_dense_targets_still_load(capsys):
    rc, out, err = generate(capsys, "--dtype", "float32", "--prompt-ids", "5,6,7", "--json", model=D_TARGET, max_tokens=2)
    assert rc == 0, err
    rc, out, err = generate(capsys, "--dtype", "bfloat16", "--prompt-ids", "5,6,7", "--json", model=E_TARGET, max_tokens=2)
    assert rc == 0, err and len(json.loads(out)["tokens"]) == 2
