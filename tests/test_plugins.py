"""Plugin loading, registries and every stage hook."""

import subprocess
import sys
import tomllib
import types
import warnings
from pathlib import Path

import pytest
from conftest import make_session

from mtpflow import hookimpl, hookspecs
from mtpflow.engine import generate, target_only_greedy
from mtpflow.plugins import BUILTIN_PLUGINS, PluginError, make_plugin_manager

ROOT = Path(__file__).parent.parent
STAGES = ["mtpflow_prefill", "mtpflow_bind_shared_kv", "mtpflow_draft_block", "mtpflow_verify",
          "mtpflow_accept", "mtpflow_advance", "mtpflow_emit", "mtpflow_round_protocol"]


def test_builtins_are_the_entry_point_group():
    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["mtpflow"]
    assert eps == BUILTIN_PLUGINS


def test_registries_hold_the_builtins_with_owners():
    p = make_plugin_manager(autoload=False)
    assert p.lm_heads.names() == ["centroid", "own", "target", "target_subset", "tied_dense"]
    assert {"greedy", "rejection"} <= set(p.samplers.names())
    assert "mtp" in p.drafters
    assert {"static", "continuous"} <= set(p.batch_policies.names())
    assert "fixed" in p.block_policies
    assert {"gemma4", "gemma4_text"} <= set(p.targets.names())
    assert p.lm_heads.owner("centroid") == "heads"
    with pytest.raises(PluginError, match="unknown lm head 'nope'"):
        p.lm_heads.get("nope")


def test_duplicate_and_incomplete_registrations_fail_naming_the_plugin():
    from mtpflow.drafters.gemma4_assistant.heads import TiedDenseHead

    class Dup:
        @hookimpl
        def mtpflow_register_lm_heads(self, register):
            register("tied_dense", TiedDenseHead)

    with pytest.raises(PluginError, match=r"registers lm_heads 'tied_dense', already registered by plugin 'heads'"):
        make_plugin_manager([Dup()], autoload=False)

    class Broken:
        @hookimpl
        def mtpflow_register_drafters(self, register):
            register("half", types.SimpleNamespace(needs=frozenset()))

    with pytest.raises(PluginError, match=r"drafters .half. lacks required attribute\(s\) model_types, load, propose"):
        make_plugin_manager([Broken()], autoload=False)


def test_unknown_hook_and_unimportable_config_plugin_are_errors():
    class Typo:
        @hookimpl
        def mtpflow_draft_blok(self, session):
            pass

    with pytest.raises(PluginError, match="unknown hook"):
        make_plugin_manager([Typo()], autoload=False)
    with pytest.raises(PluginError, match="'no_such_plugin_mod' named in the config could not be imported"):
        make_plugin_manager(["no_such_plugin_mod"], autoload=False)


class FakeEP:
    def __init__(self, name, value, load):
        self.name, self.value, self._load, self.dist = name, value, load, None

    def load(self):
        return self._load()


def _good_plugin():
    mod = types.ModuleType("goodplug")

    @hookimpl
    def mtpflow_register_samplers(register):
        register("goodsampler", lambda config: None)

    mod.mtpflow_register_samplers = mtpflow_register_samplers
    return mod


def test_autoload_allow_block_lists_and_broken_plugins(monkeypatch):
    from mtpflow import plugins as P

    def boom():
        raise ImportError("missing dependency xyz")

    monkeypatch.setattr(P, "_entry_points", lambda: [FakeEP("good", "goodplug", _good_plugin), FakeEP("bad", "badplug", boom)])
    with pytest.warns(UserWarning, match="'bad' failed to load and was skipped: missing dependency xyz"):
        p = make_plugin_manager(autoload=True)
    assert "goodsampler" in p.samplers and p.samplers.owner("goodsampler") == "good"

    monkeypatch.setenv("MTPFLOW_PLUGINS", "bad")
    monkeypatch.setenv("MTPFLOW_BLOCK_PLUGINS", "bad")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p = make_plugin_manager(autoload=True)
    assert "goodsampler" not in p.samplers  # not allowed; 'bad' blocked

    monkeypatch.delenv("MTPFLOW_PLUGINS")
    monkeypatch.setenv("MTPFLOW_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert "goodsampler" not in make_plugin_manager().samplers


def test_plugins_command_lists_the_installed_example(tmp_path):
    env = {k: v for k, v in __import__("os").environ.items() if k != "MTPFLOW_DISABLE_PLUGIN_AUTOLOAD"}
    out = subprocess.run([sys.executable, "-m", "mtpflow.cli", "plugins"], capture_output=True, text=True, env=env, check=True)
    import json

    plugins = {p["name"]: p for p in json.loads(out.stdout)}
    assert "echo" in plugins, "install the example: pip install -e plugins/mtpflow-echo"
    assert plugins["echo"]["version"] == "0.1.0"
    assert set(plugins["echo"]["hooks"]) == {"mtpflow_register_drafters", "mtpflow_emit"}
    assert "mtpflow_round_protocol" in plugins["stages"]["hooks"]


class StageSpy:
    """Wraps every stage hook and counts its calls."""

    def __init__(self):
        self.calls = {h: 0 for h in STAGES}


def _spy_method(hook):
    if hook == "mtpflow_emit":
        def f(self, session, record, emitted):
            self.calls[hook] += 1
        return hookimpl(f)

    def w(self, **kwargs):
        self.calls[hook] += 1
        return (yield)

    return hookimpl(wrapper=True)(w)


for _h in STAGES:
    setattr(StageSpy, _h, _spy_method(_h))


def test_every_stage_hook_runs_once_per_round():
    import inspect

    spy = StageSpy()
    for h in STAGES:  # pluggy needs the real argument names
        params = list(inspect.signature(getattr(hookspecs, h)).parameters)
        orig = getattr(StageSpy, h)
        if h != "mtpflow_emit":
            src = f"def {h}(self, {', '.join(params)}):\n    self.calls[{h!r}] += 1\n    return (yield)\n"
            ns = {}
            exec(src, ns)
            setattr(StageSpy, h, hookimpl(wrapper=True)(ns[h]))
        del orig
    spy = StageSpy()
    s = make_session("e", block_size=4, plugins=make_plugin_manager([spy], autoload=False))
    res = generate(s, list(range(5, 25)), max_tokens=20)
    rounds = s.stats.rounds
    assert rounds > 1 and len(res.tokens) == 20
    assert spy.calls["mtpflow_prefill"] == 1
    for h in ("mtpflow_verify", "mtpflow_accept", "mtpflow_advance", "mtpflow_emit", "mtpflow_round_protocol"):
        assert spy.calls[h] == rounds, h
    drafting = s.stats.drafts  # rows x rounds with drafts (batch 1)
    assert spy.calls["mtpflow_bind_shared_kv"] == spy.calls["mtpflow_draft_block"] == drafting


class RejectAll:
    """Overrides the accept stage (tryfirst): accept nothing, emit the target's token."""

    @hookimpl(tryfirst=True)
    def mtpflow_accept(self, session, state, draft, verify):
        import mlx.core as mx

        from mtpflow.state import AcceptResult

        tokens = mx.argmax(verify.logits, axis=-1).astype(mx.int32)
        return AcceptResult(counts=mx.zeros((state.size,), dtype=mx.int32), tokens=tokens)


def test_a_plugin_can_replace_a_stage():
    s = make_session("e", block_size=4, plugins=make_plugin_manager([RejectAll()], autoload=False))
    ids = list(range(5, 25))
    res = generate(s, ids, max_tokens=12)
    assert s.stats.accepted_tokens == 0 and s.stats.rounds == 11  # + the prefill token
    assert res.tokens == target_only_greedy(s.target, ids, 12, s.target.eos_ids)


def test_import_mtpflow_is_light():
    code = ("import sys, mtpflow, mtpflow.hookspecs, mtpflow.config, mtpflow.state, mtpflow.api, mtpflow.engine; "
            "print('mlx' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


class PolicyPlugin:
    """Registers a block policy and a batch policy, as a third party would."""

    class TwoThenThree:
        def __init__(self, config):
            self.n = 0

        def block_size(self, stats):
            return 2 if stats.rounds % 2 == 0 else 3

        def observe(self, record):
            self.n += 1

    class OneAtATime:
        joins_between_rounds = False

        def __init__(self, config):
            pass

        def admit(self, waiting, live, started):
            return [] if started else waiting[:1]

    @hookimpl
    def mtpflow_register_block_policies(self, register):
        register("two-then-three", self.TwoThenThree)

    @hookimpl
    def mtpflow_register_batch_policies(self, register):
        register("one-at-a-time", self.OneAtATime)


def test_registered_block_and_batch_policies_are_used():
    from mtpflow.engine import generate_stream, make_request

    log = []

    class Rec:
        @hookimpl
        def mtpflow_emit(self, session, record, emitted):
            log.append((record.batch_size, record.block_size))

    pm = make_plugin_manager([PolicyPlugin(), Rec()], autoload=False)
    s = make_session("e", plugins=pm, draft={"policy": "two-then-three"}, batch={"policy": "one-at-a-time"})
    reqs = [make_request(s, list(range(5, 15 + i)), max_tokens=9, request_id=str(i)) for i in range(3)]
    out = {}
    for ev in generate_stream(s, reqs):
        out.setdefault(ev.request_id, []).extend(ev.tokens)
    assert {b for b, _ in log} == {1}  # never batched together
    assert [k for _, k in log][:4] == [2, 3, 2, 3]
    for r in reqs:
        assert out[r.id] == target_only_greedy(s.target, r.prompt, 9, s.target.eos_ids)


def test_registered_target_adapter_serves_a_new_model_type(tmp_path):
    import json
    import shutil

    from conftest import FIXTURES

    from mtpflow.config import load_config
    from mtpflow.engine import LoadError, load_session
    from mtpflow.targets.gemma4 import Gemma4Target

    src = FIXTURES / "pair_e" / "target"
    dst = tmp_path / "alias"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["model_type"] = "my_gemma4_fork"
    (dst / "config.json").write_text(json.dumps(cfg))
    conf = load_config(overrides={"model": {"model": str(dst)}})
    with pytest.raises(LoadError, match="unsupported target model_type 'my_gemma4_fork'"):
        load_session(conf, plugins=make_plugin_manager(autoload=False))

    class Fork:
        @hookimpl
        def mtpflow_register_targets(self, register):
            register("my_gemma4_fork", Gemma4Target)

    s = load_session(conf, plugins=make_plugin_manager([Fork()], autoload=False))
    assert generate(s, list(range(5, 20)), max_tokens=5).tokens == target_only_greedy(s.target, list(range(5, 20)), 5)
