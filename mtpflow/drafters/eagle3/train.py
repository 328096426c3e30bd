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
from ...train.objective import ahead, choose_draft_vocab, label_top, logit_terms, shift, soft_labels, step_weights
from ...train.target import TargetStates
from .config import default_aux_layer_ids
from .export import new_config, save_speculators
from .model import Eagle3Model


def ttt_logits(model, embed, g, row_tokens, row_positions, steps: int, window: int | None):
    """speculators' training-time test: yields the draft-vocabulary logits
    ``[B, T, Vd]`` of steps ``0 .. steps-1`` (step ``j``: tokens shifted left
    by ``j``, 0-padded, at ``row_positions + j``)."""
    layer = model.layer
    T = row_tokens.shape[1]
    t = mx.arange(T)
    causal = t[None, :] <= t[:, None]
    if window is not None:
        causal = causal & (t[None, :] > t[:, None] - window)
    h = model.first_hidden(g)
    keys, values = [], []
    for j in range(steps):
        tok = shift(row_tokens, j)
        q, k, v, res = layer.project(embed(tok), h, row_positions + j)
        keys.append(k)
        values.append(v)
        # Speculators attends over every step's keys with the mask [causal, diag x j]; the diagonal
        # blocks hide all but one key a row, so only those are computed (Layer.finish_ttt)
        out = layer.finish_ttt(q, keys, values, causal, res)
        logits, h = model.head(out)
        yield logits


def eagle3_loss_terms(model, embed, g, label_logits, toks, lmask, lens, steps: int, targets: str):
    """Unnormalised terms over the TTT steps: ``(per_step_loss_sum,
    per_step_correct, per_step_count)`` (:func:`mtpflow.train.objective.weighted_loss`)."""
    B, T = toks.shape
    tpos = mx.arange(T, dtype=mx.int32)[None]
    tgt_all, top = label_top(label_logits)
    soft_all = soft_labels(label_logits, top) if targets == "soft" else None  # (softmax of the logits, one exp)
    row_tokens = shift(toks, 1)  # x_{t+1} at row t
    sums, correct, counts = [], [], []
    rows = mx.broadcast_to(tpos + 1, (B, T))  # row t sits at the position of its token x_{t+1}
    for j, logits in enumerate(ttt_logits(model, embed, g, row_tokens, rows, steps, model.cfg.sliding_window)):
        # the target's distribution of x_{t+2+j}, at position t+1+j: terms sit at the first T - 1 - j rows,
        # whose labels are read as views 1 + j positions on (not copied shifted)
        n = max(T - 1 - j, 1)
        soft = None if soft_all is None else tuple(ahead(a, 1 + j, n) for a in soft_all)
        # Speculators' rule (shift_batch + align_for_step): the term counts when the position whose distribution
        # is the label is a loss token of the row -- the last token's distribution (past the row's end) included
        valid = ((tpos + 1 + j < lens[:, None]) & shift(lmask, 1 + j))[:, :n]
        s, c, cnt = logit_terms(logits[:, :n].astype(mx.float32), ahead(tgt_all, 1 + j, n), valid, soft)
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
        # the target's head over the draft vocabulary only (K rows, not the full vocabulary, then a slice)
        labels = mx.stop_gradient(self.target.softcapped(mx.matmul(hidden.astype(mx.float32), self.head_rows.T)))
        return (g, labels, toks, lmask, lens)

    def weights(self, acc_ema):
        """Speculators' ``ttt_step_loss_decay ** j`` per TTT step, not normalised
        (``--step-weights position``: mtpflow's normalised dE[tau]/da_j)."""
        if self.step_weights == "position":
            return step_weights("position", self.steps, self.decay, acc_ema)
        return (self.decay ** np.arange(self.steps)).astype(np.float32)

    def loss(self, model, g, labels, toks, lmask, lens):
        return eagle3_loss_terms(model, self.embed, g, labels, toks, lmask, lens, self.steps, self.targets)

    def step_batch(self, toks, lmask, lens, step: int, row0: int, idx):
        return self.batch(toks, lmask, lens, idx=idx)

    @classmethod
    def tap_layers(cls, target, options) -> tuple[int, ...]:
        """The aux layers (``aux_layer_ids``, default EAGLE-3's three) a fresh drafter reads."""
        n = int(type(target).text_config(target.config)["num_hidden_layers"])
        return tuple(dict(options or {}).get("aux_layer_ids") or default_aux_layer_ids(n))

    def save(self, out, dtype=None):
        save_speculators(self.model, self.cfg, out, dtype=dtype, speculative_tokens=self.steps)

