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
    assert len(generate(s, IDS, max_tokens=6).tokens) == 6 and s.stats.drafts > 0


def test_register_hooks_are_historic_so_a_late_plugin_is_asked():
    from mtpflow import hookimpl
    from mtpflow.plugins import make_plugin_manager

    pm = make_plugin_manager(autoload=False)
    assert "late" not in pm.block_policies

    class Late:
        @hookimpl
        def mtpflow_register_block_policies(self, register):
            register("late", lambda config: None)

    pm.register(Late(), name="late-plugin")
    assert "late" in pm.block_policies and pm.block_policies.owner("late") == "late-plugin"
    assert {"name": "late-plugin", "version": "unknown", "hooks": ["mtpflow_register_block_policies"],
            "registered": {"block_policies": ["late"]}} in pm.describe()
    pm.pm.register(type("Raw", (), {"mtpflow_register_samplers": hookimpl(lambda self, register: register("raw", dict))})())
    assert "raw" in pm.samplers  # pluggy's own register applies the history too


def test_a_late_plugin_whose_registration_fails_is_removed():
    from mtpflow import hookimpl
    from mtpflow.plugins import PluginError, make_plugin_manager

    pm = make_plugin_manager(autoload=False)

    class Dup:
        @hookimpl
        def mtpflow_register_samplers(self, register):
            register("mine", dict)
            register("greedy", dict)

    with pytest.raises(PluginError, match="'dup' registers samplers 'greedy', already registered by plugin 'samplers'"):
        pm.register(Dup(), name="dup")
    assert "mine" not in pm.samplers and not pm.pm.has_plugin("dup")


def test_a_plugin_with_no_hooks_gets_a_warning(tmp_path, monkeypatch):
    from mtpflow.plugins import make_plugin_manager

    (tmp_path / "classy_plugin.py").write_text(
        "from mtpflow.api import hookimpl\n\n\nclass Plugin:\n    @hookimpl\n"
        "    def mtpflow_register_samplers(self, register):\n        register('classy', dict)\n"
    )
    (tmp_path / "empty_plugin.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(UserWarning, match="'classy_plugin' implements no mtpflow hook .*methods of a class"):
        pm = make_plugin_manager(["classy_plugin"], autoload=False)
    assert "classy" not in pm.samplers
    with pytest.warns(UserWarning, match="'empty_plugin' implements no mtpflow hook .*module-level functions"):
        make_plugin_manager(["empty_plugin"], autoload=False)


def test_a_head_on_a_kind_without_heads_is_an_error_before_loading():
    from conftest import make_session

    from mtpflow.engine import LoadError

    with pytest.raises(LoadError, match=r"^\[draft\] head = 'centroid': drafter kind 'ngram' has no LM head to replace"):
        make_session("e", with_drafter=False, model={"draft_kind": "ngram"}, draft={"head": "centroid"})


def test_a_dense_head_on_a_centroid_checkpoint_names_the_head_mismatch():
    from conftest import make_session

    from mtpflow.engine import LoadError

    with pytest.raises(LoadError, match=r"head 'tied_dense' does not fit .*pair_e/drafter: the checkpoint was trained "
                                        r"with the 'centroid' head") as info:
        make_session("e", draft={"head": "tied_dense"})
    assert "\n" not in str(info.value)


def test_only_a_sampler_that_declares_tree_support_verifies_trees():
    from mtpflow import api
    from mtpflow.engine import Session

    class Tree:
        def propose_tree(self, session, state, shared, shape):
            pass

    class Plain:  # the Sampler protocol, not a subclass of a built-in sampler
        def prepare(self, rows, vocab_size): ...
        def first(self, logits, state): ...
        def accept(self, logits, draft, state): ...

    class Careful(Plain):
        def supports_trees(self, state):
            return state == "ok"

    def session(drafter, sampler):
        return Session(config=None, plugins=None, target=None, drafter=drafter, sampler=sampler)

    assert not session(Tree(), Plain()).trees_supported("ok")
    assert session(Tree(), Careful()).trees_supported("ok") and not session(Tree(), Careful()).trees_supported("no")
    assert not session(object(), Careful()).trees_supported("ok")
    assert api.capabilities(Careful()) == ["TreeSampler"] and api.capabilities(Tree()) == ["TreeDrafter"]
    assert api.has(api.RejectionSampler(load_config()), api.TreeSampler)


def test_the_stats_line_and_json_name_what_ran(capsys):
    from conftest import FIXTURES

    from mtpflow.cli import main

    pair = FIXTURES / "pair_e"
    argv = ["generate", "--model", str(pair / "target"), "--draft-model", str(pair / "drafter"), "--prompt", "hi",
            "--max-tokens", "4"]
    capsys.readouterr()
    assert main(argv + ["--json"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert {k: stats[k] for k in ("draft_kind", "head", "sampler", "block_policy", "batch_policy")} == {
        "draft_kind": "mtp", "head": "centroid", "sampler": "rejection", "block_policy": "adaptive",
        "batch_policy": "static"}
    assert main(argv[:3] + argv[5:] + ["--draft-kind", "ngram", "--draft-block-size", "3"]) == 0
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "drafter ngram, sampler rejection, policy fixed, batch static" in line and "head" not in line
