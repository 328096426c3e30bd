"""Training the EAGLE-3 drafter kind against a frozen target (``mtpflow train --kind eagle3``).

**EAGLE-3** (the training-time test of speculators / EAGLE-3): row ``t``
pairs token ``x_{t+1}`` with the target states ``g_t`` at position ``t + 1``;
step ``j`` embeds ``x_{t+1+j}``, takes the drafter's own state of step
``j - 1`` (``h0 = fc(g)`` at step 0), attends to the step-0 keys of rows
``<= t`` and to its own keys of steps ``1..j`` only, and predicts
``x_{t+2+j}`` over the draft vocabulary.  Labels: the target's distribution
at position ``t+1+j`` restricted to the draft vocabulary (``soft``, KL) or its
argmax (``hard``); a term counts when that position is a loss token of the row
(Speculators' ``shift_batch`` + ``align_for_step``: the last token's
distribution included).  The loss is ``sum_j decay**j * mean_j`` (Speculators'
``ttt_step_loss_decay``, not normalised).  :func:`ttt_logits` is exactly
speculators' multi-step forward (tested against its outputs).  The draft
vocabulary is the data's most frequent tokens; the head is the target's
LM-head rows of it and stays frozen, as in Speculators (drafter option
``train_lm_head`` trains it), the final norm starts as the target's.

The target's states come from one teacher-forced target forward per batch,
from ``cache:`` features that keep the layers the drafter reads (:meth:`Eagle3Trainer.tap_layers`), or from memory with
``--tap-cache-mb`` (:class:`mtpflow.train.target.TargetStates`); the target never receives
gradients, and the run is :class:`mtpflow.train.kind.TappedTrainer`'s.  Checked against
Speculators 0.9.0's own training step -- loss, gradients and AdamW updates over several steps --
in ``tests/test_train_parity.py``.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np

from ...train.kind import TappedTrainer
from ...train.objective import choose_draft_vocab, label_top, logit_terms, shift, soft_labels, step_weights
from ...train.target import TargetStates
from .config import default_aux_layer_ids
from .export import new_config, save_speculators
from .model import Eagle3Model


def ttt_states(model, embed, g, row_tokens, row_positions, steps: int, window: int | None, keep=None):
    """speculators' training-time test: yields the head's input (the normed layer output
    ``[B, T, H]``) of steps ``0 .. steps-1`` (step ``j``: tokens shifted left by ``j``,
    0-padded, at ``row_positions + j``); :func:`ttt_logits` puts the head on it.  ``keep``
    (``[W]`` row indices, ascending): steps ``1 ..`` run on those rows only -- a later step
    reads the step-0 keys of every row but of itself only its own rows' states and keys --
    and yield ``[B, W, H]``."""
    layer = model.layer
    T = row_tokens.shape[1]
    t = mx.arange(T)
    causal = t[None, :] <= t[:, None]
    if window is not None:
        causal = causal & (t[None, :] > t[:, None] - window)
    h = model.first_hidden(g)
    keys, values = [], []
    for j in range(steps):
        tok, pos = shift(row_tokens, j), row_positions + j
        if j == 1 and keep is not None:  # the later steps' rows
            h, causal = mx.take(h, keep, axis=1), mx.take(causal, keep, axis=0)
        if j >= 1 and keep is not None:
            tok, pos = mx.take(tok, keep, axis=1), mx.take(pos, keep, axis=1)
        q, k, v, res = layer.project(embed(tok), h, pos)
        keys.append(k)
        values.append(v)
        # Speculators attends over every step's keys with the mask [causal, diag x j]; the diagonal
        # blocks hide all but one key a row, so only those are computed (Layer.finish_ttt)
        out = layer.finish_ttt(q, keys, values, causal, res)
        normed = model.norm(out)  # (model.head: the logits' input, and the state fed back)
        h = normed if model.cfg.norm_output else out
        yield normed


def ttt_logits(model, embed, g, row_tokens, row_positions, steps: int, window: int | None):
    """speculators' training-time test: yields the draft-vocabulary logits
    ``[B, T, Vd]`` of steps ``0 .. steps-1`` (:func:`ttt_states`)."""
    for normed in ttt_states(model, embed, g, row_tokens, row_positions, steps, window):
        yield model.lm_head(normed)


def term_plan(lmask: np.ndarray, lens: np.ndarray, steps: int):
    """Where the terms of the TTT steps sit, read on the host.  The label of row ``t`` at step
    ``j`` is the target's distribution at position ``q = t+1+j``, and the term counts when ``q``
    is a loss token of the row (Speculators' rule, :func:`eagle3_loss_terms`).  Returns
    ``(label_at, plan, keep)``: ``label_at [L]`` the flat positions ``b*T + q`` of the loss tokens
    ``1 <= q < len`` (the only labels any step reads); ``plan``, per step ``(rows, lab, valid)``: the
    flat rows with a term (from step 1 on, among the kept rows), the index in ``label_at`` of
    each one's label, and ``valid`` (all true; a step without terms gets one invalid row, so no
    array is empty); and ``keep``, the rows steps ``1 ..`` run on: from the first row with a
    term at any of them (rows before it feed no later term; the rows of a batch share one range)."""
    B, T = lmask.shape
    q = np.arange(T)[None]
    need = lmask.astype(bool) & (q < np.asarray(lens).reshape(B, 1)) & (q >= 1)
    label_at = np.flatnonzero(need).astype(np.int32)
    pos = label_at % T
    # the later steps run on the rows from the first with a term at any of them (:func:`ttt_states`)
    later = [int(pos[pos >= 1 + j].min()) - 1 - j for j in range(1, steps) if (pos >= 1 + j).any()]
    first = min(later) if later else T - 1
    keep = np.arange(first, T, dtype=np.int32)
    plan = []
    for j in range(steps):
        sel = np.flatnonzero(pos >= 1 + j).astype(np.int32)
        if len(sel):
            rows = label_at[sel] - 1 - j
            if j >= 1:  # flat index in [B, W] of the kept rows
                rows = (rows // T) * len(keep) + rows % T - first
            plan.append((rows.astype(np.int32), sel, np.ones(len(sel), bool)))
        else:
            plan.append((np.zeros(1, np.int32), np.zeros(1, np.int32), np.zeros(1, bool)))
    if not len(label_at):  # nothing to read: one row, never counted
        label_at = np.zeros(1, np.int32)
    return label_at, plan, keep


def eagle3_loss_terms(model, embed, g, label_logits, toks, lmask, lens, steps: int, targets: str):
    """Unnormalised terms over the TTT steps: ``(per_step_loss_sum,
    per_step_correct, per_step_count)`` (:func:`mtpflow.train.objective.weighted_loss`), from the
    target's draft-vocabulary logits at every position ``[B, T, Vd]``.  (Reads ``lmask`` and
    ``lens`` on the host; the trainer plans its batches with :func:`term_plan` and calls
    :func:`eagle3_planned_terms`.)"""
    B, T = toks.shape
    label_at, plan, keep = term_plan(np.array(lmask), np.array(lens), steps)
    labels = mx.take(label_logits.reshape(B * T, -1), mx.array(label_at), axis=0)
    return eagle3_planned_terms(model, embed, g, labels, toks, [tuple(mx.array(a) for a in p) for p in plan],
                                steps, targets, mx.array(keep))


def eagle3_planned_terms(model, embed, g, labels, toks, plan, steps: int, targets: str, keep=None):
    """:func:`eagle3_loss_terms` at the rows of :func:`term_plan`: ``labels`` the target's
    draft-vocabulary logits at ``label_at`` ``[L, Vd]``, ``plan`` its steps as arrays, ``keep``
    its kept rows.  The drafter's head and the loss run on the rows with a term only, the layer
    of steps ``1 ..`` on the kept rows (step 0 on every row: its keys are every later step's)."""
    B, T = toks.shape
    tgt_all, top = label_top(labels)
    soft_all = soft_labels(labels, top) if targets == "soft" else None  # (softmax of the logits, one exp)
    row_tokens = shift(toks, 1)  # x_{t+1} at row t
    sums, correct, counts = [], [], []
    rows = mx.broadcast_to(mx.arange(T, dtype=mx.int32)[None] + 1, (B, T))  # row t sits at the position of x_{t+1}
    states = ttt_states(model, embed, g, row_tokens, rows, steps, model.cfg.sliding_window, keep)
    for (at, lab, valid), normed in zip(plan, states):
        # the target's distribution of x_{t+2+j}, at position t+1+j
        x = model.lm_head(mx.take(normed.reshape(-1, normed.shape[-1]), at, axis=0)).astype(mx.float32)
        soft = None if soft_all is None else tuple(mx.take(a, lab, axis=0) for a in soft_all)
        s, c, cnt = logit_terms(x, mx.take(tgt_all, lab, axis=0), valid, soft)
        sums.append(s)
        correct.append(c)
        counts.append(cnt)
    return mx.stack(sums), mx.stack(correct), mx.stack(counts)


class Eagle3Trainer(TappedTrainer):
    """One run's EAGLE-3 trainer: a fresh drafter over the data's draft vocabulary."""

    kind = "eagle3"
    options = "mtpflow.drafters.eagle3.config:TrainOptions"

    def __init__(self, target, options: dict, examples, cfg):
        opts = dict(options or {})
        opts_train_head = bool(opts.pop("train_lm_head", False))
        k = int(opts.pop("draft_vocab_size", min(8192, target.vocab_size)))
        ids = choose_draft_vocab(examples, target.vocab_size, k, sorted(target.eos_ids))
        self.cfg = new_config(target, draft_vocab_size=k, **opts)
        m = Eagle3Model(self.cfg, has_embed=False, has_t2d=True)
        self.model, self.target = m, target
        self.set_draft_vocab(ids)
        if not opts_train_head:
            m.lm_head.freeze()  # Speculators keeps the verifier's rows frozen (DraftVocabMixin)
        norm = getattr(target.inner, "norm", None)
        if norm is not None and getattr(norm, "weight", None) is not None and norm.weight.shape == m.norm.weight.shape:
            m.norm.weight = norm.weight.astype(mx.float32)
        mx.eval(m.parameters())
        self.steps, self.targets = cfg.unroll, cfg.targets
        self.n_loss = cfg.unroll
        self.step_weights, self.decay = cfg.step_weights, cfg.decay
        import attrs

        self.config_id = {"kind": "eagle3", "config": json.loads(json.dumps(attrs.asdict(self.cfg), default=str)),
                          "draft_vocab": int(k)}
        self.states = TargetStates(target, self.cfg.aux_layer_ids, cfg.tap_cache_mb)

    def set_draft_vocab(self, ids) -> None:
        """The draft vocabulary ``ids`` (sorted target ids): ``d2t`` offsets,
        the ``t2d`` mask, and the head as the target's rows of it."""
        ids = np.asarray(ids)
        m, target = self.model, self.target
        m.d2t = mx.array(ids - np.arange(len(ids)), dtype=mx.int32)
        mask = np.zeros(target.vocab_size, bool)
        mask[ids] = True
        m.t2d = mx.array(mask)
        m.lm_head.weight = target.output_rows(mx.array(ids)).astype(mx.float32)  # start as the target's head
        self.ids = mx.array(ids)
        self.head_rows = mx.stop_gradient(m.lm_head.weight)  # the target's head over the draft vocabulary (labels)

    def embed(self, tokens):
        return self.target.inner.embed_tokens(tokens)

    def batch(self, toks, lmask, lens, idx=None):
        hidden, g = self.states(toks, lens, idx)
        B, T = toks.shape
        label_at, plan, keep = term_plan(np.array(lmask), np.array(lens), self.steps)
        # the target's head over the draft vocabulary only (K rows, not the full vocabulary, then a slice),
        # at the loss positions only (the labels the steps read)
        h = mx.take(hidden.reshape(B * T, -1), mx.array(label_at), axis=0).astype(mx.float32)
        labels = mx.stop_gradient(self.target.softcapped(mx.matmul(h, self.head_rows.T)))
        return (g, labels, toks, [tuple(mx.array(a) for a in p) for p in plan], mx.array(keep))

    def weights(self, acc_ema):
        """Speculators' ``ttt_step_loss_decay ** j`` per TTT step, not normalised
        (``--step-weights position``: mtpflow's normalised dE[tau]/da_j)."""
        if self.step_weights == "position":
            return step_weights("position", self.steps, self.decay, acc_ema)
        return (self.decay ** np.arange(self.steps)).astype(np.float32)

    def loss(self, model, g, labels, toks, plan, keep):
        return eagle3_planned_terms(model, self.embed, g, labels, toks, plan, self.steps, self.targets, keep)

    def step_batch(self, toks, lmask, lens, step: int, row0: int, idx):
        return self.batch(toks, lmask, lens, idx=idx)

    @classmethod
    def tap_layers(cls, target, options) -> tuple[int, ...]:
        """The aux layers (``aux_layer_ids``, default EAGLE-3's three) a fresh drafter reads."""
        n = int(type(target).text_config(target.config)["num_hidden_layers"])
        return tuple(dict(options or {}).get("aux_layer_ids") or default_aux_layer_ids(n))

    def save(self, out, dtype=None):
        save_speculators(self.model, self.cfg, out, dtype=dtype, speculative_tokens=self.steps)

