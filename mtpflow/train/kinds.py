"""Training the EAGLE-3 and DFlash drafter kinds against a frozen target
(``mtpflow train --kind eagle3 | dflash``).

Both read the target's hidden states of a few layers, computed per batch by
one teacher-forced target forward with layer taps
(:meth:`mtpflow.targets.base.TargetAdapter.forward_with_taps`) over the data's
tokens -- text specs, or the token sequences of ``distill:`` feature folders
(the self-distilled answers) -- or read from ``cache:`` features, whose
collection keeps the layers the drafter reads (:func:`tap_layers`), and kept
in memory across epochs with ``--tap-cache-mb`` (:class:`TargetStates`).  The target never receives
gradients, and the optimiser loop is :func:`mtpflow.train.loop.optimize`
(resumable checkpoints, progress, ``train_log.jsonl``).

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

**DFlash**: per sequence ``--anchors`` distinct random loss positions ``a``
(a row with fewer leaves the rest invalid, as Speculators' ``select_anchors``);
the block ``[x_a, mask x (B-1)]`` at positions ``a .. a+B-1`` sees the context
features of positions ``< a`` through each layer's own inference mask, and
block row ``k`` predicts ``x_{a+k}`` through the target's LM head (label: the
target at ``a+k-1``; a term when ``a+k`` is a loss token).  Each term is
weighted ``exp(-(k-1)/γ)`` (``--step-weights geometric`` with ``decay =
exp(-1/γ)``) or by **D-PACE** (``--step-weights position``, Speculators'
``dpace_loss_decay``): per block, from the detached confidence ``exp(-loss)``
smoothed by ``--dpace-alpha``, suffix sums of prefix products
(:func:`dpace_weights`); the loss is the weighted sum over the number of terms.
Embedding and LM head are the target's and stay frozen.

Both are checked against Speculators 0.9.0's own training step -- loss,
gradients and AdamW updates over several steps -- in
``tests/test_train_parity.py``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlx.core as mx
import numpy as np

from . import data as data_mod

KINDS = ("assistant", "eagle3", "dflash", "mtp")


def _sg(x):
    return mx.stop_gradient(x)


def _shift(a: mx.array, k: int) -> mx.array:
    from .loop import _shift as shift

    return shift(a, k)


def target_states(target, tokens: mx.array, layers) -> tuple[mx.array, dict]:
    """One teacher-forced target forward over ``tokens [B, T]``: post-norm
    hidden states and the taps of ``layers``, all without gradients."""
    cache = target.make_cache()
    target.set_offsets(cache, mx.zeros((tokens.shape[0],), dtype=mx.int32))
    hidden, taps = target.forward_with_taps(tokens, cache, tuple(layers))
    return _sg(hidden), {k: _sg(v) for k, v in taps.items()}


class TargetStates:
    """The target's post-norm hidden states and concatenated layer taps per
    training example, kept in memory up to ``budget_mb`` (``--tap-cache-mb``):
    a batch whose rows are all kept skips the target forward, so every epoch
    after the first trains on the drafter's cost alone.

    Rows are stored unpadded (host copies) and zero-padded to the batch's
    length when reused; both kinds read a row's states only at positions
    before its length (causal attention, masked labels), so a reused batch
    trains as a recomputed one, up to float rounding."""

    def __init__(self, target, layers, budget_mb: float = 0.0):
        self.target, self.layers = target, tuple(layers)
        self.budget = int(budget_mb * 2**20)
        self.rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.bytes = 0
        self.reused = self.computed = 0  # batches
        self.from_disk = 0

    def preload(self, feats, layers) -> None:
        """Keep the states of ``cache:`` features collected with these taps
        (``OUT/features-cache``, float16 on disk), outside the memory budget:
        example ``i`` is ``feats[i]``."""
        if tuple(layers) != self.layers:
            raise ValueError(f"the cached features hold the target layers {list(layers)}, this drafter reads "
                             f"{list(self.layers)}: collect into a new --out (or delete OUT/features-cache)")
        for i, f in enumerate(feats):
            if f.taps is not None:
                self.rows[i] = (f.hidden, f.taps)
                self.from_disk += 1

    def __call__(self, toks: mx.array, lens, idx=None) -> tuple[mx.array, mx.array]:
        """``(hidden [B, T, H], taps [B, T, n*H])`` of the batch ``toks`` whose
        rows are the examples ``idx`` (``None``: not cacheable)."""
        keep = self.budget > 0 and idx is not None
        if idx is not None and self.rows and all(int(i) in self.rows for i in idx):
            self.reused += 1
            T = toks.shape[1]

            def padded(j):
                return mx.array(np.stack([np.pad(self.rows[int(i)][j], ((0, T - len(self.rows[int(i)][j])), (0, 0)))
                                          for i in idx]).astype(np.float32))

            return padded(0), padded(1)
        self.computed += 1
        hidden, taps = target_states(self.target, toks, self.layers)
        g = mx.concatenate([taps[i] for i in self.layers], axis=-1)
        if keep:
            new = [(r, int(i)) for r, i in enumerate(idx) if int(i) not in self.rows]
            if new and self.bytes < self.budget:
                h_np, g_np = np.array(hidden), np.array(g)  # (the step evaluates them anyway)
                lens = np.asarray(lens)
                for r, i in new:
                    n = int(lens[r])
                    size = n * (h_np.shape[-1] + g_np.shape[-1]) * h_np.itemsize
                    if self.bytes + size <= self.budget:
                        self.rows[i] = (h_np[r, :n].copy(), g_np[r, :n].copy())
                        self.bytes += size
        return hidden, g

    def summary(self) -> dict:
        return {"budget_mb": self.budget / 2**20, "examples": len(self.rows), "from_disk": self.from_disk,
                "mb": round(self.bytes / 2**20, 3), "batches_reused": self.reused, "batches_computed": self.computed}


# --------------------------------------------------------------------------------------
# EAGLE-3
# --------------------------------------------------------------------------------------
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
    diag = t[None, :] == t[:, None]
    h = model.first_hidden(g)
    keys, values = [], []
    for j in range(steps):
        tok = _shift(row_tokens, j)
        q, k, v, res = layer.project(embed(tok), h, row_positions + j)
        keys.append(k)
        values.append(v)
        mask = mx.concatenate([causal] + [diag] * j, axis=1)[None, None]
        out = layer.finish(q, mx.concatenate(keys, axis=2), mx.concatenate(values, axis=2), mask, res)
        logits, h = model.head(out)
        yield logits


def step_terms(logp: mx.array, lab: mx.array, tgt: mx.array, valid: mx.array, soft: bool):
    """One step's (or depth's) unnormalised ``(loss_sum, correct, count)``: KL to the
    target's log-distribution ``lab`` (``soft``) or the cross-entropy of the token
    ``tgt``, summed over ``valid``; ``correct`` counts the drafter's argmax hitting ``tgt``."""
    vf = valid.astype(mx.float32)
    if soft:
        per = (mx.exp(lab) * (lab - logp)).sum(-1)
    else:
        per = -mx.take_along_axis(logp, tgt[..., None], axis=-1)[..., 0]
    correct = _sg(((mx.argmax(logp, axis=-1) == tgt) & valid).sum().astype(mx.float32))
    return (per * vf).sum(), correct, _sg(vf.sum())


def eagle3_loss_terms(model, embed, g, label_logits, toks, lmask, lens, steps: int, targets: str):
    """Unnormalised terms over the TTT steps: ``(per_step_loss_sum,
    per_step_correct, per_step_count)`` (:func:`mtpflow.train.loop.weighted_loss`)."""
    B, T = toks.shape
    tpos = mx.arange(T, dtype=mx.int32)[None]
    lab_all = label_logits - mx.logsumexp(label_logits, axis=-1, keepdims=True)
    row_tokens = _shift(toks, 1)  # x_{t+1} at row t
    sums, correct, counts = [], [], []
    rows = mx.broadcast_to(tpos + 1, (B, T))  # row t sits at the position of its token x_{t+1}
    for j, logits in enumerate(ttt_logits(model, embed, g, row_tokens, rows, steps, model.cfg.sliding_window)):
        logp = logits.astype(mx.float32)
        logp = logp - mx.logsumexp(logp, axis=-1, keepdims=True)
        lab = _shift(lab_all, 1 + j)  # the target's distribution of x_{t+2+j}, at position t+1+j
        # Speculators' rule (shift_batch + align_for_step): the term counts when the position whose distribution
        # is the label is a loss token of the row -- the last token's distribution (past the row's end) included
        valid = (tpos + 1 + j < lens[:, None]) & _shift(lmask, 1 + j)
        s, c, n = step_terms(logp, lab, mx.argmax(lab, axis=-1), valid, targets == "soft")
        sums.append(s)
        correct.append(c)
        counts.append(n)
    return mx.stack(sums), mx.stack(correct), mx.stack(counts)


class Eagle3Trainer:
    kind = "eagle3"

    def __init__(self, target, options: dict, examples, cfg):
        from ..drafters.eagle3.export import new_config
        from ..drafters.eagle3.model import Eagle3Model
        from .loop import choose_draft_vocab

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
        self.head_rows = _sg(m.lm_head.weight)  # the target's head over the draft vocabulary (labels)

    def embed(self, tokens):
        return self.target.inner.embed_tokens(tokens)

    def batch(self, toks, lmask, lens, idx=None):
        hidden, g = self.states(toks, lens, idx)
        # the target's head over the draft vocabulary only (K rows, not the full vocabulary, then a slice)
        labels = _sg(self.target.softcapped(mx.matmul(hidden.astype(mx.float32), self.head_rows.T)))
        return (g, labels, toks, lmask, lens)

    def weights(self, acc_ema):
        """Speculators' ``ttt_step_loss_decay ** j`` per TTT step, not normalised
        (``--step-weights position``: mtpflow's normalised dE[tau]/da_j)."""
        from .loop import step_weights

        if self.step_weights == "position":
            return step_weights("position", self.steps, self.decay, acc_ema)
        return (self.decay ** np.arange(self.steps)).astype(np.float32)

    def loss(self, model, g, labels, toks, lmask, lens):
        return eagle3_loss_terms(model, self.embed, g, labels, toks, lmask, lens, self.steps, self.targets)

    def save(self, out, dtype=None):
        from ..drafters.eagle3.export import save_speculators

        save_speculators(self.model, self.cfg, out, dtype=dtype, speculative_tokens=self.steps)


# --------------------------------------------------------------------------------------
# DFlash
# --------------------------------------------------------------------------------------
def _rope_rows(rope, x, positions):
    from ..targets.base import rope_at

    return rope_at(rope, x, positions)


def dflash_block_logits(model, target, feats, toks, anchors, mask_id: int):
    """The training forward: per row ``[B]`` and anchor ``[B, K]``, the block
    ``[x_a, mask, ...]`` at positions ``a ..`` with the context features of
    positions ``< a`` (each layer's inference mask).  Returns the target-head
    logits of block rows ``1 .. Bs-1``: ``[B, K, Bs-1, V]``."""
    cfg = model.cfg
    B, T = toks.shape
    K = anchors.shape[1]
    Bs = cfg.block_size
    j = mx.arange(Bs, dtype=mx.int32)
    qpos = (anchors[:, :, None] + j[None, None, :]).reshape(B, K * Bs)  # [B, K*Bs]
    first = mx.take_along_axis(toks, anchors, axis=1)  # x_a
    ids = mx.concatenate([first[:, :, None], mx.full((B, K, Bs - 1), mask_id, mx.int32)], axis=2).reshape(B, K * Bs)
    x = target.inner.embed_tokens(ids)
    if cfg.input_embedding_scale != 1.0:
        x = x * cfg.input_embedding_scale
    ctx = model.context(feats)  # [B, T, H]
    kpos = mx.broadcast_to(mx.arange(T, dtype=mx.int32)[None], (B, T))
    a_of_q = mx.repeat(anchors, Bs, axis=1)  # [B, K*Bs] the block start of every query
    blk_id = mx.repeat(mx.arange(K), Bs)
    row_in = mx.tile(j, K)
    for layer in model.layers:
        att = layer.self_attn
        ctx_k, ctx_v = att.kv(ctx, mx.zeros((B,), dtype=mx.int32))  # context rows at positions 0..T-1
        h = layer.input_layernorm(x)
        L = h.shape[1]
        q = att.q_norm(att.q_proj(h).reshape(B, L, att.n_heads, att.head_dim)).transpose(0, 2, 1, 3)
        k = att.k_norm(att.k_proj(h).reshape(B, L, att.n_kv, att.head_dim)).transpose(0, 2, 1, 3)
        v = att.v_proj(h).reshape(B, L, att.n_kv, att.head_dim).transpose(0, 2, 1, 3)
        q, k = _rope_rows(att.rope, q, qpos), _rope_rows(att.rope, k, qpos)
        cm = kpos[:, None, :] < a_of_q[:, :, None]  # context before the block
        bm = (blk_id[:, None] == blk_id[None, :])[None]  # the block's own rows
        if layer.causal:
            bm = bm & (row_in[None, :] <= row_in[:, None])[None]
        if layer.window is not None:
            cm = cm & (qpos[:, :, None] - kpos[:, None, :] < layer.window)
            bm = bm & ((row_in[:, None] - row_in[None, :]) < layer.window)[None]
        mask = mx.concatenate([cm, mx.broadcast_to(bm, (B, L, L))], axis=-1)[:, None]
        keys = mx.concatenate([ctx_k, k], axis=2)
        values = mx.concatenate([ctx_v, v], axis=2)
        o = mx.fast.scaled_dot_product_attention(q, keys, values, scale=att.scale, mask=mask)
        x = x + att.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    hidden = model.norm(x).reshape(B, K, Bs, -1)[:, :, 1:]
    return target.logits(hidden)


def dpace_weights(per, vf, alpha: float):
    """D-PACE position weights of Speculators (``losses.utils.dpace_loss_decay``),
    per block, detached: with the confidence ``q_k = exp(-loss_k)`` smoothed to
    ``s_k = (1 - alpha) q_k + alpha`` (1 where masked), ``w_k = m_k *
    sum_{j >= k} m_j prod_{i <= j} s_i`` -- how much of the block's expected
    accepted length rides on row ``k``.  ``per``, ``vf``: ``[..., Bs-1]``."""
    q = mx.exp(-_sg(per * vf))
    smooth = mx.where(vf > 0, (1.0 - alpha) * q + alpha, 1.0)
    prefix = mx.cumprod(smooth, axis=-1)
    suffix = mx.cumsum((prefix * vf)[..., ::-1], axis=-1)[..., ::-1]
    return _sg(suffix * vf)


def dflash_loss_terms(model, target, feats, label_logits, toks, anchors, valid, mask_id: int, targets: str,
                      weighting: str = "geometric", decay: float = math.exp(-0.25), alpha: float = 0.5):
    """Speculators' DFlash loss terms over block rows ``1..Bs-1``:
    ``(per_row_weighted_loss_sum, per_row_correct, per_row_count)``.  Each term
    is the row's loss (``hard``: cross-entropy on the target's argmax, Speculators'
    default ``ce``; ``soft``: KL) times its weight -- ``decay**(k-1)``
    (``exp(-(k-1)/gamma)``, ``weighting="geometric"``) or :func:`dpace_weights`
    (``"dpace"``); :meth:`DFlashTrainer.reduce` divides their sum by the count of
    all terms, as Speculators' ``loss_function`` does."""
    logits = dflash_block_logits(model, target, feats, toks, anchors, mask_id).astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # [B, K, Bs-1, V]
    Bs1 = logp.shape[2]
    j = mx.arange(1, Bs1 + 1)
    pos = anchors[:, :, None] + j[None, None, :]  # the predicted token's position a+k
    # label of x_{a+k}: the target's distribution at position a+k-1
    T = toks.shape[1]
    src = mx.clip(pos - 1, 0, T - 1)
    B, K = anchors.shape
    flat = src.reshape(B, K * Bs1)
    lab = mx.take_along_axis(label_logits, flat[:, :, None], axis=1).reshape(B, K, Bs1, -1)
    lab = lab - mx.logsumexp(lab, axis=-1, keepdims=True)
    tgt = mx.argmax(lab, axis=-1)
    if targets == "soft":
        per = (mx.exp(lab) * (lab - logp)).sum(-1)
    else:
        per = -mx.take_along_axis(logp, tgt[..., None], axis=-1)[..., 0]
    vf = valid.astype(mx.float32)  # [B, K, Bs-1]
    if weighting == "dpace":
        w = dpace_weights(per, vf, alpha)
    else:
        w = (decay ** mx.arange(Bs1, dtype=mx.float32))[None, None]
    n = _sg(vf.sum(axis=(0, 1)))
    sums = (per * vf * w).sum(axis=(0, 1))
    correct = _sg(((mx.argmax(logp, axis=-1) == tgt) & valid).sum(axis=(0, 1)).astype(mx.float32))
    return sums, correct, n


class DFlashTrainer:
    kind = "dflash"

    def __init__(self, target, options: dict, examples, cfg):
        from ..drafters.dflash.config import parse
        from ..drafters.dflash.model import DFlashModel

        opts = dict(options or {})
        tc = type(target).text_config(target.config)
        n = int(tc["num_hidden_layers"])
        geo = next(iter(type(target).attention_geometry(target.config).values()))
        layers = int(opts.pop("num_hidden_layers", 2))
        block = int(opts.pop("block_size", 8))
        ids = opts.pop("target_layer_ids", _dflash_layer_ids(n))
        mask_id = int(opts.pop("mask_token_id", _unused_token(examples, target.vocab_size)))
        rp = dict(tc.get("rope_parameters") or {})
        rp = dict(rp.get("full_attention", rp))
        rp.setdefault("rope_theta", float(tc.get("rope_theta", 10000.0)))
        self.hf_config = {
            "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
            "hidden_size": target.hidden_size, "num_hidden_layers": layers,
            "num_attention_heads": geo["num_attention_heads"], "num_key_value_heads": geo["num_key_value_heads"],
            "head_dim": geo["head_dim"], "intermediate_size": int(opts.pop("intermediate_size", tc.get("intermediate_size") or 4 * target.hidden_size)),
            "rms_norm_eps": float(tc.get("rms_norm_eps", 1e-6)), "rope_theta": rp["rope_theta"], "rope_parameters": rp,
            "max_position_embeddings": int(tc.get("max_position_embeddings", 4096)),
            "layer_types": opts.pop("layer_types", ["full_attention"] * layers), "sliding_window": opts.pop("sliding_window", None),
            "use_sliding_window": False, "vocab_size": target.vocab_size, "num_target_layers": n, "block_size": block,
            "tie_word_embeddings": False,
            "dflash_config": {"block_size": block, "target_layer_ids": list(ids), "mask_token_id": mask_id},
        }
        if opts:
            raise ValueError(f"unknown DFlash drafter option(s): {', '.join(sorted(opts))}")
        if self.hf_config["sliding_window"]:
            self.hf_config["use_sliding_window"] = True
        self.cfg = parse(self.hf_config)
        self.model = DFlashModel(self.cfg)
        mx.eval(self.model.parameters())
        self.target = target
        self.anchors = cfg.anchors
        self.targets = cfg.targets
        self.weighting = "dpace" if cfg.step_weights == "position" else "geometric"
        self.decay, self.alpha = cfg.decay, cfg.dpace_alpha
        self.seed = cfg.seed
        self.config_id = {"kind": "dflash", "config": self.hf_config}
        self.states = TargetStates(target, self.cfg.taps, cfg.tap_cache_mb)

    def batch(self, toks, lmask, lens, step: int, row0: int = 0, idx=None):
        hidden, feats = self.states(toks, lens, idx)
        labels = _sg(self.target.logits(hidden))
        anchors, valid = _anchors(np.array(lmask), np.array(lens), self.anchors, self.cfg.block_size, self.seed, step,
                                  row0)
        return (feats, labels, toks, mx.array(anchors), mx.array(valid))

    def loss(self, model, feats, labels, toks, anchors, valid):
        return dflash_loss_terms(model, self.target, feats, labels, toks, anchors, valid, self.cfg.mask_token_id,
                                 self.targets, self.weighting, self.decay, self.alpha)

    def weights(self, acc_ema):
        """The position weights are inside the terms (:func:`dflash_loss_terms`)."""
        return np.ones(self.cfg.block_size - 1, np.float32)

    @staticmethod
    def reduce(sums, counts, weights):
        """Speculators' reduction: all weighted terms over the count of all terms."""
        return (weights * sums).sum() / mx.maximum(counts.sum(), 1.0), sums / mx.maximum(counts, 1.0)

    def save(self, out, dtype=None):
        from mlx.utils import tree_flatten

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        weights = dict(tree_flatten(self.model.parameters()))
        if dtype:
            dt = getattr(mx, dtype)
            weights = {k: v.astype(dt) for k, v in weights.items()}
        mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps({**self.hf_config, "torch_dtype": dtype or "float32"}, indent=2))


def _dflash_layer_ids(n: int) -> list[int]:
    """DFlash's default target layers (layer outputs) for an ``n``-layer target."""
    return [max(0, n // 4), n // 2, max(0, n - 2)]


def tap_layers(kind: str, target, options) -> tuple[int, ...]:
    """The target layers (mtpflow's tap convention) a fresh drafter of
    ``kind`` with ``options`` reads -- what its trainer's
    :class:`TargetStates` computes, known before the data is loaded."""
    from ..drafters.eagle3.config import default_aux_layer_ids

    opts = dict(options or {})
    n = int(type(target).text_config(target.config)["num_hidden_layers"])
    if kind == "eagle3":
        return tuple(opts.get("aux_layer_ids") or default_aux_layer_ids(n))
    return tuple(int(i) + 1 for i in opts.get("target_layer_ids", _dflash_layer_ids(n)))  # DFlashConfig.taps


def _unused_token(examples, vocab: int) -> int:
    """A token id the data never uses (the DFlash mask token), preferring high ids."""
    seen = np.zeros(vocab, bool)
    for e in examples:
        seen[np.asarray(e.tokens)] = True
    free = np.nonzero(~seen)[0]
    return int(free[-1]) if len(free) else vocab - 1


def _anchors(lmask, lens, k: int, block: int, seed: int, step: int, row0: int = 0):
    """``k`` random anchors per row and, per block row ``1..block-1``, whether
    it is a loss term.  Row ``b`` is row ``row0 + b`` of the global batch,
    whose anchors are a function of ``(seed, step, row)`` alone (the same on
    any number of ranks).  See :func:`_sample_anchors` and :func:`_anchor_valid`."""
    anchors, ok = _sample_anchors(lmask, lens, k, seed, step, row0)
    return anchors, _anchor_valid(lmask, lens, anchors, ok, block)


def _sample_anchors(lmask, lens, k: int, seed: int, step: int, row0: int = 0):
    """Speculators' ``select_anchors`` per row: ``k`` distinct loss positions
    (those followed by a token of the row), sorted; a row with fewer has
    invalid anchors left (``ok`` False)."""
    B, T = lmask.shape
    anchors = np.zeros((B, k), np.int32)
    ok = np.zeros((B, k), bool)
    for b in range(B):
        rng = np.random.default_rng([seed, step, 7, row0 + b])
        cand = np.nonzero(lmask[b, : lens[b]])[0]
        cand = cand[cand + 1 < lens[b]]
        n = min(k, len(cand))
        if n:
            anchors[b, :n] = np.sort(rng.choice(cand, size=n, replace=False))
            ok[b, :n] = True
    return anchors, ok


def _anchor_valid(lmask, lens, anchors, ok, block: int):
    """Block row ``r`` of anchor ``a`` is a loss term when ``a + r`` is a loss
    token inside the row (Speculators' ``loss_mask[anchored_block_indices]``) and
    the anchor is valid."""
    B, k = anchors.shape
    valid = np.zeros((B, k, block - 1), bool)
    for b in range(B):
        for i in range(k):
            if not ok[b, i]:
                continue
            for r in range(1, block):
                p = int(anchors[b, i]) + r
                valid[b, i, r - 1] = p < lens[b] and bool(lmask[b, p])
    return valid


# --------------------------------------------------------------------------------------
# the entry point
# --------------------------------------------------------------------------------------
def train_kind(kind: str, target, drafter_options, data_spec, out: Path, cfg, examples=None, ranks=None) -> dict:
    """Train an ``eagle3`` or ``dflash`` drafter; write it to ``out`` in its
    published format (a Speculators checkpoint / a z-lab DFlash checkpoint).
    Data-parallel over ``ranks`` like the assistant kind
    (:mod:`mtpflow.train.parallel`)."""
    from .loop import optimize, training_data
    from .parallel import world

    if kind == "mtp":
        from .mtp import train_mtp

        return train_mtp(target, drafter_options, data_spec, out, cfg, examples, ranks=ranks)
    ranks = ranks or world()
    if isinstance(drafter_options, (str, Path)) and not str(drafter_options).lstrip().startswith("{"):
        drafter_options = json.loads(Path(drafter_options).read_text())
    taps = tap_layers(kind, target, drafter_options)  # what the drafter reads: cache: features keep them
    examples, feats, distill, cache_summary = training_data(target, data_spec, out, cfg, examples, ranks, taps=taps,
                                                            kv=False)
    mx.random.seed(cfg.seed)
    trainer = (Eagle3Trainer if kind == "eagle3" else DFlashTrainer)(target, drafter_options, examples, cfg)
    if feats is not None and any(f.taps is not None for f in feats):
        trainer.states.preload(feats, taps)
    n_loss = cfg.unroll if kind == "eagle3" else trainer.cfg.block_size - 1

    def make_batch(step, rows):
        idx = data_mod.batch_indices(len(examples), cfg.batch_size, cfg.seed, step, rows)  # the examples of these rows
        toks_np, loss_np, lens_np = data_mod.batches(examples, cfg.batch_size, cfg.seed, step, idx=idx)
        toks, lmask, lens = mx.array(toks_np), mx.array(loss_np), mx.array(lens_np)
        if kind == "eagle3":
            return trainer.batch(toks, lmask, lens, idx=idx), lens_np
        return trainer.batch(toks, lmask, lens, step, rows.start or 0, idx=idx), lens_np

    step, acc_ema, tokens_seen, last, elapsed, speed = optimize(trainer.model, trainer.loss, make_batch, cfg, out,
                                                                trainer.config_id, n_loss,
                                                                data_id=data_mod.fingerprint(examples), ranks=ranks,
                                                                weights=trainer.weights,
                                                                reduce=getattr(trainer, "reduce", None))
    if ranks.main:
        trainer.save(out, dtype=cfg.save_dtype)
    summary = {
        "kind": kind, "steps": step, "tokens_seen": tokens_seen, "elapsed_s": round(elapsed, 1), "train_speed": speed,
        "examples": len(examples),
        "loss_tokens_per_epoch": int(sum(int(e.loss.sum()) for e in examples)), "final": last, "acc_ema": acc_ema,
        "data": data_spec,
    }
    if distill is not None:
        summary["distill"] = distill
    if cache_summary is not None:
        summary["cache"] = cache_summary
    if cfg.tap_cache_mb or trainer.states.from_disk:
        summary["tap_cache"] = trainer.states.summary()
    if ranks.main:
        (out / "train_summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


def geometric_decay(gamma: float) -> float:
    """The per-position decay of DFlash's weights ``exp(-(k-1)/gamma)``."""
    return math.exp(-1.0 / gamma)
