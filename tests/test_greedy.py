"""Greedy speculative output equals target-only greedy output."""

import random

import mlx.core as mx
import pytest
from conftest import RoundLog, make_session, prompt, reference
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mtpflow import hookimpl
from mtpflow.engine import generate, generate_stream, make_request, target_only_greedy
from mtpflow.plugins import make_plugin_manager
from mtpflow.state import DraftBlock


@pytest.fixture(scope="module")
def sessions():
    return {pair: make_session(pair) for pair in "ed"}


_refs = {}  # sessions reused across hypothesis examples


def run(session, ids, max_tokens, block_size=None, stop_ids=None):
    if block_size is not None:
        session.block_policy.size = block_size
    req = make_request(session, ids, max_tokens=max_tokens)
    if stop_ids is not None:
        req.stop_ids = frozenset(stop_ids)
    session.reset_stats()
    events = list(generate_stream(session, [req]))
    return [t for ev in events for t in ev.tokens], events[-1]


@pytest.mark.parametrize("pair", ["e", "d"])
@pytest.mark.parametrize("block_size", range(1, 9))
def test_every_block_size_matches_target_only(sessions, pair, block_size):
    s = sessions[pair]
    for name in ("short", "long"):  # "long" is 40 tokens: past the 16-token sliding window
        ids = prompt(pair, name)
        out, last = run(s, ids, 40, block_size)
        assert out == reference(s, ids, 40)
        assert last.finish_reason == "length"
    if block_size > 1:
        assert s.stats.draft_tokens > 0
    assert s.stats.syncs == s.stats.rounds  # one host sync per round


def test_long_generation_rolls_the_sliding_window_many_times(sessions):
    s = sessions["e"]
    ids = prompt("e", "long") * 3  # 120 tokens, 7x the window
    out, _ = run(s, ids, 120, 6)
    assert out == reference(s, ids, 120)
    sliding = [c for c in s.target.make_cache() if c.window is not None]
    assert sliding  # the check above went through sliding layers


@pytest.mark.parametrize("max_tokens", range(1, 13))
def test_max_tokens_ending_mid_block(sessions, max_tokens):
    s = sessions["e"]
    ids = prompt("e", "long")
    out, last = run(s, ids, max_tokens, 5)
    assert out == reference(s, ids, 40)[:max_tokens]
    assert last.finish_reason == "length" and last.finished


def test_eos_inside_a_block_is_cut_there():
    log = RoundLog()
    s = make_session("e", block_size=5, plugins=make_plugin_manager([log]))
    ids = prompt("e", "long")
    ref = reference(s, ids, 40)
    # a stop token the drafter gets right in the middle of an accepted block
    stop = ref[6]
    out, last = run(s, ids, 40, stop_ids={stop})
    assert out == ref[: ref.index(stop)]
    assert last.finish_reason == "stop"
    final = log.records[-1]
    assert final.accepted[0] + 1 > final.emitted[0]  # tokens after EOS in the block were dropped


def test_echo_drafter_plugin_partial_full_and_rollback():
    """The example third-party plugin drafts the token it was fed; the
    reference target of pair d repeats itself, so rounds accept 0, some or all."""
    log = RoundLog()
    pm = make_plugin_manager(["mtpflow_echo", log])
    s = make_session("d", block_size=4, with_drafter=False, plugins=pm, model={"draft_kind": "echo"})
    assert s.draft_kind == "echo"
    for name in ("short", "edge"):
        ids = prompt("d", name)
        out, _ = run(s, ids, 40)
        assert out == reference(s, ids, 40)
    accepted = {r.accepted[0] for r in log.records if r.drafted == 3}
    assert 0 in accepted and 3 in accepted and accepted & {1, 2}


class ScriptedDrafter:
    """Proposes the true continuation corrupted at random places: every mix of
    right and wrong drafts, chosen by hypothesis through ``seed``."""

    model_types = ()
    needs = frozenset()
    truth: list = []
    seed = 0
    wrong_rate = 0.3

    @classmethod
    def load(cls, path, target, options):
        inst = cls()
        inst.rng = random.Random(cls.seed)
        return inst

    def propose(self, session, state, shared, n_draft):
        row = state.rows[0]
        done = len(row.generated)
        out = []
        for i in range(n_draft):
            j = done + i
            tok = self.truth[j] if j < len(self.truth) else 0
            if self.rng.random() < self.wrong_rate:
                tok = self.rng.randrange(session.target.vocab_size)
            out.append(tok)
        return DraftBlock(tokens=mx.array([out], dtype=mx.int32), n_draft=n_draft)


class ScriptedPlugin:
    @hookimpl
    def mtpflow_register_drafters(self, register):
        register("scripted", ScriptedDrafter)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 10**6), wrong=st.sampled_from([0.0, 0.1, 0.5, 1.0]), block=st.integers(2, 8))
def test_any_proposals_leave_greedy_output_unchanged(seed, wrong, block):
    if "scripted" not in _refs:
        pm = make_plugin_manager([ScriptedPlugin()])
        _refs["scripted"] = make_session("e", with_drafter=False, plugins=pm, model={"draft_kind": "scripted"})
    s = _refs["scripted"]
    assert s.draft_kind == "scripted"
    s.block_policy.size = block
    ids = prompt("e", "edge")
    ref = reference(s, ids, 30)
    ScriptedDrafter.truth, ScriptedDrafter.seed, ScriptedDrafter.wrong_rate = ref, seed, wrong
    s.drafter = ScriptedDrafter.load(None, s.target, None)
    out, _ = run(s, ids, 30)
    assert out == ref
    if wrong == 0.0:
        assert s.stats.acceptance_rate > 0.9


@pytest.mark.parametrize("like", ["e", "d"])
def test_random_checkpoints_both_heads_and_both_target_layouts(tmp_path, like):
    from tiny import as_multimodal, as_per_layer_config, random_pair

    from mtpflow.config import load_config
    from mtpflow.engine import load_session

    tpath, dpath = random_pair(tmp_path, seed=3, like=like, centroid=(like == "d"))  # swap heads vs fixtures
    ids = list(range(5, 45))  # 40 tokens > the window of 16
    outs = []
    for target in (tpath, as_multimodal(tpath, tmp_path / "mm"), as_per_layer_config(tpath, tmp_path / "plc")):
        for block in (2, 4, 6):
            cfg = load_config(overrides={"model": {"model": str(target), "draft_model": str(dpath)}, "draft": {"block_size": block}})
            s = load_session(cfg)
            outs.append(generate(s, ids, max_tokens=24).tokens)
    ref = target_only_greedy(s.target, ids, 24, s.target.eos_ids)
    assert all(o == ref for o in outs)
    assert s.target.config["model_type"] == "gemma4_text"
