"""DFlash block drafters (``dflash``): z-lab's checkpoint format, numerically
z-lab's torch reference (tests/fixtures/dflash, tools/make_dflash_fixtures.py),
its ``dflash_generate`` reproduced round by round, losslessly in every batching mode."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import RoundLog, drive_with_late_joiners

from mtpflow.config import load_config
from mtpflow.engine import LoadError, generate_stream, load_session, make_request, target_only_greedy
from mtpflow.errors import IncompatibleDrafter
from mtpflow.plugins import make_plugin_manager

FIX = Path(__file__).parent / "fixtures" / "dflash"
TARGET, DRAFTER = FIX / "target", FIX / "drafter"
PROMPTS = ("short", "medium", "long")
TOL = 1e-4

_sessions: dict = {}


def session(block: int = 4, log: RoundLog | None = None, **over):
    key = (block, id(log), json.dumps(over, sort_keys=True))
    if key not in _sessions:
        ov = {"model": {"model": str(TARGET), "draft_model": str(DRAFTER)}, "draft": {"block_size": block}}
        for k, v in over.items():
            ov.setdefault(k, {}).update(v)
        pm = make_plugin_manager([log], autoload=False) if log is not None else None
        _sessions[key] = load_session(load_config(overrides=ov), plugins=pm)
    return _sessions[key]


class _Feat:
    """The drafter-facing part of a batch state: features and positions."""

    def __init__(self, drafter, feats, start):
        n = len(drafter.cfg.taps)
        w = feats.shape[-1] // n
        self.taps = {t: mx.array(feats[None, :, i * w : (i + 1) * w]) for i, t in enumerate(drafter.cfg.taps)}
        self.fwd_positions = mx.arange(start, start + feats.shape[0], dtype=mx.int32)[None]


def _block(drafter, caches, block_ids, start):
    L = len(block_ids)
    x = drafter.target.inner.embed_tokens(mx.array([block_ids], dtype=mx.int32))
    q = mx.array([list(range(start, start + L))], dtype=mx.int32)
    kv = [c.view()[:2] for c in caches]
    hidden = drafter.model.block(x, mx.array([start], dtype=mx.int32), kv, drafter._masks(caches, q))
    return hidden, drafter.target.logits(hidden[:, 1:])


def test_config_loads_as_z_lab_writes_it():
    s = session()
    d = s.drafter
    assert s.draft_kind == "dflash" and d.cfg.block_size == 8 and d.cfg.mask_token_id == 3
    assert d.cfg.target_layer_ids == (1, 3, 4) and d.needs == {"layer:2", "layer:4", "layer:5"}  # outputs of 1, 3, 4
    assert [layer.window for layer in d.model.layers] == [8, None] and [layer.causal for layer in d.model.layers] == [True, False]
    feats = np.load(FIX / "target_long.npz")["features"]
    _, _, taps = s.target.prefill([np.load(FIX / "target_long.npz")["input_ids"].tolist()], taps=s.tap_layers)
    mine = np.array(mx.concatenate([taps[t] for t in d.cfg.taps], axis=-1)[0])
    assert np.abs(mine - feats).max() < TOL


@pytest.mark.parametrize("block", [4, 8])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_block_logits_and_hidden_equal_z_labs(prompt, block):
    d = session().drafter
    ref = np.load(FIX / f"drafter_{prompt}.npz")
    caches = d._new_caches()
    start = 0
    for r in (0, 1):
        p = f"bs{block}_r{r}_"
        ctx = ref[p + "ctx_new"]
        d._take_in(caches, _Feat(d, ctx, start))
        start += ctx.shape[0]
        assert int(ref[p + "position_ids"][-len(ref[p + "block_ids"])]) == start
        hidden, logits = _block(d, caches, ref[p + "block_ids"].tolist(), start)
        assert np.abs(np.array(hidden[0]) - ref[p + "hidden"]).max() < TOL, (r, "hidden")
        if r == 0:
            assert np.abs(np.array(logits[0]) - ref[p + "logits"]).max() < TOL
        drafted = np.array(mx.argmax(logits[0], axis=-1)).tolist()
        assert drafted == ref[p + "drafted"].tolist(), r
        top = np.take_along_axis(np.array(logits[0]), ref[p + "logits_top8_ids"], axis=-1)
        assert np.abs(top - ref[p + "logits_top8_values"]).max() < TOL


class DraftSpy(RoundLog):
    """Round records plus every block the drafter proposed."""


@pytest.mark.parametrize("block", [4, 8])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_run_reproduces_dflash_generate_round_by_round(prompt, block):
    g = json.loads((FIX / f"generate_{prompt}.json").read_text())
    ref = g["dflash"][str(block)]
    log = RoundLog()
    s = session(block, log)
    drafts = []
    orig = s.drafter.propose

    def spy(session_, state, shared, n):
        out = orig(session_, state, shared, n)
        drafts.append((int(state.positions[0]), np.array(out.tokens[0]).tolist()))
        return out

    s.drafter.propose = spy
    try:
        log.records.clear()
        req = make_request(s, g["prompt_ids"], max_tokens=g["max_new_tokens"])
        req.stop_ids = frozenset()  # EOS disabled, as in the reference
        out = [t for ev in generate_stream(s, [req]) for t in ev.tokens]
    finally:
        del s.drafter.propose
    assert out == ref["output_new_tokens"] == g["target_greedy"]
    assert [r.produced_tokens[0] for r in log.records] == ref["acceptance_lengths"]
    assert drafts == [(r["start"], r["drafted"]) for r in ref["rounds"]]  # every round's block, every draft


def _prompt(name):
    return json.loads((FIX / f"generate_{name}.json").read_text())["prompt_ids"]


@pytest.mark.parametrize("block", [2, 5, 8])
def test_ragged_batches_equal_target_only(block):
    s = session(block)
    ps, ms = [_prompt("long"), _prompt("short"), _prompt("medium")], [30, 12, 21]
    reqs = [make_request(s, p, max_tokens=m, request_id=str(i)) for i, (p, m) in enumerate(zip(ps, ms))]
    got = {r.id: [] for r in reqs}
    for ev in generate_stream(s, reqs):
        got[ev.request_id].extend(ev.tokens)
    for r in reqs:
        assert got[r.id] == target_only_greedy(s.target, r.prompt, r.max_tokens, s.target.eos_ids), r.id
    assert s.stats.accepted_tokens > 0


def test_continuous_batching_with_late_joiners():
    s = session(8, batch={"policy": "continuous", "max_batch_size": 2})
    first = [make_request(s, _prompt("long"), max_tokens=24, request_id="a"), make_request(s, _prompt("short"), max_tokens=5, request_id="b")]
    late = [make_request(s, _prompt("medium"), max_tokens=18, request_id="c"), make_request(s, _prompt("short")[:3], max_tokens=9, request_id="d")]
    out = drive_with_late_joiners(s, first, late, join_after=2, max_live=2)
    for r in first + late:
        assert out[r.id] == target_only_greedy(s.target, r.prompt, r.max_tokens, s.target.eos_ids), r.id


def test_default_policy_may_use_the_checkpoints_whole_block():
    s = load_session(load_config(overrides={"model": {"model": str(TARGET), "draft_model": str(DRAFTER)}}))
    assert (s.config.draft.policy, s.config.draft.block_size, s.config.draft.max_block_size) == ("adaptive", 8, 8)


def test_sampling_is_lossless_with_a_dflash_drafter():
    from test_sampling_engine import empirical, exact_joint, tv, tv_bound

    from mtpflow.state import SamplingParams

    s = session(4, batch={"max_batch_size": 4000})
    prompt = _prompt("short")
    P = exact_joint(s.target, SamplingParams(temperature=0.8, top_k=8), 2, prompt)
    P_wrong = exact_joint(s.target, SamplingParams(temperature=0.8, top_k=6), 2, prompt)
    s.reset_stats()
    Q = empirical(s, lambda seed: SamplingParams(temperature=0.8, top_k=8, seed=seed), 2, prompt, n=8000, chunk=4000)
    assert s.stats.accepted_tokens > 0.1 * 8000  # the drafter is often right: the accept path runs
    bound = tv_bound(P, 8000)
    assert len(P) <= 64 and tv(P, Q) < bound
    assert tv(P_wrong, Q) > bound  # the test can fail: a slightly different distribution is far off


# --------------------------------------------------------------------------------------
# bad input: one line, before any weight is read
# --------------------------------------------------------------------------------------
def _edited(tmp_path, edit):
    dst = tmp_path / "d"
    shutil.copytree(DRAFTER, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    (dst / "model.safetensors").write_bytes(b"not read")  # any weight read would fail differently
    return dst


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.pop("dflash_config"), r"has no dflash_config"),
    (lambda c: c["dflash_config"].update(target_layer_ids=[1, 3, 6]), r"reads target layer 6 but the target has 6 layers"),
    (lambda c: c["dflash_config"].update(mask_token_id=5000), r"mask_token_id 5000 is outside the target's vocabulary"),
    (lambda c: c.update(hidden_size=32), r"hidden size 32"),
    (lambda c: c.update(num_target_layers=12), r"trained on a target with 12 layers"),
])
def test_bad_checkpoints_fail_in_one_line(tmp_path, edit, message):
    d = _edited(tmp_path, edit)
    with pytest.raises((IncompatibleDrafter, LoadError)) as ei:
        load_session(load_config(overrides={"model": {"model": str(TARGET), "draft_model": str(d), "draft_kind": "dflash"}}))
    assert len(str(ei.value).splitlines()) == 1 and re.search(message, str(ei.value)), str(ei.value)


def test_a_block_above_the_checkpoints_is_an_error(tmp_path):
    d = _edited(tmp_path, lambda c: None)
    with pytest.raises(LoadError, match=r"block size 9 is above the drafter's block_size 8; use --draft-block-size 8 or less"):
        load_session(load_config(overrides={"model": {"model": str(TARGET), "draft_model": str(d)}, "draft": {"block_size": 9}}))
