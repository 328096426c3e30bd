"""The plugin API as a third-party author meets it: mtpflow.api, protocols as the
one source of truth, every kind selectable by name, settings tables, mlx-lm
logits processors, the documented examples, and the example packages."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import FIXTURES, RoundLog, make_session, reference

from mtpflow import api, hookspecs
from mtpflow.config import ConfigError, load_config
from mtpflow.engine import generate, generate_stream, load_session, make_request
from mtpflow.plugins import PluginError, make_plugin_manager
from mtpflow.state import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
IDS = list(range(5, 30))


# --------------------------------------------------------------------------------------
# the protocols are the one source of truth
# --------------------------------------------------------------------------------------
def test_every_registry_hook_has_a_kind_and_names_its_protocol_members():
    hooks = sorted(n[len("mtpflow_register_"):] for n in vars(hookspecs) if n.startswith("mtpflow_register_"))
    assert hooks == sorted(api.KINDS)
    docs = (ROOT / "docs" / "plugins.md").read_text()
    for kind, spec in api.KINDS.items():
        doc = getattr(hookspecs, f"mtpflow_register_{kind}").__doc__
        protos = {p for p in (spec.registered, spec.built) if p is not None}
        for proto in protos:
            assert f"mtpflow.api.{proto.__name__}" in doc, (kind, proto)
            assert f"`api.{proto.__name__}`" in docs, (kind, proto)
            for member in api.protocol_members(proto):
                if member not in ("__call__",):
                    assert member in doc, f"mtpflow_register_{kind} does not document {proto.__name__}.{member}"


def test_hooks_reference_is_generated_from_the_specs():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_hooks_doc.py"), "--check"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_api_exports_what_plugins_need():
    for name in ("hookimpl", "Sampler", "LMHead", "Drafter", "BlockPolicy", "BatchPolicy", "Target", "LogitsProcessor",
                 "DraftBlock", "RowState", "RoundRecord", "RejectionSampler", "TiedDenseHead", "TargetAdapter",
                 "AdaptiveBlockPolicy", "IncompatibleDrafter", "process_logits"):
        assert getattr(api, name) is not None, name
    assert api.protocol_members(api.BatchPolicy) == ["joins_between_rounds", "admit"]
    assert api.protocol_members(api.Drafter) == ["model_types", "needs", "load", "propose"]


def _register(kind, name, obj):
    class P:
        pass

    def hook(self, register):
        register(name, obj)

    setattr(P, f"mtpflow_register_{kind}", api.hookimpl(hook))
    return P()


def test_registration_and_built_objects_are_checked_against_the_protocols():
    with pytest.raises(PluginError, match=r"lacks required attribute\(s\) argmax, support \(see mtpflow.api.LMHead\)"):
        make_plugin_manager([_register("lm_heads", "half", type("H", (), {"from_config": classmethod(lambda c, *a, **k: c()),
                                                                         "__call__": lambda s, x, E=None: x}))], autoload=False)
    bad_needs = type("D", (), {"model_types": (), "needs": frozenset({"everything"}), "load": classmethod(lambda *a: None),
                               "propose": lambda *a: None})
    with pytest.raises(PluginError, match=r"needs holds 'everything'"):
        make_plugin_manager([_register("drafters", "greedy-eyes", bad_needs)], autoload=False)
    with pytest.raises(PluginError, match="lacks required attribute"):
        make_plugin_manager([_register("samplers", "not-callable", 3)], autoload=False)

    class NoJoins:  # no joins_between_rounds: the built object does not satisfy BatchPolicy
        def __init__(self, config):
            pass

        def admit(self, waiting, live, started):
            return waiting

    pm = make_plugin_manager([_register("batch_policies", "nojoins", NoJoins)], autoload=False)
    with pytest.raises(PluginError, match=r"built an object lacking joins_between_rounds \(see mtpflow.api.BatchPolicy\)"):
        make_session("e", plugins=pm, batch={"policy": "nojoins"})


# --------------------------------------------------------------------------------------
# names resolve before any weight loads
# --------------------------------------------------------------------------------------
@pytest.fixture
def broken_weights(tmp_path):
    """pair_e with unreadable target safetensors: any weight read fails."""
    import shutil

    dst = tmp_path / "target"
    shutil.copytree(FIXTURES / "pair_e" / "target", dst)
    (dst / "model.safetensors").write_bytes(b"not safetensors")
    return dst


@pytest.mark.parametrize("section, key, value, message", [
    ("sampling", "sampler", "nope", "unknown sampler 'nope'"),
    ("draft", "head", "nope", "unknown lm head 'nope'"),
    ("draft", "policy", "nope", "unknown block policy 'nope'"),
    ("batch", "policy", "nope", "unknown batch policy 'nope'"),
    ("plugins", "nope", {"x": 1}, r"\$.plugins.nope: no plugin registered 'nope'"),
])
def test_names_and_settings_are_checked_before_weights_load(broken_weights, section, key, value, message):
    cfg = load_config(overrides={"model": {"model": str(broken_weights), "draft_model": str(FIXTURES / "pair_e" / "drafter")},
                                 section: {key: value}})
    with pytest.raises((PluginError, ConfigError), match=message):
        load_session(cfg)


# --------------------------------------------------------------------------------------
# LM heads are selectable by name
# --------------------------------------------------------------------------------------
class ScaledHead(api.TiedDenseHead):
    """A third-party head with settings: the tied dense head's logits times ``scale``."""

    import attrs as _attrs

    @_attrs.frozen
    class Settings:
        scale: float = 1.0

    settings = Settings
    built: list = []

    @classmethod
    def from_config(cls, config, vocab_size, hidden_size, **context):
        h = cls()
        h.scale = context["settings"].scale
        cls.built.append(h.scale)
        return h

    def __call__(self, x, E=None):
        return self.scale * super().__call__(x, E)

    def argmax(self, x, E=None):
        return mx.argmax(self(x, E), axis=-1).astype(mx.int32)


def test_a_third_party_head_is_selected_by_name_with_its_settings():
    pm = make_plugin_manager([_register("lm_heads", "scaled", ScaledHead)], autoload=False)
    base = make_session("d", block_size=4)
    ref = reference(base, IDS, 24)
    assert generate(base, IDS, max_tokens=24).tokens == ref
    cfg = lambda scale: load_config(overrides={  # noqa: E731
        "model": {"model": str(FIXTURES / "pair_d" / "target"), "draft_model": str(FIXTURES / "pair_d" / "drafter")},
        "draft": {"block_size": 4, "head": "scaled"}}, sets=[f"plugins.scaled.scale={scale}"])
    same = load_session(cfg(1.0), plugins=pm)
    assert type(same.drafter.model.head) is ScaledHead and ScaledHead.built[-1] == 1.0
    assert generate(same, IDS, max_tokens=24).tokens == ref
    assert same.stats.accepted_tokens == base.stats.accepted_tokens  # same argmax, same drafts
    flipped = load_session(cfg(-1.0), plugins=pm)  # the argmin: drafts change, the output does not
    assert generate(flipped, IDS, max_tokens=24).tokens == ref
    assert flipped.stats.accepted_tokens < base.stats.accepted_tokens


def test_the_generic_assistant_heads_are_registered_heads():
    from mtpflow.drafters.mtpflow_assistant.heads import OwnHead, TargetHead, TargetSubsetHead

    p = make_plugin_manager(autoload=False)
    assert p.lm_heads.get("target") is TargetHead and p.lm_heads.get("own") is OwnHead
    assert p.lm_heads.get("target_subset") is TargetSubsetHead
    s = load_session(load_config(overrides={"model": {"model": "smollm2-135m", "draft_model": "smollm2-135m-mtp"},
                                            "draft": {"block_size": 3}}))
    head = s.drafter.model.lm_head
    assert isinstance(head, TargetSubsetHead) and head.draft_vocab.shape == (8192,)
    ids, lg = head.support(mx.zeros((1, 576)))
    assert ids.shape == lg.shape == (1, 8192)


# --------------------------------------------------------------------------------------
# settings tables
# --------------------------------------------------------------------------------------
def _fixed_temp_cfg(**sets):
    return load_config(overrides={
        "model": {"model": str(FIXTURES / "pair_e" / "target"), "draft_model": str(FIXTURES / "pair_e" / "drafter")},
        "draft": {"block_size": 4}, "sampling": {"sampler": "fixed_temp"}, "plugins": {"load": ["mtpflow_fixed_temp"]}},
        sets=[f"plugins.fixed_temp.{k}={v}" for k, v in sets.items()])


@pytest.mark.parametrize("sets, message", [
    ({"temperature": 0}, r"\$.plugins.fixed_temp.temperature: must be > 0 \(got 0\.0\)"),
    ({"temperature": '"hot"'}, r"\$.plugins.fixed_temp.temperature: expected a number"),
    ({"bogus": 1}, r"\$.plugins.fixed_temp: unknown key\(s\) bogus"),
])
def test_plugin_settings_errors_carry_their_path(sets, message):
    with pytest.raises(ConfigError, match=message):
        load_session(_fixed_temp_cfg(**sets))


def test_settings_for_a_plugin_without_settings_is_an_error():
    cfg = load_config(overrides={"model": {"model": str(FIXTURES / "pair_e" / "target")}, "sampling": {"sampler": "greedy"}},
                      sets=["plugins.greedy.x=1"])
    with pytest.raises(ConfigError, match=r"\$.plugins.greedy: the plugin registered as 'greedy' takes no settings"):
        load_session(cfg)


def test_the_example_sampler_takes_its_temperature_from_its_table():
    s = load_session(_fixed_temp_cfg(temperature=0.7))
    plain = make_session("e", block_size=4)
    for seed in (1, 2, 3):
        got = generate(s, IDS, max_tokens=20, sampling=SamplingParams(temperature=0.0, seed=seed)).tokens
        want = generate(plain, IDS, max_tokens=20, sampling=SamplingParams(temperature=0.7, seed=seed)).tokens
        assert got == want, seed
    greedy = generate(plain, IDS, max_tokens=20).tokens
    assert any(generate(s, IDS, max_tokens=20, sampling=SamplingParams(seed=k)).tokens != greedy for k in range(3))


def test_set_on_the_command_line(capsys):
    from mtpflow.cli import main

    rc = main(["generate", "--model", str(FIXTURES / "pair_e" / "target"), "--prompt-ids", "5,6,7",
               "--set", "plugins.load=[\"mtpflow_fixed_temp\"]", "--set", "sampling.sampler=\"fixed_temp\"",
               "--set", "plugins.fixed_temp.temperature=0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "$.plugins.fixed_temp.temperature: must be > 0" in err[0], err


# --------------------------------------------------------------------------------------
# mlx-lm logits processors, as they are
# --------------------------------------------------------------------------------------
def _mlx_lm_processors(bias_token):
    from mlx_lm.sample_utils import make_logits_processors

    return make_logits_processors(logit_bias={bias_token: -1e9}, repetition_penalty=1.8, repetition_context_size=12)


def _mlx_lm_processors_plugin(bias_token):
    def factory(name):
        return lambda config: _mlx_lm_processors(bias_token)[name]

    class P:
        @api.hookimpl
        def mtpflow_register_logits_processors(self, register):
            register("mlx_bias", factory(0))
            register("mlx_rep", factory(1))

    return P()


def test_mlx_lm_processors_on_both_paths_equal_mlx_lm_itself():
    from mlx_lm.generate import generate_step

    plain = reference(make_session("e", block_size=1), IDS, 30)
    pm = make_plugin_manager([_mlx_lm_processors_plugin(plain[2])], autoload=False)
    outs = {}
    for block in (1, 5):
        s = make_session("e", block_size=block, plugins=pm, sampling={"processors": ["mlx_bias", "mlx_rep"]})
        outs[block] = generate(s, IDS, max_tokens=30).tokens
        if block == 5:
            assert s.stats.accepted_tokens > 0
    assert outs[1] == outs[5]
    assert outs[1][:2] == plain[:2] and outs[1] != plain  # the processors changed the text
    s = make_session("e", block_size=1)
    mine = []
    for tok, _ in generate_step(mx.array(IDS), s.target.model, max_tokens=30, logits_processors=_mlx_lm_processors(plain[2]),
                                sampler=lambda lp: mx.argmax(lp, axis=-1)):
        if int(tok) in s.target.eos_ids:
            break
        mine.append(int(tok))
    assert outs[1] == mine


def test_the_example_processor_with_settings_bans_its_ids():
    ref = reference(make_session("e", block_size=1), IDS, 24)
    banned = sorted(set(ref[:6]))
    for block in (1, 4):
        cfg = load_config(overrides={"model": {"model": str(FIXTURES / "pair_e" / "target"),
                                               "draft_model": str(FIXTURES / "pair_e" / "drafter")},
                                     "draft": {"block_size": block}, "sampling": {"processors": ["ban_tokens"]},
                                     "plugins": {"load": ["mtpflow_fixed_temp"], "ban_tokens": {"ids": banned}}})
        out = generate(load_session(cfg), IDS, max_tokens=24).tokens
        assert not set(out) & set(banned), block


# --------------------------------------------------------------------------------------
# drafters: needs are read, commit follows acceptance
# --------------------------------------------------------------------------------------
class CommitSpy:
    """A model-free drafter that declares it needs nothing and records its commits."""

    model_types = ()
    needs = frozenset()
    seen: list = []

    @classmethod
    def load(cls, path, target, options):
        return cls()

    def propose(self, session, state, shared, n_draft):
        self.kv = shared.kv
        return api.DraftBlock(tokens=mx.repeat(shared.last_tokens[:, None], n_draft, axis=1), n_draft=n_draft)

    def commit(self, session, state, accepted):
        CommitSpy.seen.append(list(accepted.counts))


def test_needs_are_read_and_commit_follows_every_acceptance():
    rounds = RoundLog()
    pm = make_plugin_manager([_register("drafters", "spy", CommitSpy), rounds], autoload=False)
    s = make_session("e", block_size=3, with_drafter=False, plugins=pm, model={"draft_kind": "spy"})
    CommitSpy.seen.clear()
    reqs = [make_request(s, IDS, max_tokens=16, request_id="a"), make_request(s, IDS[:9], max_tokens=12, request_id="b")]
    for _ in generate_stream(s, reqs):
        pass
    assert s.drafter.kv == {}  # needs nothing: no shared K/V was built
    assert CommitSpy.seen == [list(r.accepted) for r in rounds.records]


# --------------------------------------------------------------------------------------
# loading and listing
# --------------------------------------------------------------------------------------
def test_a_module_named_twice_or_already_installed_loads_once():
    p = make_plugin_manager(["mtpflow_fixed_temp", "mtpflow_fixed_temp"], autoload=False)
    assert "fixed_temp" in p.samplers
    p = make_plugin_manager(["mtpflow_fixed_temp"], autoload=True)  # also found through its entry point
    assert p.samplers.owner("fixed_temp") in ("fixed_temp", "mtpflow_fixed_temp")


def test_plugins_command_shows_what_each_plugin_registered():
    import os

    env = {k: v for k, v in os.environ.items() if k != "MTPFLOW_DISABLE_PLUGIN_AUTOLOAD"}
    out = subprocess.run([sys.executable, "-m", "mtpflow.cli", "plugins"], capture_output=True, text=True, env=env, check=True)
    plugins = {p["name"]: p for p in json.loads(out.stdout)}
    assert plugins["fixed_temp"]["registered"] == {"logits_processors": ["ban_tokens"], "samplers": ["fixed_temp"]}
    assert plugins["echo"]["registered"] == {"drafters": ["echo"]}
    assert "centroid" in plugins["heads"]["registered"]["lm_heads"]
