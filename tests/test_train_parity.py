"""Recipe parity of ``mtpflow train --kind eagle3 | dflash`` with Speculators 0.9.0's
own training step (tests/fixtures/train_parity, made by
tools/make_train_parity_fixtures.py): the same initial weights, batch and
hyper-parameters give the same loss, pre-clip gradient norm and gradients at
every optimizer step -- through mtpflow's real trainer classes and optimizer
loop (AdamW, linear schedule, clipping, step weights, reduction)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from mtpflow.train import data as data_mod
from mtpflow.train.config import TrainConfig
from mtpflow.train.optimize import optimize
from mtpflow.train.target import load_target

FIX = Path(__file__).parent / "fixtures" / "train_parity"
META = json.loads((FIX / "parity.json").read_text())
TOL = 1e-5


def _target():
    return load_target(FIX / "target")


def _docs(z):
    return [data_mod.Example(z["tokens"][i, :n].astype(np.int32), z["loss_mask"][i, :n]) for i, n in enumerate(z["lengths"])]


def _cfg(kind, **over):
    o = META["optimizer"]
    return TrainConfig(steps=META["steps"], batch_size=len(META["docs"]), lr=o["lr"], weight_decay=o["weight_decay"],
                       grad_clip=o["clip_grad_norm"], warmup=o["warmup"], schedule="linear", kind=kind, progress=False,
                       checkpoint_every=1000, **over)


def _load_init(model, z, skip=()):
    init = {k[5:]: v for k, v in z.items() if k.startswith("init/") and k[5:] not in skip}
    want = dict(tree_flatten(model.parameters()))
    missing = sorted(set(want) - set(init) - set(skip))
    assert not missing, missing
    model.update(tree_unflatten([(k, mx.array(v).astype(want[k].dtype)) for k, v in init.items() if k in want]))
    mx.eval(model.parameters())


def _preload(trainer, z):
    """The batch's target states are the fixture's (what speculators was fed)."""
    for i, n in enumerate(z["lengths"]):
        trainer.states.rows[i] = (z["hidden"][i, :n], z["taps"][i, :n])


def _run(trainer, cfg, make_batch, n_loss, tmp_path):
    grads = []
    optimize(trainer.model, trainer.loss, make_batch, cfg, tmp_path, trainer.config_id, n_loss,
             weights=trainer.weights, reduce=getattr(trainer, "reduce", None),
             on_grads=lambda step, g: grads.append({k: np.array(v) for k, v in tree_flatten(g)}))
    log = [json.loads(x) for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    return log, grads


def _check(log, grads, z, loss_key="loss", norm_key="grad_norm", check_grads=True):
    loss = np.array([r["loss"] for r in log])
    norm = np.array([r["grad_norm"] for r in log])
    assert len(loss) == len(z[loss_key]) >= 4  # >= 3 optimizer steps between the compared losses
    assert np.abs(loss - z[loss_key]).max() <= TOL * max(1.0, np.abs(z[loss_key]).max()), (loss, z[loss_key])
    assert np.abs(norm - z[norm_key]).max() <= TOL * max(1.0, np.abs(z[norm_key]).max()), (norm, z[norm_key])
    if not check_grads:
        return
    names = sorted(str(n) for n in z["trained"])
    for s in range(META["grad_steps"]):
        assert sorted(grads[s]) == names  # the same parameters are trained (frozen embedding / head / norms)
        for n in names:
            ref = z[f"grad{s}/{n}"]
            assert np.abs(grads[s][n] - ref).max() <= TOL * max(1.0, np.abs(ref).max()), (s, n)


def test_eagle3_training_steps_equal_speculators(tmp_path):
    from mtpflow.drafters.eagle3.train import Eagle3Trainer

    z = dict(np.load(FIX / "eagle3.npz"))
    e = META["eagle3"]
    target = _target()
    cfg = _cfg("eagle3", unroll=e["ttt_steps"], decay=e["ttt_step_loss_decay"], targets="soft")
    opts = {"draft_vocab_size": e["draft_vocab_size"], "aux_layer_ids": e["aux_layer_ids"],
            "intermediate_size": e["intermediate_size"]}
    trainer = Eagle3Trainer(target, opts, _docs(z), cfg)
    # the vocabulary mapping: speculators' t2d mask gives the draft ids, its d2t their offsets, and the
    # head starts as (and stays, frozen) the target's rows of them
    ids = np.nonzero(z["t2d"])[0]
    trainer.set_draft_vocab(ids)
    assert np.array_equal(np.array(trainer.model.d2t), z["d2t"])
    assert np.abs(np.array(trainer.model.lm_head.weight) - z["init/lm_head.weight"]).max() < 1e-7
    _load_init(trainer.model, z, skip=("d2t", "t2d"))
    _preload(trainer, z)
    toks, lmask, lens = (mx.array(z["tokens"]), mx.array(z["loss_mask"]), mx.array(z["lengths"]))

    def make_batch(step, rows):
        return trainer.batch(toks, lmask, lens, idx=[0, 1]), z["lengths"]

    log, grads = _run(trainer, cfg, make_batch, e["ttt_steps"], tmp_path)
    _check(log, grads, z)


@pytest.mark.parametrize("variant", ["dpace", "decay"])
def test_dflash_training_steps_equal_speculators(variant, tmp_path, monkeypatch):
    import mtpflow.drafters.dflash.train as kinds

    z = dict(np.load(FIX / "dflash.npz"))
    d = META["dflash"]
    target = _target()
    if variant == "dpace":  # D-PACE weights (alpha 0.5) on cross-entropy, Speculators' DFlash default
        cfg = _cfg("dflash", step_weights="position", dpace_alpha=d["dpace_alpha"], targets="hard",
                   anchors=z["anchors"].shape[1])
    else:  # the fixed exp(-(k-1)/gamma) decay on KL
        cfg = _cfg("dflash", step_weights="geometric", decay=math.exp(-1.0 / d["gamma"]), targets="soft",
                   anchors=z["anchors"].shape[1])
    opts = {"block_size": d["block_size"], "num_hidden_layers": d["num_hidden_layers"],
            "target_layer_ids": d["target_layer_ids"], "mask_token_id": d["mask_token_id"],
            "intermediate_size": d["intermediate_size"]}
    trainer = kinds.DFlashTrainer(target, opts, _docs(z), cfg)
    _load_init(trainer.model, z)
    _preload(trainer, z)
    # speculators draws the anchors with torch.randperm; the fixture fixed them (the last of row 1 is invalid)
    ok = np.arange(z["anchors"].shape[1])[None] < z["anchor_count"][:, None]
    monkeypatch.setattr(kinds, "_sample_anchors", lambda *a, **k: (z["anchors"].astype(np.int32), ok))
    toks, lmask, lens = (mx.array(z["tokens"]), mx.array(z["loss_mask"]), mx.array(z["lengths"]))

    def make_batch(step, rows):
        return trainer.batch(toks, lmask, lens, step, 0, idx=[0, 1]), z["lengths"]

    log, grads = _run(trainer, cfg, make_batch, d["block_size"] - 1, tmp_path)
    if variant == "dpace":
        _check(log, grads, z)
    else:
        _check(log, grads, z, "decay_loss", "decay_grad_norm", check_grads=False)


@pytest.mark.parametrize("anchors", [2, 9])
def test_dflash_labels_on_the_block_rows_equal_the_full_heads(anchors):
    """The DFlash trainer runs the target's head on the block rows' label positions only where
    they are fewer than the row's positions (2 anchors), else on every position and gathers
    (9 anchors of a block of 4 need 27 rows of 24): both give the full head's logits there (the
    Speculators parity above runs the first way)."""
    import mtpflow.drafters.dflash.train as kinds

    target = _target()
    B, T, block = 2, 24, 4
    hidden = mx.random.normal((B, T, target.hidden_size), key=mx.random.key(5))
    rng = np.random.default_rng(anchors)
    a = np.sort(np.stack([rng.choice(T - 1, anchors, replace=False) for _ in range(B)]), axis=1).astype(np.int32)
    src = kinds.label_positions(a, block, T)
    assert src.shape == (B, anchors * (block - 1)) and src.max() <= T - 1
    np.testing.assert_array_equal(src[:, : block - 1], a[:, :1] + np.arange(block - 1))
    full = target.logits(hidden)
    got = kinds.block_label_logits(target, hidden, a, block)
    want = mx.take_along_axis(full, mx.array(src)[:, :, None], axis=1)
    assert got.shape == want.shape
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)
