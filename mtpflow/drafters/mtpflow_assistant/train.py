"""Training the generic KV-sharing assistant drafter (``mtpflow train --kind assistant``) against a
frozen target.

Objective (the drafter exactly as it runs at inference, all positions in parallel)
-------------------------------------------------------------------------------
For a sequence ``x_0..x_{T-1}`` the frozen target gives post-norm hidden
states ``H_t``, logits ``L_t`` (the distribution of ``x_{t+1}``) and its
store-layer K/V.  At every position ``t`` (the row's "bonus" position is
``p = t + 1``) the drafter runs ``S`` unrolled steps ``i = 0..S-1``:

* input ``concat(target_embed(x_{t+1+i}), h_i)`` with ``h_0 = H_t`` and
  ``h_{i+1} = post_projection(final_i)`` -- the drafter's own state fed back;
  tokens are teacher-forced (the data token ``x_{t+1+i}``, as EAGLE-3 / HF
  MTP training do), which is consistent with the label because the target
  distribution at ``t+1+i`` is conditioned on those same data tokens;
* its query sits at the constant RoPE position ``t + 1`` for every step and
  attends to the target K/V of positions ``<= t`` (sliding layers: also
  ``>= t - window``, :func:`mtpflow.drafters.kv_sharing.drafter_mask`);
* it predicts ``x_{t+2+i}``; the label is the target's own distribution
  ``softmax(L_{t+1+i})`` (``targets="soft"``, loss = KL(target || drafter))
  or its argmax (``targets="hard"``, cross-entropy).

A term counts when the predicted token is inside the example and flagged as a
loss token (assistant turns).  Step weights: ``"geometric"``
``w_i = decay**i``, or ``"position"`` (D-PACE-like, dE[tau]/da_i), normalised
to sum to 1 (:func:`mtpflow.train.objective.step_weights`).

The target never receives gradients: its forward runs outside the
differentiated function and its outputs pass through ``mx.stop_gradient``;
only the drafter's parameters are handed to ``value_and_grad``.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx
import numpy as np

from ...targets.base import SLIDING
from ...train import data as data_mod
from ...train.features import FeatureExample
from ...train.kind import KindTrainer, add_data_summaries
from ...train.objective import (ahead, choose_draft_vocab, log_softmax, logit_loss, shift, soft_labels, top_hit,
                                weighted_loss)
from ...train.optimize import optimize
from ...train.parallel import world
from ...train.sources import training_data
from ...train.target import load_tokenizer
from ..kv_sharing import drafter_mask
from .config import check_compatible, make_config
from .drafter import save_drafter
from .model import GenericAssistantModel


class AssistantTrainer(KindTrainer):
    """``mtpflow train --kind assistant``: a fresh (or ``--init-from``) generic
    assistant drafter, written as a loadable ``mtpflow_assistant`` folder."""

    kind = "assistant"
    options = "mtpflow.drafters.mtpflow_assistant.config:TrainOptions"
    takes_model_config = True

    @classmethod
    def check(cls, cfg) -> None:
        if cfg.tap_cache_mb:
            raise ValueError("--tap-cache-mb is for --kind eagle3 / dflash; the assistant kind caches its features "
                             "with cache: data (e.g. --data cache:sharegpt:2000)")

    @classmethod
    def train(cls, target, options, data_spec, out: Path, cfg, examples=None, ranks=None) -> dict:
        ranks = ranks or world()
        mx.random.seed(cfg.seed)
        model, dcfg = new_model(target, options, cfg)
        examples, feats, distill, cache_summary = training_data(target, data_spec, out, cfg, examples, ranks)
        if model.has_draft_vocab and not cfg.init_from:  # a warm start keeps its draft vocabulary
            set_draft_vocab(model, target, examples, cfg)
        n_tokens_ex = [int(e.loss.sum()) for e in examples]

        def loss_fn(m, tp, toks, lmask, lens):
            return drafter_loss_terms(m, tp, toks, lmask, lens, cfg.unroll, cfg.targets)

        def make_batch(step, rows):
            if feats is not None:
                idx = data_mod.batch_indices(len(feats), cfg.batch_size, cfg.seed, step, rows)
                tp, (toks, lmask, lens) = feature_batch(feats, idx, target, model, unroll=cfg.unroll)
                return (tp, toks, lmask, lens), np.array(lens)
            toks_np, loss_np, lens_np = data_mod.batches(examples, cfg.batch_size, cfg.seed, step, rows=rows)
            toks, lmask, lens = mx.array(toks_np), mx.array(loss_np), mx.array(lens_np)
            return (target_pass(target, toks, model), toks, lmask, lens), lens_np

        step, acc_ema, tokens_seen, last, elapsed, speed = optimize(model, loss_fn, make_batch, cfg, out, dcfg,
                                                                    cfg.unroll, data_id=data_mod.fingerprint(examples),
                                                                    ranks=ranks)
        summary = {
            "steps": step, "tokens_seen": tokens_seen, "elapsed_s": round(elapsed, 1), "train_speed": speed,
            "examples": len(examples), "loss_tokens_per_epoch": int(sum(n_tokens_ex)),
            "final": last, "acc_ema": acc_ema, "train_config": asdict(cfg), "data": data_spec,
        }
        add_data_summaries(summary, distill, cache_summary)
        if ranks.main:
            save_drafter(model, out, dtype=cfg.save_dtype)
            (out / "train_summary.json").write_text(json.dumps(summary, indent=2))
        return summary


def new_model(target, options, cfg) -> tuple[GenericAssistantModel, dict]:
    """``(model, config)``: the drafter a run starts from -- ``--init-from``'s,
    or a fresh one (``--init identity``: :func:`identity_init`) -- evaluated."""
    if cfg.init_from:
        model = warm_start(target, cfg.init_from, options)
        dcfg = model.config
    else:
        dcfg = resolve_drafter_config(target, options)
        model = GenericAssistantModel(dcfg, target)
        if cfg.init == "identity":
            identity_init(model)
    mx.eval(model.parameters())
    return model, dcfg


def set_draft_vocab(model: GenericAssistantModel, target, examples, cfg) -> None:
    """The draft vocabulary: the data's (and ``--vocab-data``'s) most frequent loss tokens, EOS kept."""
    K = model.draft_vocab.shape[0]
    extra = None
    if cfg.vocab_data:
        extra = data_mod.load_examples(cfg.vocab_data, load_tokenizer(target), max_len=4096, target=target, seed=cfg.seed)
    model.set_draft_vocab(mx.array(choose_draft_vocab(examples, target.vocab_size, K, sorted(target.eos_ids), extra)))


def train_masks(kv: dict, T: int, window: int | None, qpos: mx.array | None = None) -> dict:
    """Per layer type, the ``[B, 1, T, S]`` visibility of training queries:
    query ``t`` (bonus position ``t + 1``) sees what one inference step with
    ``bonus_position = t + 1`` sees -- the rule of :func:`drafter_mask`, here
    broadcast over all queries of the sequence.  ``qpos`` ``[B, T]``: the
    absolute position of each query (default ``0..T-1`` in every row)."""
    out = {}
    for t, (pos, _k) in kv.items():
        B, S = pos.shape
        if qpos is None:
            bonus = mx.broadcast_to(mx.arange(1, T + 1, dtype=mx.int32)[None, :, None], (B, T, 1))
        else:
            bonus = (qpos + 1)[:, :, None]
        m = drafter_mask(pos[:, None, None, :], bonus, window if t == SLIDING else None)  # [B,1,1,1,T,S]
        out[t] = m.reshape(B, 1, T, S)
    return out


def target_pass(target, tokens: mx.array, model: GenericAssistantModel | None = None) -> dict:
    """Frozen target forward over ``tokens`` ``[B, T]`` (gradient-free).

    ``label_logits``: the target's logits over the drafter's output space (the
    full vocabulary, or the draft vocabulary); ``argmax``: the target's
    full-vocabulary greedy next token at every position."""
    B, T = tokens.shape
    cache = target.make_cache()
    target.set_offsets(cache, mx.zeros((B,), mx.int32))
    H = target.forward(tokens, cache)
    shared = target.shared_kv(cache)
    full = target.logits(H)
    sg = mx.stop_gradient
    out = {
        "hidden": sg(H), "embed": sg(target.embed(tokens)), "argmax": sg(mx.argmax(full, axis=-1)),
        "kv": {t: (sg(v.keys), sg(v.values)) for t, v in shared.items()},
        "positions": {t: v.positions for t, v in shared.items()},
    }
    out.update(label_targets(target, model, H, full))
    return out


def label_targets(target, model: GenericAssistantModel | None, H: mx.array, full: mx.array | None = None) -> dict:
    """``label_logits``: the target's logits at ``H`` over the drafter's output
    space (``full``, the full-vocabulary logits when already computed, or the
    target head restricted to the draft vocabulary); with a draft vocabulary
    also ``inv``, the draft index of every token id (-1 outside it)."""
    sg = mx.stop_gradient
    if model is not None and model.has_draft_vocab:
        inv = mx.full((target.vocab_size,), -1, mx.int32)
        inv[model.draft_vocab] = mx.arange(model.draft_vocab.shape[0], dtype=mx.int32)
        return {"label_logits": sg(model.head_logits(H)), "inv": inv}
    return {"label_logits": sg(full if full is not None else target.logits(H))}


def unrolled_logp(model: GenericAssistantModel, tp: dict, T: int, unroll: int):
    """The training-time test: yields, for ``i = 0 .. unroll-1``, the drafter's
    log-probabilities ``[B, T, V']`` (over its head's vocabulary) of
    ``x_{t+2+i}`` at every query position ``t``, with teacher-forced input
    tokens and its own ``h'`` fed back, queries at the constant position
    ``t + 1`` -- exactly what inference computes along an accepted prefix."""
    for logits in unrolled_logits(model, tp, T, unroll):
        yield log_softmax(logits)


def unrolled_logits(model: GenericAssistantModel, tp: dict, T: int, unroll: int):
    """:func:`unrolled_logp`'s float32 logits, before the log-softmax."""
    types = set(model.layer_types)
    kv = {t: tp["kv"][t] for t in types}
    qpos = tp.get("qpos")
    masks = train_masks({t: (tp["positions"][t], None) for t in types}, T, model.sliding_window, qpos)
    offset = 1 if qpos is None else qpos[:, 0] + 1
    h = tp["hidden"]
    for i in range(unroll):
        emb_in = shift(tp["embed"], 1 + i)
        z, h = model(mx.concatenate([emb_in, h.astype(emb_in.dtype)], axis=-1), kv, masks, offset)
        yield model.head_logits(z).astype(mx.float32)


def drafter_loss_terms(model: GenericAssistantModel, tp: dict, tokens, loss_mask, lengths, unroll: int, targets: str):
    """The unnormalised terms of the objective over ``unroll`` steps:
    ``(per_step_loss_sum [S], per_step_correct [S], per_step_count [S])``
    (:func:`weighted_loss` turns them into the loss; data-parallel training
    normalises by the counts of the whole global batch).

    With ``tp["qpos"]`` ``[B, T]`` the query-side arrays (hidden, embed,
    label logits, argmax, ``tokens``, ``loss_mask``) hold a contiguous window
    of each row starting at ``qpos[:, 0]`` (positions that feed no loss term are
    left out, :func:`feature_batch`); the K/V side is
    always whole."""
    B, T = tokens.shape
    qpos = tp.get("qpos")
    tpos = mx.arange(T, dtype=mx.int32)[None] if qpos is None else qpos
    # once: each step reads them shifted (KL(target || drafter) from the drafter's logits, logit_terms)
    soft = soft_labels(tp["label_logits"]) if targets == "soft" else None
    sub = model.draft_vocab if model.has_draft_vocab else None
    sums, correct, counts = [], [], []
    for i, x in enumerate(unrolled_logits(model, tp, T, unroll)):
        # the terms of step i sit at the first T - 1 - i positions (a later one has no label): the
        # logits and the labels are read there as views, the labels 1 + i positions on, not copied shifted
        n = max(T - 1 - i, 1)
        x = x[:, :n]
        valid = ((tpos + 2 + i < lengths[:, None]) & shift(loss_mask, 2 + i))[:, :n]
        vf = valid.astype(mx.float32)
        tgt_tok = ahead(tp["argmax"], 1 + i, n)  # the target's greedy x_{t+2+i}
        safe = mx.maximum(tgt_tok, 0)  # -1: no greedy label there (never a valid term)
        lab = safe if sub is None else tp["inv"][safe]  # its index in the head's vocabulary (-1: not in it)
        idx = mx.maximum(lab, 0)
        if soft is not None:  # KL to the target's distribution of x_{t+2+i}, over the head's vocabulary
            per, m = logit_loss(x, None, tuple(ahead(a, 1 + i, n) for a in soft), with_max=True)
        else:
            if sub is not None:
                valid = valid & (lab >= 0)
                vf = valid.astype(mx.float32)
            per, m = logit_loss(x, idx, with_max=True)
        hit = top_hit(x, idx, m)  # the drafter's argmax is the target's greedy token
        if sub is not None:
            hit = hit & (lab >= 0)
        hit = hit.astype(mx.float32)
        sums.append((per * vf).sum())
        correct.append(mx.stop_gradient((hit * vf).sum()))
        counts.append(mx.stop_gradient(vf.sum()))
    return mx.stack(sums), mx.stack(correct), mx.stack(counts)


def drafter_loss(model: GenericAssistantModel, tp: dict, tokens, loss_mask, lengths, weights, unroll: int, targets: str):
    """Weighted loss over ``unroll`` steps; returns ``(loss, per_step_loss
    [S], per_step_correct [S], per_step_count [S])`` (see
    :func:`drafter_loss_terms`)."""
    sums, correct, counts = drafter_loss_terms(model, tp, tokens, loss_mask, lengths, unroll, targets)
    total, per = weighted_loss(sums, counts, weights)
    return total, per, correct, counts


def identity_init(model: GenericAssistantModel, damp: float = 0.1) -> bool:
    """Start the drafter as (nearly) the identity on the hidden state: the
    ``h`` half of ``pre_projection`` and ``post_projection`` are identities,
    the token half is halved and the layers' output projections damped, so
    the first ``h'`` is close to ``h`` (with ``hidden_norm`` exactly on the
    target's hidden-state manifold and at its logit scale).  Measured on
    SmolLM2-135M: from loss 13.5 to 3.9 in 30 steps, against 19 to 6.2 from a
    random start (which also swings up to 50 on the way).  Needs the drafter
    width to equal the target's; returns whether it applied."""
    Dd, Dt = model.config["hidden_size"], model.config["backbone_hidden_size"]
    if Dd != Dt:
        return False
    w = model.pre_projection.weight
    eye = mx.eye(Dt, dtype=w.dtype)
    model.pre_projection.weight = mx.concatenate([w[:, :Dt] * 0.5, eye], axis=1)
    model.post_projection.weight = eye
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight = layer.self_attn.o_proj.weight * damp
        layer.mlp.down_proj.weight = layer.mlp.down_proj.weight * damp
    return True


def warm_start(target, init_from: str, drafter_config) -> GenericAssistantModel:
    """The drafter in ``init_from`` (folder or packaged name), in float32, for further training."""
    from .drafter import load_model
    from ...engine import resolve_model
    from ...targets.base import read_config

    if drafter_config is not None:
        raise ValueError("--init-from takes the drafter config from that folder's config.json; drop --drafter-config")
    path = resolve_model(str(init_from))
    if read_config(path).get("model_type") != "mtpflow_assistant":
        raise ValueError(f"--init-from {init_from}: not an mtpflow_assistant drafter folder (config.json model_type)")
    model = load_model(path, target, dtype="float32")
    model.config["torch_dtype"] = "float32"  # trained (and saved, unless --save-dtype) in float32
    return model


def resolve_drafter_config(target, drafter_config) -> dict:
    """``drafter_config``: ``None`` (defaults), a path to a JSON file, a full
    config dict (``model_type`` set) or a dict of :func:`make_config` options."""
    if drafter_config is None:
        drafter_config = {}
    if isinstance(drafter_config, (str, Path)):
        drafter_config = json.loads(Path(drafter_config).read_text())
    if drafter_config.get("model_type"):
        return check_compatible(target.config, dict(drafter_config))
    return make_config(target.config, **drafter_config)


def feature_batch(examples: list[FeatureExample], idx, target, model=None, unroll: int | None = None,
                  pad_multiple: int = 16):
    """A batch of cached examples as the dict of
    :func:`target_pass`, plus ``(tokens, loss, lengths)``.

    With ``unroll``, the query side is cropped per row to the positions that
    feed a loss term of an ``unroll``-step objective (``qpos`` in the dict):
    prompt positions more than ``unroll + 1`` before the first loss token are
    only K/V context, so the drafter does not spend compute on them."""
    sel = [examples[i] for i in idx]
    B = len(sel)
    S = -(-max(len(e) for e in sel) // pad_multiple) * pad_multiple
    D = sel[0].hidden.shape[1]
    q0 = np.zeros(B, np.int64)
    if unroll is not None:
        for r, e in enumerate(sel):
            first = int(np.argmax(e.loss)) if e.loss.any() else len(e)
            q0[r] = max(0, first - 1 - unroll)
    T = -(-max(len(e) - int(q0[r]) for r, e in enumerate(sel)) // pad_multiple) * pad_multiple
    toks = np.zeros((B, T), np.int32)
    loss = np.zeros((B, T), bool)
    lens = np.zeros(B, np.int32)
    hid = np.zeros((B, T, D), np.float32)
    argmax = np.full((B, T), -1, np.int32)
    pos = np.full((B, S), -1, np.int32)
    qpos = q0[:, None] + np.arange(T)[None]
    kv = {}
    for t, (k0, v0) in sel[0].kv.items():
        kv[t] = (np.zeros((B, k0.shape[0], S, k0.shape[2]), np.float32), np.zeros((B, v0.shape[0], S, v0.shape[2]), np.float32))
    for r, e in enumerate(sel):
        n, a = len(e), int(q0[r])
        m = n - a
        toks[r, :m], loss[r, :m], lens[r] = e.tokens[a:], e.loss[a:], n
        hid[r, :m] = e.hidden[a:]
        pos[r, :n] = np.arange(n)
        if e.argmax is not None:
            am = e.argmax
        else:  # greedy target: at a position whose next token was generated, that token is the argmax
            nxt = np.nonzero(e.loss[1:])[0]
            am = np.full(n, -1, np.int32)
            am[nxt] = e.tokens[nxt + 1]
        argmax[r, :m] = am[a:]
        for t, (k, v) in e.kv.items():
            kv[t][0][r, :, :n] = k
            kv[t][1][r, :, :n] = v
    tok_mx = mx.array(toks)
    H = mx.array(hid)
    sg = mx.stop_gradient
    tp = {
        "hidden": H, "embed": sg(target.embed(tok_mx)), "argmax": mx.array(argmax),
        "kv": {t: (mx.array(k), mx.array(v)) for t, (k, v) in kv.items()},
        "positions": {t: mx.array(pos) for t in kv},
    }
    if unroll is not None:
        tp["qpos"] = mx.array(qpos.astype(np.int32))
    tp.update(label_targets(target, model, H))
    return tp, (tok_mx, mx.array(loss), mx.array(lens))

