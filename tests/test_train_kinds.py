"""Training the eagle3 and dflash kinds (``mtpflow train --kind``): the
training forwards are the inference / reference forwards, training lowers the
loss, resumes exactly, and writes checkpoints the engine loads losslessly."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mtpflow.config import load_config
from mtpflow.engine import generate, load_session, target_only_greedy
from mtpflow.drafters.dflash.train import dflash_block_logits
from mtpflow.drafters.eagle3.train import ttt_logits
from mtpflow.train.run import train

FIX = Path(__file__).parent / "fixtures"
E3, DF = FIX / "eagle3", FIX / "dflash"


@pytest.mark.parametrize("drafter", ["drafter_default", "drafter_train"])
def test_eagle3_training_forward_is_speculators_ttt(drafter):
    s = load_session(load_config(overrides={"model": {"model": str(E3 / "target"), "draft_model": str(E3 / drafter)}}))
    d = s.drafter
    ref = np.load(E3 / drafter / "ref_long.npz")
    g = mx.array(ref["input_hidden_states"])[None]
    tok = mx.array(ref["input_ids"], dtype=mx.int32)[None]
    pos = mx.array(ref["position_ids"], dtype=mx.int32)[None]
    for j, lg in enumerate(ttt_logits(d.model, d.embed, g, tok, pos, 3, d.window)):
        valid = ref["step_valid"][j]
        assert np.abs(np.array(lg[0])[valid] - ref["step_logits"][j][valid]).max() < 1e-4, j


@pytest.mark.parametrize("targets", ["soft", "hard"])
@pytest.mark.parametrize("layout", ["early", "prompts"])
def test_eagle3_terms_on_the_loss_rows_equal_those_over_every_row(targets, layout):
    """The EAGLE-3 trainer runs the drafter's head and the loss on the rows with a term only, and
    the layer of the later TTT steps from the first row with a term at one of them
    (:func:`term_plan`): its per-step sums, hits and counts equal those of the head over every
    row with Speculators' validity mask (the form before), on rows with prompts, a short row, a
    row without loss tokens, and steps past a row's end; and a batch without loss tokens counts
    nothing."""
    from mtpflow.drafters.eagle3.train import eagle3_loss_terms, term_plan

    s = load_session(load_config(overrides={"model": {"model": str(E3 / "target"), "draft_model": str(E3 / "drafter_train")}}))
    d = s.drafter
    B, T, steps = 3, 12, 4
    rng = np.random.default_rng(3)
    toks = mx.array(rng.integers(0, 200, (B, T)), dtype=mx.int32)
    lens = mx.array([12, 7, 12], dtype=mx.int32)
    lm = np.zeros((B, T), bool)
    if layout == "early":
        lm[0, 5:] = True
        lm[1, 2:] = True  # past its length too: not counted
        counts, kept = [12, 12, 11, 10], T
    else:  # prompts of 6 and 8 tokens: the later steps run on rows 2 .. 11 only
        lm[0, 6:] = True
        lm[2, 8:] = True
        counts, kept = [10, 10, 10, 10], T - 2
    lmask = mx.array(lm)
    g = mx.random.normal((B, T, d.model.fc.weight.shape[1]), key=mx.random.key(2))
    labels = mx.random.normal((B, T, d.model.lm_head.weight.shape[0]), key=mx.random.key(4)) * 3
    got = eagle3_loss_terms(d.model, d.embed, g, labels, toks, lmask, lens, steps, targets)
    # the former form: every row's logits, the labels read shifted, Speculators' mask
    want = _terms_over_every_row(d.model, d.embed, g, labels, toks, lmask, lens, steps, targets, d.window)
    for k in range(3):
        np.testing.assert_allclose(np.array(got[k]), np.array(want[k]), rtol=1e-5, atol=1e-5)
    assert np.array(got[2]).tolist() == [float(c) for c in counts]
    label_at, plan, keep = term_plan(lm, np.array(lens), steps)
    assert [len(p[0]) for p in plan] == counts and len(keep) == kept
    # no loss token in the batch: one dummy row per step, never counted
    none = eagle3_loss_terms(d.model, d.embed, g, labels, toks, mx.zeros((B, T), mx.bool_), lens, steps, targets)
    assert np.array(none[2]).tolist() == [0.0] * steps and np.array(none[0]).tolist() == [0.0] * steps


def _terms_over_every_row(model, embed, g, labels, toks, lmask, lens, steps, targets, window):
    """The EAGLE-3 terms as Speculators computes them: the head over every row of every TTT
    step, the labels read shifted, its validity mask."""
    from mtpflow.train.objective import logit_terms, shift, soft_labels

    B, T = toks.shape
    tpos = mx.arange(T, dtype=mx.int32)[None]
    tgt_all = mx.argmax(labels, axis=-1)
    soft_all = soft_labels(labels) if targets == "soft" else None
    rows = mx.broadcast_to(tpos + 1, (B, T))
    out = []
    for j, lg in enumerate(ttt_logits(model, embed, g, shift(toks, 1), rows, steps, window)):
        n = max(T - 1 - j, 1)
        soft = None if soft_all is None else tuple(shift(a, 1 + j)[:, :n] for a in soft_all)
        valid = ((tpos + 1 + j < lens[:, None]) & shift(lmask, 1 + j))[:, :n]
        out.append(logit_terms(lg[:, :n].astype(mx.float32), shift(tgt_all, 1 + j)[:, :n], valid, soft))
    return tuple(mx.stack([o[k] for o in out]) for k in range(3))


def test_eagle3_pruned_terms_have_the_gradients_of_the_full_form():
    """Random batches (ragged rows, prompts, gaps, no loss at all; steps past a row's end; a
    sliding window shorter than the rows, which the kept rows' mask must keep): the pruned
    terms' step-weighted loss has the gradients of the full form's, for the drafter's weights
    and for the features ``g`` (whose rows before the kept ones reach the later steps as
    step-0 keys)."""
    import attrs
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from mtpflow.drafters.eagle3.train import eagle3_loss_terms, term_plan

    s = load_session(load_config(overrides={"model": {"model": str(E3 / "target"), "draft_model": str(E3 / "drafter_train")}}))
    d, model = s.drafter, s.drafter.model
    H, Vd = model.fc.weight.shape[1], model.lm_head.weight.shape[0]
    rng = np.random.default_rng(0)
    pruned = 0
    for trial in range(24):
        B, T, steps = int(rng.integers(1, 4)), int(rng.integers(2, 14)), int(rng.integers(1, 5))
        targets, window = ("soft", "hard")[trial % 2], (None, 3)[(trial // 2) % 2]
        model.cfg = attrs.evolve(model.cfg, sliding_window=window)
        lens = rng.integers(1, T + 1, B).astype(np.int32)
        lens[0] = T
        lm = np.zeros((B, T), bool)
        for b in range(B):
            kind = trial % 4 if b == 0 else int(rng.integers(0, 4))
            if kind == 1:
                lm[b, rng.integers(1, T):] = True
            elif kind == 2:
                lm[b] = rng.random(T) < 0.4
            elif kind == 3:
                lm[b, rng.integers(0, T):rng.integers(0, T + 1)] = True
        pruned += int(term_plan(lm, lens, steps)[2][0] > 0)
        toks = mx.array(rng.integers(0, 200, (B, T)), dtype=mx.int32)
        g = mx.array(rng.normal(size=(B, T, H)).astype(np.float32))
        labels = mx.array((rng.normal(size=(B, T, Vd)) * 3).astype(np.float32))
        L, lm_x = mx.array(lens), mx.array(lm)
        w = mx.array((0.8 ** np.arange(steps)).astype(np.float32))

        def loss(terms):
            S, C, N = terms
            return (w * S / mx.maximum(N, 1)).sum()

        def pruned_loss(gg):
            return loss(eagle3_loss_terms(model, d.embed, gg, labels, toks, lm_x, L, steps, targets))

        def full_loss(gg):
            return loss(_terms_over_every_row(model, d.embed, gg, labels, toks, lm_x, L, steps, targets, window))

        got = nn.value_and_grad(model, pruned_loss)(g)
        want = nn.value_and_grad(model, full_loss)(g)
        np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5, atol=1e-6)
        for (name, a), (_, b) in zip(tree_flatten(got[1]), tree_flatten(want[1])):
            np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-5, err_msg=f"trial {trial}: {name}")
        np.testing.assert_allclose(np.array(mx.grad(pruned_loss)(g)), np.array(mx.grad(full_loss)(g)), rtol=1e-4, atol=1e-5)
    assert pruned >= 6  # the kept range dropped rows in enough of the batches to test it


def test_dflash_training_forward_is_the_inference_forward():
    s = load_session(load_config(overrides={"model": {"model": str(DF / "target"), "draft_model": str(DF / "drafter")}}))
    d = s.drafter
    ids = json.loads((DF / "generate_long.json").read_text())["prompt_ids"]
    toks = mx.array([ids], dtype=mx.int32)
    _, _, taps = s.target.prefill([ids], taps=s.tap_layers)
    feats = mx.concatenate([taps[t] for t in d.cfg.taps], axis=-1)
    anchors = mx.array([[9, 30, 40]], dtype=mx.int32)  # before, inside and past the sliding window's reach
    train_logits = np.array(dflash_block_logits(d.model, s.target, feats, toks, anchors, d.cfg.mask_token_id))
    from test_dflash import _block, _Feat

    for i, a in enumerate([9, 30, 40]):
        caches = d._new_caches()
        d._take_in(caches, _Feat(d, np.array(feats[0, :a]), 0))
        _, logits = _block(d, caches, [ids[a]] + [d.cfg.mask_token_id] * (d.cfg.block_size - 1), a)
        assert np.abs(np.array(logits[0]) - train_logits[0, i]).max() < 1e-4, a


KINDS = {  # target, drafter options, the loss ratio 24 steps must reach
    "eagle3": (E3 / "target", {"draft_vocab_size": 512}, 0.8),
    "dflash": (DF / "target", {"block_size": 4, "num_hidden_layers": 1}, 0.95),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_training_lowers_the_loss_resumes_and_loads(kind, tmp_path):
    tgt, opts, ratio = KINDS[kind]
    common = dict(batch_size=8, lr=3e-3, warmup=4, checkpoint_every=10, progress=False, kind=kind, unroll=3, anchors=4,
                  targets="hard", steps=24)
    straight = train(tgt, opts, "selfgen:32:40", tmp_path / "a", **common)
    log = [json.loads(line) for line in (tmp_path / "a" / "train_log.jsonl").read_text().splitlines()]
    assert straight["steps"] == 24 and log[-1]["loss"] < ratio * log[0]["loss"]
    # stopped at step 10 and resumed: the same losses as the uninterrupted run
    train(tgt, opts, "selfgen:32:40", tmp_path / "b", stop_at=10, **common)
    train(tgt, opts, "selfgen:32:40", tmp_path / "b", **common)
    log_b = [json.loads(line) for line in (tmp_path / "b" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log_b] == list(range(1, 25))
    assert np.allclose([r["loss"] for r in log_b], [r["loss"] for r in log], rtol=1e-4, atol=1e-6)
    # the output is the kind's published format, and the engine runs it losslessly
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    assert (cfg.get("speculators_model_type") == "eagle3") if kind == "eagle3" else ("dflash_config" in cfg)
    s = load_session(load_config(overrides={"model": {"model": str(tgt), "draft_model": str(tmp_path / "a")},
                                            "draft": {"block_size": 4}}))
    assert s.draft_kind == kind
    ids = list(range(5, 25))
    assert generate(s, ids, max_tokens=20).tokens == target_only_greedy(s.target, ids, 20, s.target.eos_ids)


def test_dflash_dpace_weights_follow_the_confidence(tmp_path):
    """D-PACE (Speculators' dpace_loss_decay): per block, detached, from the
    smoothed confidence s = (1 - a) exp(-loss) + a; row k weighs the suffix
    sum of prefix products from k on; masked rows weigh nothing.  (Exact
    agreement with Speculators' training step: tests/test_train_parity.py.)"""
    from mtpflow.drafters.dflash.train import dpace_weights

    ln2 = float(np.log(2.0))
    per = mx.array([[[0.0, ln2, 5.0, ln2]]])
    vf = mx.array([[[1.0, 1.0, 0.0, 1.0]]])
    # s = [1, 0.75, 1 (masked), 0.75]; prefix = [1, 0.75, 0.75, 0.5625]; suffix sums of prefix * mask
    assert np.allclose(np.array(dpace_weights(per, vf, 0.5))[0, 0], [2.3125, 1.3125, 0.0, 0.5625])
    tgt, opts, _ = KINDS["dflash"]
    train(tgt, opts, "selfgen:16:40", tmp_path / "d", batch_size=8, steps=6, warmup=1, progress=False, kind="dflash",
          anchors=4, step_weights="position", targets="hard", checkpoint_every=6)
    log = [json.loads(line) for line in (tmp_path / "d" / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == 6 and all(np.isfinite(r["loss"]) for r in log) and log[-1]["loss"] < log[0]["loss"]


def _count_target_forwards(monkeypatch):
    """``(calls, target_states)``: every teacher-forced target forward of a kind's
    trainer appends to ``calls``; the real function, to compare against."""
    import mtpflow.train.target as target_mod

    calls = []
    real = target_mod.target_states
    monkeypatch.setattr(target_mod, "target_states", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls, real


def _cached_run_settings(kind):
    """32 examples (selfgen:32:40) in batches of 8: 4 steps an epoch, 12 steps, one batch per step
    (no lanes: the counts below are of target forwards per batch)."""
    return dict(batch_size=8, lr=3e-3, warmup=4, checkpoint_every=100, progress=False, kind=kind, unroll=3,
                anchors=4, targets="hard", steps=12, lanes=1)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_tap_cache_skips_the_target_forward_after_the_first_epoch(kind, tmp_path, monkeypatch):
    """--tap-cache-mb: 32 examples in batches of 8 are 4 steps an epoch; with the
    cache only the first epoch runs the target, and the losses are those of a
    run that recomputes every batch (up to float rounding)."""
    tgt, opts, _ = KINDS[kind]
    calls, real = _count_target_forwards(monkeypatch)
    common = _cached_run_settings(kind)
    plain = train(tgt, opts, "selfgen:32:40", tmp_path / "plain", **common)
    assert len(calls) == 12 and "tap_cache" not in plain
    calls.clear()
    cached = train(tgt, opts, "selfgen:32:40", tmp_path / "cached", tap_cache_mb=64, **common)
    assert len(calls) == 4  # the first epoch
    assert cached["tap_cache"]["examples"] == 32 and cached["tap_cache"]["batches_reused"] == 8
    losses = [[json.loads(x)["loss"] for x in (tmp_path / d / "train_log.jsonl").read_text().splitlines()]
              for d in ("plain", "cached")]
    assert np.allclose(losses[1], losses[0], rtol=1e-4, atol=1e-6), losses
    # a budget smaller than one example keeps nothing: every batch runs the target
    calls.clear()
    tiny = train(tgt, opts, "selfgen:32:40", tmp_path / "tiny", tap_cache_mb=1e-4, **dict(common, steps=6))
    assert len(calls) == 6 and tiny["tap_cache"]["examples"] == 0
    with pytest.raises(ValueError, match="eagle3 / dflash"):
        train(tgt, opts, "selfgen:32:40", tmp_path / "bad", tap_cache_mb=8, **dict(common, kind="assistant"))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_cache_data_stores_the_kinds_taps_and_training_never_runs_the_target(kind, tmp_path, monkeypatch):
    """``--data cache:SPEC`` for eagle3 / dflash: the teacher-forced collection keeps
    the target layers the drafter reads (float16, OUT/features-cache), and training
    reads them instead of running the target per batch."""
    from mtpflow.train.features import load_features
    from mtpflow.train.run import tap_layers
    from mtpflow.train.target import load_target

    tgt, opts, _ = KINDS[kind]
    calls, real = _count_target_forwards(monkeypatch)
    common = _cached_run_settings(kind)
    out = train(tgt, opts, "cache:selfgen:32:40", tmp_path / "o", **common)
    assert calls == [] and out["tap_cache"]["from_disk"] == 32 and out["tap_cache"]["batches_reused"] == 12
    target = load_target(tgt)
    taps = tap_layers(kind, target, opts)
    meta = json.loads((tmp_path / "o" / "features-cache" / "meta.json").read_text())
    assert meta["taps"] == list(taps) and len(taps) == 3
    log = [json.loads(x)["loss"] for x in (tmp_path / "o" / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == 12 and all(np.isfinite(log)) and min(log[-3:]) < log[0]
    # what was stored is what the target computes for that example (up to float16)
    for f in load_features(tmp_path / "o" / "features-cache")[:3]:
        hidden, got = real(target, mx.array(f.tokens[None].astype(np.int32)), taps)
        want = np.concatenate([np.array(hidden[0])] + [np.array(got[t][0]) for t in taps], axis=-1)
        have = np.concatenate([f.hidden, f.taps], axis=-1).astype(np.float32)
        assert have.shape == want.shape
        assert np.abs(have - want).max() <= 2e-3 * np.abs(want).max() + 1e-3
    # features of other taps are refused with what to do
    with pytest.raises(ValueError, match="other settings"):
        other = {**opts, "aux_layer_ids": [1, 2, 3]} if kind == "eagle3" else {**opts, "target_layer_ids": [0, 1, 2]}
        train(tgt, other, "cache:selfgen:32:40", tmp_path / "o", **common)
