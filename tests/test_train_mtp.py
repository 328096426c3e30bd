"""``mtpflow train --kind mtp``: the guide's alignment on a hand-written packed
example, export -> the native-MTP loader -> the same logits, training lowers
the loss and resumes exactly, and the trained head drafts losslessly."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mtpflow.config import load_config
from mtpflow.engine import load_session, target_only_greedy
from mtpflow.targets.mlxlm import MLXLMTarget
from mtpflow.drafters.native_mtp.train import mtp_loss_terms, mtp_outputs, new_head, pack_plan, positions_at, save_native
from mtpflow.train.run import train
from mtpflow.train.target import target_states

TGT = Path(__file__).parent / "fixtures" / "eagle3" / "target"  # a tiny llama


@pytest.fixture(scope="module")
def target():
    return MLXLMTarget.from_path(TGT)


def _logp(x):
    x = x.astype(mx.float32)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


# The guide's alignment written out for one sample x_0..x_5 (T = 6, 0-based):
# depth 1 pairs h_i with e_{i+1} and predicts x_{i+2}; depth 2 pairs depth 1's output of
# pair i with e_{i+2} and predicts x_{i+3}.  A pair sits at the RoPE position of its token.
DEPTH_1 = {"h": [0, 1, 2, 3], "e": [1, 2, 3, 4], "y": [2, 3, 4, 5]}
DEPTH_2 = {"h": [0, 1, 2], "e": [2, 3, 4], "y": [3, 4, 5]}  # "h": rows of depth 1's outputs


def test_alignment_on_two_packed_samples_at_depth_2(target):
    mx.random.seed(3)
    _, head = new_head(target, 2, "random")
    rng = np.random.default_rng(0)
    A, B = rng.integers(3, 2000, 6), rng.integers(3, 2000, 6)
    H, _ = target_states(target, mx.array(np.stack([A, B]), dtype=mx.int32), ())
    # the packing: both samples in one row, positions restarting, the tail padding
    src, seg, pos = pack_plan([6, 6], max_len=12)
    assert src.shape == (1, 16)
    assert seg[0].tolist() == [1] * 6 + [2] * 6 + [0] * 4
    assert pos[0].tolist() == list(range(6)) * 2 + [0] * 4
    assert src[0, :12].tolist() == list(range(6)) + list(range(6, 12))  # row b, column t -> b * T + t
    Hp = mx.take(H.reshape(12, -1), mx.array(src[0]), axis=0)[None]
    toks = mx.array(np.concatenate([A, B]).reshape(-1)[src], dtype=mx.int32)
    lmask = mx.array(seg > 0)
    labels = target.logits(Hp)
    sums, _, counts = mtp_loss_terms(head, target, Hp, labels, toks, mx.array(seg), mx.array(pos), lmask, "soft")

    # by hand: each sample alone, pairs from the index lists, causal over the pairs of a depth
    ref_sums, ref_counts = np.zeros(2), np.zeros(2)
    for x, h in ((A, H[0]), (B, H[1])):
        x = mx.array(x, dtype=mx.int32)
        lab = _logp(target.logits(h))  # row j: the target's distribution of x_{j+1}
        prev = h
        for d, (layer, idx) in enumerate(zip(head.layers, (DEPTH_1, DEPTH_2))):
            n = len(idx["e"])
            causal = (mx.arange(n)[None, :] <= mx.arange(n)[:, None])[None, None]
            with positions_at(layer.block, mx.array([idx["e"]], dtype=mx.int32)):
                out = layer(target.embed(x[mx.array(idx["e"])])[None], prev[mx.array(idx["h"])][None], causal)[0]
            lp = _logp(target.logits(out))
            q = lab[mx.array(idx["y"]) - 1]
            ref_sums[d] += float((mx.exp(q) * (q - lp)).sum())
            ref_counts[d] += n
            prev = out
    assert np.array(counts).tolist() == ref_counts.tolist() == [8.0, 6.0]
    assert np.allclose(np.array(sums), ref_sums, rtol=1e-5, atol=1e-6), (np.array(sums), ref_sums)


def _head_logits(head, target, toks):
    H, _ = target_states(target, toks, ())
    T = toks.shape[1]
    seg = mx.ones((1, T), mx.int32)
    pos = mx.arange(T, dtype=mx.int32)[None]
    return [np.array(target.logits(o)) for o in mtp_outputs(head, target.embed, H, toks, seg, pos)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("mtp") / "a"
    common = dict(batch_size=8, lr=1e-2, warmup=4, checkpoint_every=100, progress=False, kind="mtp", targets="hard",
                  steps=16, max_len=96)
    train(TGT, {"depth": 2, "depth_weights": [1.0, 0.5]}, "selfgen:32:40", out, **common)
    return out, common


def test_training_lowers_the_loss_and_resumes_exactly(trained, tmp_path):
    out, common = trained
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == 16 and log[-1]["loss"] < 0.6 * log[0]["loss"]
    assert all(len(r["step_loss"]) == 2 for r in log)
    # depth_weights [1, 0.5], normalised: the loss is 2/3 of depth 1's plus 1/3 of depth 2's
    assert all(abs(r["loss"] - (2 * r["step_loss"][0] + r["step_loss"][1]) / 3) < 1e-4 for r in log)
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["kind"] == "mtp" and summary["depth"] == 2
    # stopped at step 6 and resumed: the same losses as the uninterrupted run
    opts = {"depth": 2, "depth_weights": [1.0, 0.5]}
    train(TGT, opts, "selfgen:32:40", tmp_path / "b", stop_at=6, **common)
    train(TGT, opts, "selfgen:32:40", tmp_path / "b", **common)
    log_b = [json.loads(line) for line in (tmp_path / "b" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log_b] == list(range(1, 17))
    assert np.allclose([r["loss"] for r in log_b], [r["loss"] for r in log], rtol=1e-6, atol=1e-6)


def test_export_reloads_in_the_native_loader_with_the_same_logits(trained, target, tmp_path):
    from mtpflow.drafters.native_mtp.drafter import load_head
    from mtpflow.export import export

    out, _ = trained
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 2 and cfg["model_type"] == "llama"
    names = set(mx.load(str(out / "model.safetensors")))
    assert {"model.layers.8.eh_proj.weight", "model.layers.9.enorm.weight", "model.layers.9.hnorm.weight",
            "model.layers.8.shared_head.norm.weight", "model.layers.9.self_attn.q_proj.weight",
            "model.layers.8.mlp.gate_proj.weight", "model.layers.8.input_layernorm.weight"} <= names
    # the trained weights (the last checkpoint) against the loader's module
    from mtpflow.drafters.native_mtp.train import MTPTrainer

    _, head = load_head(out, target.model, "float32", target.config)[:2]
    ckpt = MTPTrainer(target, {"depth": 2}, [], type("C", (), {"targets": "hard", "max_len": 96})())
    ckpt.model.load_weights(str(out / "checkpoint" / "model.safetensors"))
    toks = mx.array([list(range(7, 40))], dtype=mx.int32)
    for a, b in zip(_head_logits(ckpt.model, target, toks), _head_logits(head, target, toks)):
        assert np.abs(a - b).max() <= 1e-6
    # mtpflow export (the kind's own exporter) writes the same module again
    path = export(str(out), str(tmp_path / "x"), str(TGT))
    _, again = load_head(Path(path), target.model, "float32", target.config)[:2]
    for a, b in zip(_head_logits(head, target, toks), _head_logits(again, target, toks)):
        assert np.abs(a - b).max() <= 1e-6


def test_ragged_greedy_with_the_trained_head_equals_target_only(trained):
    from conftest import run_requests

    out, _ = trained
    s = load_session(load_config(overrides={"model": {"model": str(TGT), "draft_model": str(out)},
                                            "draft": {"block_size": 3}}))
    assert s.draft_kind == "native_mtp"
    prompts = [list(range(5, 25)), list(range(100, 107)), list(range(300, 340))]
    reqs, got = run_requests(s, prompts, [24, 16, 20])
    for r, p, n in zip(reqs, prompts, [24, 16, 20]):
        assert got[r.id] == target_only_greedy(s.target, p, n, s.target.eos_ids)


def test_the_training_forward_is_the_drafters_forward_at_depth_1(trained, target):
    """The native-MTP drafter's own step over a prompt's pairs (token ``x_{p+1}``
    with ``h_p`` at position ``p + 1``, its K/V cache, its mask) gives the
    training forward's depth-1 outputs."""
    out, _ = trained
    s = load_session(load_config(overrides={"model": {"model": str(TGT), "draft_model": str(out)}}))
    d = s.drafter
    toks = mx.array([list(range(40, 71))], dtype=mx.int32)
    T = toks.shape[1]
    H, _ = target_states(target, toks, ())
    want = mtp_outputs(d.model, target.embed, H, toks, mx.ones((1, T), mx.int32), mx.arange(T, dtype=mx.int32)[None])[0]
    caches = d.family.make_caches()
    got = d._run(0, toks[:, 1:], H[:, :-1], mx.arange(1, T, dtype=mx.int32)[None], caches)
    assert np.abs(np.array(got) - np.array(want[:, :-1])).max() < 1e-4


def test_fine_tuning_a_checkpoints_own_head_starts_from_it(tmp_path):
    """``from_target``: the DeepSeek-V3 checkpoint's own MTP layer (MoE block, MLA)
    is the start; with a zero learning rate the written module is that head."""
    from native_mtp_tiny import make_checkpoint

    from mtpflow.drafters.native_mtp.drafter import load_head
    from mtpflow.train.target import load_target

    ck = make_checkpoint(tmp_path, seed=0, depth=1)
    s = train(ck, {"from_target": True}, "selfgen:8:24", tmp_path / "out", steps=2, lr=0.0, warmup=1, batch_size=4,
              progress=False, kind="mtp", max_len=64)
    assert s["depth"] == 1 and np.isfinite(s["final"]["loss"])
    t = load_target(ck)
    toks = mx.array([list(range(3, 30))], dtype=mx.int32)
    a = _head_logits(load_head(ck, t.model, "float32")[1], t, toks)
    b = _head_logits(load_head(tmp_path / "out", t.model, "float32", t.config)[1], t, toks)
    assert np.abs(a[0] - b[0]).max() <= 1e-6


def test_bad_options_are_one_line_errors(target):
    from mtpflow.drafters.native_mtp.train import MTPTrainer

    cfg = type("C", (), {"targets": "soft", "max_len": 64})()
    with pytest.raises(ValueError, match="depth_weights needs 2 non-negative weights"):
        MTPTrainer(target, {"depth": 2, "depth_weights": [1.0]}, [], cfg)
    with pytest.raises(ValueError, match="unknown mtp drafter option.*depht"):
        MTPTrainer(target, {"depht": 2}, [], cfg)
    with pytest.raises(ValueError, match="depth must be >= 1"):
        MTPTrainer(target, {"depth": 0}, [], cfg)
