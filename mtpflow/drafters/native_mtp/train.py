"""Training a DeepSeek-style MTP module against a frozen target (``mtpflow train --kind mtp``).

The module is the native-MTP kind's own :class:`~mtpflow.drafters.native_mtp.module.NativeMTP`
(``D`` chained layers, each ``eh_proj([enorm(e); hnorm(h)])``, one decoder
block of the target family's mlx-lm class, ``shared_head.norm``), built by the
family adapter for any mlx-lm target; the target's embedding and LM head are
shared and frozen.  The output folder is the native layout that kind loads
(``--draft-model OUT``; see :mod:`mtpflow.drafters.native_mtp`).

Alignment (0-based; the guide's ``h_1..h_{T-2}`` with ``e_2..e_{T-1}``
predicts ``x_3..x_T`` is depth 1 in 1-based indices).  For a sample
``x_0..x_{T-1}`` with the target's post-norm hidden states ``H_t``:

* depth 1, pair ``i``: ``out1_i = layer_0(e = emb(x_{i+1}), h = H_i)``, at the
  RoPE position of its token ``i + 1``, predicts ``x_{i+2}``;
* depth ``k``, pair ``i``: ``out_k_i = layer_{k-1}(emb(x_{i+k}), out_{k-1}_i)``
  at position ``i + k``, predicts ``x_{i+k+1}``;

pairs attend causally to the pairs of their own depth (DeepSeek-V3's
training).  The label of the pair predicting ``x_j`` is the target's
distribution at ``j - 1`` (``targets="soft"``, KL) or its argmax (``"hard"``),
counted when ``x_j`` is a loss token.

Packing: the examples of a step are packed into rows of at most ``max_len``
tokens (next fit, in batch order).  Each pair sees only pairs of its own
sample (a block-diagonal mask), its RoPE position restarts with the sample,
and a pair whose prediction would leave its sample carries no loss: a pair
``i`` of depth ``k`` counts only when tokens ``i`` and ``i + k + 1`` belong to
the same sample.  The decoder blocks run at every slot (their pairs are the
keys of the later ones); the target's LM head, for the labels and for each
depth's logits, runs only at the slots that carry loss (:func:`loss_plan`).

Loss weights per depth: ``depth_weights`` in ``--drafter-config`` (normalised),
else ``--step-weights`` / ``--decay`` as for the other kinds.

Drafter options (``--drafter-config``): ``depth`` (``D``, default 1),
``depth_weights``, ``init`` (``"last_layer"``, default: every block starts as a
copy of the target's last decoder layer, ``eh_proj`` passes the hidden half
through and ``shared_head.norm`` is the target's final norm;
``"random"``), ``from_target`` (fine-tune the target checkpoint's own native
head, e.g. on ``distill:`` data).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from ...targets.base import TreeRope
from ...train import data as data_mod
from ...train import target as frozen
from ...train.kind import KindTrainer, add_data_summaries, read_options
from ...train.objective import label_top, logit_terms, shift, soft_labels
from ...train.optimize import optimize
from ...train.parallel import world
from ...train.sources import training_data
from .families import NativeLayout, family_for, text_config


def _sg(x):
    return mx.stop_gradient(x)


# ------------------------------------------------------------------------------ packing
def pack(lengths, max_len: int) -> list[list[int]]:
    """Rows of a packed batch: lists of indices into ``lengths`` (next fit in
    order; an example longer than ``max_len`` gets a row of its own)."""
    rows, cur, used = [], [], 0
    for i, n in enumerate(int(x) for x in lengths):
        if cur and used + n > max_len:
            rows.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        rows.append(cur)
    return rows


def pack_plan(lengths, max_len: int, pad_multiple: int = 16):
    """Gather indices of a packed batch, for examples laid out one per row of
    a ``[B, T]`` padded batch: ``(src [R, L], seg [R, L], pos [R, L])`` --
    ``src``: flat index ``b * T + t`` of each packed slot (0 on padding),
    ``seg``: its sample (1, 2, ... within a row; 0: padding), ``pos``: its
    position inside the sample."""
    lengths = [int(x) for x in lengths]
    T = max(lengths)
    rows = pack(lengths, max_len)
    L = max(sum(lengths[i] for i in r) for r in rows)
    L = -(-L // pad_multiple) * pad_multiple
    src = np.zeros((len(rows), L), np.int32)
    seg = np.zeros((len(rows), L), np.int32)
    pos = np.zeros((len(rows), L), np.int32)
    for r, members in enumerate(rows):
        c = 0
        for s, b in enumerate(members):
            n = lengths[b]
            src[r, c: c + n] = b * T + np.arange(n)
            seg[r, c: c + n] = s + 1
            pos[r, c: c + n] = np.arange(n)
            c += n
    return src, seg, pos


def gather_packed(x: mx.array, src: mx.array) -> mx.array:
    """``x [B, T, ...]`` at the packed slots ``src [R, L]`` -> ``[R, L, ...]``."""
    B, T = x.shape[:2]
    flat = x.reshape(B * T, *x.shape[2:])
    return mx.take(flat, src.reshape(-1), axis=0).reshape(*src.shape, *x.shape[2:])


# ------------------------------------------------------------------------------ the forward
@contextlib.contextmanager
def positions_at(module, positions: mx.array):
    """Every attention RoPE inside ``module`` applied at per-token
    ``positions [B, L]`` (whatever offset the layer code passes)."""
    saved = []
    for _, m in module.named_modules():
        rope = getattr(m, "rope", None)
        if rope is not None and not isinstance(rope, TreeRope) and hasattr(m, "__dict__"):
            saved.append((m, rope))
    for m, rope in saved:
        m.rope = TreeRope(rope, positions)
    try:
        yield
    finally:
        for m, rope in saved:
            m.rope = rope


def pair_mask(seg: mx.array) -> mx.array:
    """``[R, 1, L, L]``: pair ``i`` sees pairs ``j <= i`` of its own sample."""
    L = seg.shape[1]
    t = mx.arange(L)
    causal = t[None, :] <= t[:, None]
    return ((seg[:, None, :] == seg[:, :, None]) & causal[None])[:, None]


def mtp_outputs(head, embed, H: mx.array, toks: mx.array, seg: mx.array, pos: mx.array, depth: int | None = None):
    """The outputs ``[R, L, H]`` of depths ``1..D`` over a packed batch (see the
    module docstring): depth ``k``'s row ``i`` predicts ``x_{i+k+1}``."""
    mask = pair_mask(seg)
    h, outs = H, []
    for k in range(1, (depth or head.depth) + 1):
        layer = head.layers[k - 1]
        with positions_at(layer.block, pos + k):
            h = layer(embed(shift(toks, k)), h, mask)
        outs.append(h)
    return outs


def loss_plan(seg: np.ndarray, lmask: np.ndarray, depth: int):
    """Where a packed batch's loss is (host arrays ``seg``, ``lmask`` ``[R, L]``):
    ``(label_at [P], pairs)``.  ``pairs[k - 1] = (at [N_k], lab [N_k])``: the
    flat slots ``r * L + i`` of depth ``k``'s pairs that carry loss (slot
    ``i + k + 1`` a loss token of the same sample) and, for each, the index into
    ``label_at`` of its label's slot ``i + k``; ``label_at``: the sorted slots
    whose label some pair reads.  The LM heads and the labels are computed at
    these slots only, not at the prompt, padding and sample ends."""
    R, L = seg.shape
    pairs = []
    for k in range(1, depth + 1):
        nxt_seg, nxt_loss = np.zeros_like(seg), np.zeros_like(lmask, dtype=bool)
        if k + 1 < L:
            nxt_seg[:, : L - k - 1], nxt_loss[:, : L - k - 1] = seg[:, k + 1:], lmask[:, k + 1:]
        r, i = np.nonzero((seg > 0) & (nxt_seg == seg) & nxt_loss)
        pairs.append(((r * L + i).astype(np.int32), (r * L + i + k).astype(np.int32)))
    label_at = np.unique(np.concatenate([j for _, j in pairs])).astype(np.int32)
    return label_at, [(at, np.searchsorted(label_at, j).astype(np.int32)) for at, j in pairs]


def rows_at(x: mx.array, at) -> mx.array:
    """``x [R, L, ...]`` at the flat slots ``at [N]`` -> ``[N, ...]``."""
    R, L = x.shape[:2]
    return mx.take(x.reshape(R * L, *x.shape[2:]), at if isinstance(at, mx.array) else mx.array(at), axis=0)


def mtp_loss_terms(head, target, H, labels, toks, seg, pos, lmask, targets: str = "soft"):
    """Unnormalised per-depth ``(loss_sum [D], correct [D], count [D])``.
    ``labels``: the target's logits ``[R, L, V]`` at every packed slot (soft),
    or its argmax ``[R, L]`` (hard).  (Reads ``seg`` and ``lmask`` on the host:
    the trainer plans its batches with :func:`loss_plan` and calls
    :func:`mtp_planned_terms`.)"""
    label_at, pairs = loss_plan(np.array(seg), np.array(lmask), head.depth)
    lab = rows_at(labels, label_at)
    pairs = [(mx.array(at), mx.array(j)) for at, j in pairs]
    return mtp_planned_terms(head, target, H, lab, toks, seg, pos, pairs, targets)


def mtp_planned_terms(head, target, H, labels, toks, seg, pos, pairs, targets: str = "soft"):
    """:func:`mtp_loss_terms` at the slots of :func:`loss_plan`: ``labels`` the
    target's logits or log-distributions ``[P, V]`` (soft) or argmax ``[P]`` (hard) at
    ``label_at``, ``pairs`` the plan's ``(at, lab)`` per depth as arrays."""
    sums, correct, counts = [], [], []
    soft = labels.ndim == 2
    tgt_all, top = label_top(labels) if soft else (labels, None)
    soft_all = soft_labels(labels, top) if soft else None  # once for every depth's rows
    for (at, j), out in zip(pairs, mtp_outputs(head, target.embed, H, toks, seg, pos)):
        x = target.logits(rows_at(out, at)).astype(mx.float32)
        # the target's distribution of x_{i+k+1}
        lab = None if soft_all is None else tuple(mx.take(a, j, axis=0) for a in soft_all)
        s, c, n = logit_terms(x, mx.take(tgt_all, j, axis=0), mx.ones(at.shape, mx.bool_), lab)
        sums.append(s)
        correct.append(c)
        counts.append(n)
    return mx.stack(sums), mx.stack(correct), mx.stack(counts)


# ------------------------------------------------------------------------------ the module
def native_config(target, depth: int) -> dict:
    """The exported module's config.json: the target's, plus ``num_nextn_predict_layers``."""
    return {**dict(target.config), "num_nextn_predict_layers": int(depth)}


def new_head(target, depth: int, init: str = "last_layer"):
    """``(family, NativeMTP)``: a fresh ``depth``-layer head for ``target``."""
    from mlx.utils import tree_flatten

    cfg = native_config(target, depth)
    fam = family_for(cfg) or NativeLayout
    head = fam.build(target.model, cfg, depth)
    if init == "last_layer":
        last = dict(tree_flatten(target.decoder_layers[-1].parameters()))
        Hd = target.hidden_size
        norm = getattr(target.inner, "norm", None)
        for layer in head.layers:
            mine = dict(tree_flatten(layer.block.parameters()))
            if set(mine) == set(last) and all(mine[k].shape == last[k].shape for k in mine):
                layer.block.load_weights([(k, v.astype(mx.float32)) for k, v in last.items()])
            w = mx.random.normal((Hd, 2 * Hd)) * (2 * Hd) ** -0.5 * 0.1
            w[:, Hd:] = mx.eye(Hd) + w[:, Hd:]
            layer.eh_proj.weight = w
            if norm is not None and getattr(norm, "weight", None) is not None and norm.weight.shape == (Hd,):
                layer.shared_head.norm.weight = norm.weight.astype(mx.float32)
    elif init != "random":
        raise ValueError(f"mtp drafter option init must be 'last_layer' or 'random' (got {init!r})")
    head.set_dtype(mx.float32)
    mx.eval(head.parameters())
    return fam, head


def save_native(head, target, out, dtype: str | None = None) -> Path:
    """Write ``head`` in the native layout (the native-MTP kind's loader contract)."""
    from mlx.utils import tree_flatten

    from .module import to_native

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    n = int(text_config(target.config)["num_hidden_layers"])
    weights = to_native(dict(tree_flatten(head.parameters())), n)
    if dtype:
        weights = {k: v.astype(getattr(mx, dtype)) for k, v in weights.items()}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    cfg = native_config(target, head.depth)
    if dtype:
        cfg["torch_dtype"] = dtype
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


class MTPTrainer(KindTrainer):
    """``mtpflow train --kind mtp``: one run's trainer of an MTP module, written in the
    native layout (:func:`save_native`)."""

    kind = "mtp"
    options = "mtpflow.drafters.native_mtp.config:TrainOptions"

    def __init__(self, target, options: dict, examples, cfg):
        opts = dict(options or {})
        self.target, self.targets, self.max_len = target, cfg.targets, cfg.max_len
        from_target = bool(opts.pop("from_target", False))
        if from_target:
            from .drafter import load_head

            self.family, self.model, _ = load_head(Path(target.path), target.model, "float32")
            depth = self.model.depth
            opts.pop("depth", None)
        else:
            depth = int(opts.pop("depth", 1))
            if depth < 1:
                raise ValueError(f"mtp drafter option depth must be >= 1 (got {depth})")
            self.family, self.model = new_head(target, depth, opts.pop("init", "last_layer"))
        w = opts.pop("depth_weights", None)
        if opts:
            raise ValueError(f"unknown mtp drafter option(s): {', '.join(sorted(opts))} "
                             "(depth, depth_weights, init, from_target)")
        if w is not None:
            w = np.asarray(w, np.float64)
            if w.shape != (depth,) or (w < 0).any() or w.sum() <= 0:
                raise ValueError(f"mtp drafter option depth_weights needs {depth} non-negative weights (got {list(w)})")
            w = (w / w.sum()).astype(np.float32)
        self.weights = w
        self.depth = depth
        self.config_id = {"kind": "mtp", "depth": depth, "from_target": from_target,
                          "depth_weights": None if w is None else [float(x) for x in w]}

    def batch(self, H: mx.array, toks_np, lmask_np, lens_np, argmax_np=None):
        """Pack one step's examples (``H [B, T, H]`` the target's post-norm
        states of the padded batch) and make the labels, at the slots that
        carry loss only (:func:`loss_plan`).  ``argmax_np [B, T]``: the
        target's greedy token wherever the next token carries loss (cached
        features), the hard labels without an LM-head product."""
        src, seg, pos = pack_plan(lens_np, self.max_len)
        Hp = _sg(gather_packed(H, mx.array(src)))
        toks = mx.array(toks_np.reshape(-1)[src])
        label_at, pairs = loss_plan(seg, lmask_np.reshape(-1)[src] & (seg > 0), self.depth)
        if self.targets == "hard" and argmax_np is not None:
            labels = mx.array(np.maximum(argmax_np.reshape(-1)[src].reshape(-1)[label_at], 0).astype(np.int32))
        else:
            logits = self.target.logits(rows_at(Hp, label_at))
            # soft: the logits (soft_labels normalises them, one exp); hard: their argmax
            labels = _sg(logits if self.targets == "soft" else mx.argmax(logits, axis=-1).astype(mx.int32))
        pairs = [(mx.array(at), mx.array(j)) for at, j in pairs]
        return (Hp, labels, toks, mx.array(seg), mx.array(pos), pairs)

    def loss(self, model, H, labels, toks, seg, pos, pairs):
        return mtp_planned_terms(model, self.target, H, labels, toks, seg, pos, pairs, self.targets)

    def save(self, out, dtype=None):
        save_native(self.model, self.target, out, dtype)

    @classmethod
    def train(cls, target, options, data_spec, out: Path, cfg, examples=None, ranks=None) -> dict:
        """Train an MTP module (see the module docstring); write it in the native
        layout to ``out``.  ``cache:`` / ``distill:`` data train from the cached
        post-norm hidden states (no target forward per step)."""
        ranks = ranks or world()
        options = read_options(options)
        examples, feats, distill, cache_summary = training_data(target, data_spec, out, cfg, examples, ranks, taps=(),
                                                                kv=False)
        mx.random.seed(cfg.seed)
        trainer = cls(target, options, examples, cfg)

        def make_batch(step, rows):
            idx = data_mod.batch_indices(len(examples), cfg.batch_size, cfg.seed, step, rows)
            toks_np, loss_np, lens_np = data_mod.batches(examples, cfg.batch_size, cfg.seed, step, idx=idx)
            if feats is not None:
                H, argmax = cached_states(feats, idx, toks_np.shape[1])
            else:
                H, argmax = frozen.target_states(target, mx.array(toks_np), ())[0], None
            return trainer.batch(H, toks_np, loss_np, lens_np, argmax), lens_np

        weights = None if trainer.weights is None else (lambda acc_ema: trainer.weights)
        step, acc_ema, tokens_seen, last, elapsed, speed = optimize(
            trainer.model, trainer.loss, make_batch, cfg, out, trainer.config_id, trainer.depth,
            data_id=data_mod.fingerprint(examples), ranks=ranks, weights=weights)
        if ranks.main:
            trainer.save(out, dtype=cfg.save_dtype)
        summary = {
            "kind": "mtp", "steps": step, "tokens_seen": tokens_seen, "elapsed_s": round(elapsed, 1),
            "train_speed": speed, "examples": len(examples), "depth": trainer.depth,
            "loss_tokens_per_epoch": int(sum(int(e.loss.sum()) for e in examples)), "final": last,
            "acc_ema": acc_ema, "data": data_spec, "from_cache": feats is not None,
        }
        add_data_summaries(summary, distill, cache_summary)
        if ranks.main:
            (out / "train_summary.json").write_text(json.dumps(summary, indent=2, default=str))
        return summary


def cached_states(feats, idx, T: int) -> tuple[mx.array, np.ndarray]:
    """``(H [B, T, D] float32, argmax [B, T])`` of the cached examples ``idx``:
    their post-norm states and the target's argmax, padded to ``T``."""
    H = mx.array(np.stack([np.pad(feats[int(i)].hidden, ((0, T - len(feats[int(i)])), (0, 0))) for i in idx]))
    H = H.astype(mx.float32)
    argmax = np.stack([np.pad(_argmax(feats[int(i)]), (0, T - len(feats[int(i)])), constant_values=-1) for i in idx])
    return H, argmax


def _argmax(f) -> np.ndarray:
    """A cached example's target argmax wherever the next token carries loss
    (``distill:`` features: the next token itself, the target's greedy output)."""
    if f.argmax is not None:
        return f.argmax
    am = np.full(len(f), -1, np.int32)
    nxt = np.nonzero(f.loss[1:])[0]
    am[nxt] = f.tokens[nxt + 1]
    return am
