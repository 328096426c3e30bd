"""Training the DFlash drafter kind against a frozen target (``mtpflow train --kind dflash``).

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

The target's states come from one teacher-forced target forward per batch,
from ``cache:`` features that keep the layers the drafter reads (:meth:`DFlashTrainer.tap_layers`), or from memory with
``--tap-cache-mb`` (:class:`mtpflow.train.target.TargetStates`); the target never receives
gradients, and the run is :class:`mtpflow.train.kind.TappedTrainer`'s.  Checked against
Speculators 0.9.0's own training step -- loss, gradients and AdamW updates over several steps --
in ``tests/test_train_parity.py``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlx.core as mx
import numpy as np

from ...targets.base import rope_at
from ...train.kind import TappedTrainer
from ...train.objective import label_top, logit_loss, soft_labels, top_hit
from ...train.target import TargetStates
from .config import parse
from .model import DFlashModel


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
        q, k = rope_at(att.rope, q, qpos), rope_at(att.rope, k, qpos)
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
    q = mx.exp(-mx.stop_gradient(per * vf))
    smooth = mx.where(vf > 0, (1.0 - alpha) * q + alpha, 1.0)
    prefix = mx.cumprod(smooth, axis=-1)
    suffix = mx.cumsum((prefix * vf)[..., ::-1], axis=-1)[..., ::-1]
    return mx.stop_gradient(suffix * vf)


def label_positions(anchors, block: int, T: int):
    """``[B, K * (block-1)]``: the position ``a+k-1`` of the label of every block row
    ``k = 1 .. block-1`` of the anchors ``a [B, K]`` (the target's distribution
    there predicts ``x_{a+k}``), clipped to the row.  NumPy in, NumPy out; MLX in, MLX out."""
    xp = np if isinstance(anchors, np.ndarray) else mx
    B, K = anchors.shape
    src = anchors[:, :, None] + xp.arange(block - 1, dtype=anchors.dtype)[None, None, :]
    return xp.clip(src, 0, T - 1).reshape(B, K * (block - 1))


def block_label_logits(target, hidden: mx.array, anchors: np.ndarray, block: int) -> mx.array:
    """The target's logits at :func:`label_positions` ``[B, K*(block-1), V]``, from its
    final states ``hidden [B, T, H]``: the head runs on those rows only where they are
    fewer than the ``T`` positions (8 anchors of a block of 8 need 56 of them), else on
    every position, gathered after."""
    T = hidden.shape[1]
    src = mx.array(label_positions(np.asarray(anchors), block, T))
    if src.shape[1] < T:
        return target.logits(mx.take_along_axis(hidden, src[:, :, None], axis=1))
    return mx.take_along_axis(target.logits(hidden), src[:, :, None], axis=1)


def dflash_loss_terms(model, target, feats, label_logits, toks, anchors, valid, mask_id: int, targets: str,
                      weighting: str = "geometric", decay: float = math.exp(-0.25), alpha: float = 0.5,
                      gathered: bool = False):
    """Speculators' DFlash loss terms over block rows ``1..Bs-1``:
    ``(per_row_weighted_loss_sum, per_row_correct, per_row_count)``.  Each term
    is the row's loss (``hard``: cross-entropy on the target's argmax, Speculators'
    default ``ce``; ``soft``: KL) times its weight -- ``decay**(k-1)``
    (``exp(-(k-1)/gamma)``, ``weighting="geometric"``) or :func:`dpace_weights`
    (``"dpace"``); :meth:`DFlashTrainer.reduce` divides their sum by the count of
    all terms, as Speculators' ``loss_function`` does.  ``label_logits``: the
    target's logits at every position ``[B, T, V]``, or with ``gathered`` at the
    block rows' label positions (:func:`block_label_logits`)."""
    logits = dflash_block_logits(model, target, feats, toks, anchors, mask_id).astype(mx.float32)  # [B, K, Bs-1, V]
    B, K, Bs1 = logits.shape[:3]
    if not gathered:  # label of x_{a+k}: the target's distribution at position a+k-1
        flat = label_positions(anchors, Bs1 + 1, toks.shape[1])
        label_logits = mx.take_along_axis(label_logits, flat[:, :, None], axis=1)
    lab = label_logits.reshape(B, K, Bs1, -1)
    tgt, top = label_top(lab)  # (soft_labels normalises the logits itself, from their maximum)
    per, m = logit_loss(logits, tgt, soft_labels(lab, top) if targets == "soft" else None, with_max=True)  # (logit_terms)
    vf = valid.astype(mx.float32)  # [B, K, Bs-1]
    if weighting == "dpace":
        w = dpace_weights(per, vf, alpha)
    else:
        w = (decay ** mx.arange(Bs1, dtype=mx.float32))[None, None]
    n = mx.stop_gradient(vf.sum(axis=(0, 1)))
    sums = (per * vf * w).sum(axis=(0, 1))
    correct = mx.stop_gradient((top_hit(logits, tgt, m) & valid).sum(axis=(0, 1)).astype(mx.float32))
    return sums, correct, n


class DFlashTrainer(TappedTrainer):
    """One run's DFlash trainer: a fresh drafter (``num_hidden_layers``, ``block_size``,
    ``target_layer_ids``, ``mask_token_id`` ... from ``--drafter-config``)."""

    kind = "dflash"
    options = "mtpflow.drafters.dflash.config:TrainOptions"

    def __init__(self, target, options: dict, examples, cfg):
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
        self.n_loss = self.cfg.block_size - 1

    def batch(self, toks, lmask, lens, step: int, row0: int = 0, idx=None):
        hidden, feats = self.states(toks, lens, idx)
        anchors, valid = _anchors(np.array(lmask), np.array(lens), self.anchors, self.cfg.block_size, self.seed, step,
                                  row0)
        labels = mx.stop_gradient(block_label_logits(self.target, hidden, anchors, self.cfg.block_size))
        return (feats, labels, toks, mx.array(anchors), mx.array(valid))

    def step_batch(self, toks, lmask, lens, step: int, row0: int, idx):
        return self.batch(toks, lmask, lens, step, row0, idx=idx)

    @classmethod
    def tap_layers(cls, target, options) -> tuple[int, ...]:
        """The context layers a fresh drafter reads (``target_layer_ids`` + 1:
        :attr:`mtpflow.drafters.dflash.config.DFlashConfig.taps`)."""
        n = int(type(target).text_config(target.config)["num_hidden_layers"])
        return tuple(int(i) + 1 for i in dict(options or {}).get("target_layer_ids", _dflash_layer_ids(n)))

    def loss(self, model, feats, labels, toks, anchors, valid):
        return dflash_loss_terms(model, self.target, feats, labels, toks, anchors, valid, self.cfg.mask_token_id,
                                 self.targets, self.weighting, self.decay, self.alpha, gathered=True)

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


def geometric_decay(gamma: float) -> float:
    """The per-position decay of DFlash's weights ``exp(-(k-1)/gamma)``."""
    return math.exp(-1.0 / gamma)
