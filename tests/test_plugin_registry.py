"""One plugin registry per session: the drafter check, the drafter's heads and
late-added plugins all use the session's plugin manager."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mtpflow.config import load_config
from mtpflow.engine import generate, load_session

FIX = Path(__file__).parent / "fixtures" / "eagle3"
IDS = list(range(5, 30))

MY_LLAMA = '''
from mtpflow.api import hookimpl
from mtpflow.targets.mlxlm import MLXLMTarget


class MyLlama(MLXLMTarget):
    model_types = ("my_llama",)
    mlx_lm_module = "llama"


@hookimpl
def mtpflow_register_targets(register):
    register("my_llama", MyLlama)
'''


@pytest.fixture
def my_llama(tmp_path, monkeypatch):
    """The EAGLE-3 fixture's llama target, renamed to model_type my_llama, and
    a module registering a target adapter for it."""
    target = tmp_path / "target"
    shutil.copytree(FIX / "target", target)
    cfg = json.loads((target / "config.json").read_text())
    cfg["model_type"] = "my_llama"
    (target / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "my_llama_plugin.py").write_text(MY_LLAMA)
    monkeypatch.syspath_prepend(str(tmp_path))
    return target


def test_a_drafter_check_sees_a_target_plugin_loaded_by_the_config(my_llama):
    ov = {"model": {"model": str(my_llama), "draft_model": str(FIX / "drafter_default")},
          "draft": {"block_size": 3}, "plugins": {"load": ["my_llama_plugin"]}}
    s = load_session(load_config(overrides=ov))
    assert type(s.target).__name__ == "MyLlama" and s.draft_kind == "eagle3"
    plain = load_session(load_config(overrides={"model": {"model": str(FIX / "target"), "draft_model": None}}))
    assert generate(s, IDS, max_tokens=12).tokens == generate(plain, IDS, max_tokens=12).tokens
