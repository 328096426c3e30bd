"""Training loop for the generic assistant drafter against a frozen target.

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
  ``>= t - window``, :func:`mtpflow.drafters.gemma4_assistant.masks.drafter_mask`);
* it predicts ``x_{t+2+i}``; the label is the target's own distribution
  ``softmax(L_{t+1+i})`` (``targets="soft"``, loss = KL(target || drafter))
  or its argmax (``targets="hard"``, cross-entropy).

A term counts when the predicted token is inside the example and flagged as a
loss token (assistant turns).  Step weights: ``"geometric"``
``w_i = decay**i``, or ``"position"`` (D-PACE-like): with the running greedy
acceptance ``a_j`` of step ``j`` (EMA of the per-step accuracy),
``E[tau] = 1 + sum_k prod_{j<=k} a_j`` and ``w_i = dE[tau]/da_i =
prod_{j<i} a_j * (1 + sum_{k>i} prod_{i<m<=k} a_m)`` -- a step is weighted by
how much its acceptance adds to the expected acceptance length.  Weights are
normalised to sum to 1.

The target never receives gradients: its forward runs outside the
differentiated function and its outputs pass through ``mx.stop_gradient``;
only the drafter's parameters are handed to ``value_and_grad``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_map

from ..drafters.gemma4_assistant.masks import drafter_mask
from ..drafters.mtpflow_assistant.config import make_config, check_compatible
from ..drafters.mtpflow_assistant.drafter import save_drafter
from ..drafters.mtpflow_assistant.model import GenericAssistantModel
from ..targets.base import SLIDING
from . import data as data_mod
from .checkpoint import CheckpointError, load_checkpoint, repair_log, save_checkpoint  # noqa: F401 (re-exported)
from .parallel import Ranks, device, rate_text, throughput, world


@dataclass
class TrainConfig:
    steps: int = 1000
    batch_size: int = 8
    max_len: int = 512
    lr: float = 5e-4
    warmup: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    unroll: int = 3
    step_weights: str = "geometric"  # or "position"
    decay: float = 0.8
    targets: str = "soft"  # or "hard"
    seed: int = 0
    checkpoint_every: int = 100
    log_every: int = 10
    max_time_s: float | None = None
    #: stop (checkpointed) after this step without changing the schedule; resume later
    stop_at: int | None = None
    save_dtype: str | None = None
    progress: bool = True
    ema: float = 0.9
    #: ``distill:`` data: tokens the target generates per prompt, rows per batch, time limit
    distill_tokens: int = 128
    distill_batch: int = 32
    distill_time_s: float | None = None
    #: ``cache:`` data: rows per teacher-forced target forward, time limit of the feature collection
    cache_batch: int = 8
    cache_time_s: float | None = None
    #: drafter initialisation: "identity" (h' starts as the target's hidden state) or "random"
    init: str = "identity"
    #: a data spec whose tokens also rank the draft vocabulary (``draft_vocab_size``)
    vocab_data: str | None = None
    #: warm start: a trained drafter folder (or packaged drafter name) whose config, weights and
    #: draft vocabulary the run starts from (a fresh optimiser and schedule); replaces ``init``
    init_from: str | None = None
    #: drafter kind: "assistant" (mtpflow's KV-sharing MTP drafter), "eagle3", "dflash"
    kind: str = "assistant"
    #: dflash: anchor positions (blocks) per sequence and step
    anchors: int = 8
    #: eagle3 / dflash: keep the target's states of up to this many MiB of examples in
    #: memory, so a batch of kept examples skips the target forward (0 = off)
    tap_cache_mb: float = 0.0
    #: learning-rate schedule after the warm-up: "cosine" (to ``min_lr_ratio``) or "linear"
    #: (to 0, Hugging Face's get_linear_schedule_with_warmup, Speculators' default)
    schedule: str = "cosine"
    #: dflash D-PACE: confidence smoothing ``(1 - a) * exp(-loss) + a`` (Speculators' dpace_alpha)
    dpace_alpha: float = 0.5
    #: memory budget (mtpflow.train.memory): "adamw" or "adafactor" (factored second moments)
    optimizer: str = "adamw"
    #: micro-batches per optimizer step (the gradient of the whole batch, in batch/N rows at a time)
    grad_accum: int = 1
    #: recompute the drafter layers' activations in the backward pass (mx.checkpoint)
    grad_checkpoint: bool = False
    #: quantize the frozen target to 4 or 8 bits before training (None: as loaded)
    target_bits: int | None = None
    #: ``cache:`` data: the features folder (default ``OUT/features-cache``); kinds trained on the
    #: same data share one (each reads the layers it needs)
    cache_dir: str | None = None
    #: ``cache:`` data: target layers collected besides the kind's own, so that other kinds can
    #: train from the same ``cache_dir`` (e.g. EAGLE-3's and DFlash's layers together)
    cache_taps: tuple = ()

    def __post_init__(self):
        if self.step_weights not in ("geometric", "position"):
            raise ValueError(f"step_weights must be 'geometric' or 'position' (got {self.step_weights!r})")
        if self.targets not in ("soft", "hard"):
            raise ValueError(f"targets must be 'soft' or 'hard' (got {self.targets!r})")
        if self.unroll < 1:
            raise ValueError("unroll must be >= 1")
        if self.init not in ("identity", "random"):
            raise ValueError(f"init must be 'identity' or 'random' (got {self.init!r})")
        if self.kind not in ("assistant", "eagle3", "dflash", "mtp"):
            raise ValueError(f"kind must be 'assistant', 'eagle3', 'dflash' or 'mtp' (got {self.kind!r})")
        if self.kind != "assistant" and self.init_from:
            raise ValueError("--init-from warm-starts assistant drafters only")
        if self.tap_cache_mb < 0:
            raise ValueError(f"tap_cache_mb must be >= 0 (got {self.tap_cache_mb})")
        from .memory import check_config

        check_config(self)
        if self.tap_cache_mb and self.kind == "assistant":
            raise ValueError("--tap-cache-mb is for --kind eagle3 / dflash; the assistant kind caches its features "
                             "with cache: data (e.g. --data cache:sharegpt:2000)")


# ------------------------------------------------------------------------------ objective
def step_weights(kind: str, n: int, decay: float = 0.8, acc: list[float] | None = None) -> np.ndarray:
    """Normalised per-step loss weights (see the module docstring)."""
    if kind == "geometric":
        w = decay ** np.arange(n, dtype=np.float64)
    else:
        a = np.clip(np.asarray(acc if acc is not None else [0.5] * n, np.float64), 0.05, 0.99)
        w = np.zeros(n)
        for i in range(n):
            before = np.prod(a[:i])
            tail, run = 1.0, 1.0
            for k in range(i + 1, n):
                run *= a[k]
                tail += run
            w[i] = before * tail
    return (w / w.sum()).astype(np.float32)


def _shift(a: mx.array, k: int) -> mx.array:
    """``out[:, t] = a[:, t + k]`` (zero past the end)."""
    if k == 0:
        return a
    T = a.shape[1]
    if k >= T:
        return mx.zeros_like(a)
    pad = mx.zeros((a.shape[0], k, *a.shape[2:]), a.dtype)
    return mx.concatenate([a[:, k:], pad], axis=1)


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


def choose_draft_vocab(examples, vocab_size: int, k: int, always=(), extra=None) -> np.ndarray:
    """The ``k`` most frequent loss tokens of the training data (EAGLE-3's
    reduced draft vocabulary), plus ``always`` (EOS ids); sorted ids.

    ``extra``: more examples (``--vocab-data``) whose token frequencies are
    added with the same total weight as the training data's -- a large text
    corpus fixes the ranking of tokens a small training set sees rarely."""

    def freq(exs):
        counts = np.zeros(vocab_size, np.float64)
        for e in exs:
            counts += np.bincount(e.tokens[e.loss], minlength=vocab_size)[:vocab_size]
        return counts / max(counts.sum(), 1.0)

    counts = freq(examples)
    if extra:
        counts = counts + freq(extra)
    for t in always:
        counts[t] = counts.max() + 1
    top = np.argsort(-counts, kind="stable")[:k]
    return np.sort(top).astype(np.int32)


def unrolled_logp(model: GenericAssistantModel, tp: dict, T: int, unroll: int):
    """The training-time test: yields, for ``i = 0 .. unroll-1``, the drafter's
    log-probabilities ``[B, T, V']`` (over its head's vocabulary) of
    ``x_{t+2+i}`` at every query position ``t``, with teacher-forced input
    tokens and its own ``h'`` fed back, queries at the constant position
    ``t + 1`` -- exactly what inference computes along an accepted prefix."""
    types = set(model.layer_types)
    kv = {t: tp["kv"][t] for t in types}
    qpos = tp.get("qpos")
    masks = train_masks({t: (tp["positions"][t], None) for t in types}, T, model.sliding_window, qpos)
    offset = 1 if qpos is None else qpos[:, 0] + 1
    h = tp["hidden"]
    for i in range(unroll):
        emb_in = _shift(tp["embed"], 1 + i)
        z, h = model(mx.concatenate([emb_in, h.astype(emb_in.dtype)], axis=-1), kv, masks, offset)
        logits = model.head_logits(z).astype(mx.float32)
        yield logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def drafter_loss_terms(model: GenericAssistantModel, tp: dict, tokens, loss_mask, lengths, unroll: int, targets: str):
    """The unnormalised terms of the objective over ``unroll`` steps:
    ``(per_step_loss_sum [S], per_step_correct [S], per_step_count [S])``
    (:func:`weighted_loss` turns them into the loss; data-parallel training
    normalises by the counts of the whole global batch).

    With ``tp["qpos"]`` ``[B, T]`` the query-side arrays (hidden, embed,
    label logits, argmax, ``tokens``, ``loss_mask``) hold a contiguous window
    of each row starting at ``qpos[:, 0]`` (positions that feed no loss term are
    left out, :func:`mtpflow.train.features.feature_batch`); the K/V side is
    always whole."""
    B, T = tokens.shape
    qpos = tp.get("qpos")
    tpos = mx.arange(T, dtype=mx.int32)[None] if qpos is None else qpos
    tgt_logp = tp["label_logits"] - mx.logsumexp(tp["label_logits"], axis=-1, keepdims=True)
    sub = model.draft_vocab if model.has_draft_vocab else None
    sums, correct, counts = [], [], []
    for i, logp in enumerate(unrolled_logp(model, tp, T, unroll)):
        lab_logp = _shift(tgt_logp, 1 + i)  # target distribution of x_{t+2+i}
        valid = (tpos + 2 + i < lengths[:, None]) & _shift(loss_mask, 2 + i)
        vf = valid.astype(mx.float32)
        tgt_tok = _shift(tp["argmax"], 1 + i)  # the target's greedy x_{t+2+i}
        if targets == "soft":
            p = mx.exp(lab_logp)
            per = (p * (lab_logp - logp)).sum(-1)  # KL(target || drafter) over the head's vocabulary
        else:
            safe = mx.maximum(tgt_tok, 0)  # -1: no greedy label there (never a valid term)
            lab = safe if sub is None else tp["inv"][safe]
            if sub is not None:
                valid = valid & (lab >= 0)
                vf = valid.astype(mx.float32)
                lab = mx.maximum(lab, 0)
            per = -mx.take_along_axis(logp, lab[..., None], axis=-1)[..., 0]
        pred = mx.argmax(logp, axis=-1)
        if sub is not None:
            pred = sub[pred]
        hit = (pred == tgt_tok).astype(mx.float32)
        sums.append((per * vf).sum())
        correct.append(mx.stop_gradient((hit * vf).sum()))
        counts.append(mx.stop_gradient(vf.sum()))
    return mx.stack(sums), mx.stack(correct), mx.stack(counts)


def weighted_loss(sums: mx.array, counts: mx.array, weights: mx.array) -> tuple[mx.array, mx.array]:
    """``(loss, per_step_loss)``: each step's mean over its ``counts`` terms,
    weighted by ``weights``."""
    per = sums / mx.maximum(counts, 1.0)
    return (weights * per).sum(), per


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


# ------------------------------------------------------------------------------ helpers
def _schedule(cfg: TrainConfig):
    decay_steps = max(1, cfg.steps - cfg.warmup)
    if cfg.schedule == "linear":  # lr * max(0, (steps - s) / (steps - warmup)) after a linear warm-up from 0
        return lambda s: cfg.lr * mx.where(s < cfg.warmup, s / max(1, cfg.warmup),
                                           mx.maximum(0.0, (cfg.steps - s) / decay_steps))
    cos = optim.cosine_decay(cfg.lr, decay_steps, cfg.lr * cfg.min_lr_ratio)
    if cfg.warmup <= 0:
        return cos
    warm = optim.linear_schedule(cfg.lr / max(1, cfg.warmup), cfg.lr, cfg.warmup)
    return optim.join_schedules([warm, cos], [cfg.warmup])


def _load_target(target, bits: int | None = None):
    """A target adapter (float32); ``bits``: quantized to 4 / 8 bits while it
    loads (:func:`mtpflow.train.memory.quantized_from_path`)."""
    if not isinstance(target, (str, Path)):
        if bits:
            from .memory import quantize_target

            quantize_target(target, bits)
        return target
    from ..engine import resolve_model
    from ..plugins import get_plugins
    from ..targets.base import read_config

    path = resolve_model(str(target))
    cfg = read_config(path)
    cls = get_plugins().targets.get(cfg.get("model_type"))
    if bits:
        from .memory import quantized_from_path

        return quantized_from_path(cls, path, cfg, bits)
    return cls.from_path(path, cfg, dtype="float32")


def _load_tokenizer(target):
    p = Path(target.path)
    if not ((p / "tokenizer.json").is_file() or (p / "tokenizer.model").is_file()):
        return None
    from mlx_lm.tokenizer_utils import load as load_tok

    return load_tok(p)


def _warm_start(target, init_from: str, drafter_config) -> GenericAssistantModel:
    """The drafter in ``init_from`` (folder or packaged name), in float32, for further training."""
    from ..drafters.mtpflow_assistant.drafter import load_model
    from ..engine import resolve_model
    from ..targets.base import read_config

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


class _Progress:
    """A tqdm bar on stderr (a plain line per update without tqdm)."""

    def __init__(self, total: int, initial: int, enabled: bool, desc: str = "train"):
        self.bar = None
        self.enabled = enabled
        self.desc = desc
        self.total, self.t0, self.start = total, time.time(), initial
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=initial, file=sys.stderr, dynamic_ncols=True, desc=desc)
            except ImportError:
                self.bar = None

    def update(self, step: int, info: str):
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix_str(info, refresh=False)
            self.bar.refresh()
        else:
            el = time.time() - self.t0
            done = step - self.start
            eta = el / done * (self.total - step) if done else float("nan")
            print(f"{self.desc} {step}/{self.total} {info} eta {eta:.0f}s", file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


# ------------------------------------------------------------------------------ the optimiser loop
class TrainingInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped a run; its last finished ``step`` is checkpointed
    in ``checkpoint``, from which the same command resumes."""

    def __init__(self, step: int, signum: int, checkpoint: Path):
        super().__init__(step, signum, checkpoint)
        self.step, self.signum, self.checkpoint = step, signum, checkpoint

    def __str__(self) -> str:
        name = signal.Signals(self.signum).name
        return (f"{name}: stopped after step {self.step}, checkpointed in {self.checkpoint}; "
                f"run the same command again to resume from step {self.step}")


def _catch_stop_signals(signalled: list):
    """Make SIGINT and SIGTERM append their number to ``signalled`` instead of
    stopping the process (a second one stops it at once); returns the function
    that puts the previous handlers back.  Only the main thread can install
    handlers: elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum, frame):
        if signalled:
            raise KeyboardInterrupt
        signalled.append(signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}

    def restore():
        for s, h in previous.items():
            signal.signal(s, h)

    return restore


def optimize(model, loss_fn, make_batch, cfg: TrainConfig, out: Path, config_id, n_steps_loss: int,
             data_id: str | None = None, ranks: Ranks | None = None, weights=None, reduce=None, on_grads=None):
    """AdamW over ``model``'s trainable parameters until ``cfg.steps``
    (``max_time_s`` / ``stop_at`` stop it early, checkpointed): resumes from
    ``out/checkpoint``, logs every step to ``out/train_log.jsonl``, shows a
    progress bar.

    ``make_batch(step, rows) -> (args, lengths)``: this rank's ``rows`` (a
    slice) of the global batch of ``step``; ``loss_fn(model, *args) ->
    (per_step_loss_sum, per_step_correct, per_step_count)`` over
    ``n_steps_loss`` unrolled steps / block positions (unnormalised, see
    :func:`drafter_loss_terms`); the loss is their :func:`weighted_loss` with
    the counts of the whole global batch and :func:`step_weights` from the
    running accuracy.  Data-parallel over ``ranks`` (default:
    :func:`mtpflow.train.parallel.world`; see that module): gradients are
    averaged, rank 0 reads and writes the checkpoint and the log, and every
    rank must hold the same data (``data_id``, a fingerprint).  ``config_id``:
    what the checkpoint must have been written for.  Returns ``(step,
    acc_ema, tokens_seen, last_log, elapsed_s, speed)``; ``speed``: this
    sitting's training tokens per second, over all ranks and per device
    (:func:`mtpflow.train.parallel.throughput`), with ``flops`` (the step's
    FLOPs against the machine's measured matmul rate,
    :mod:`mtpflow.train.flops`) and ``peak_memory``
    (:func:`mtpflow.train.memory.peak`).

    A kind may replace the step weights (``weights(acc_ema) -> [S]``) and the
    reduction (``reduce(sums, counts, weights) -> (loss, per_step)``, default
    :func:`weighted_loss`); ``on_grads(step, grads)`` sees each step's
    gradients before clipping.  ``cfg.grad_accum`` micro-batches make one
    step (:mod:`mtpflow.train.memory`).  SIGINT / SIGTERM stop the run after
    the step it is in: that step is checkpointed, then
    :class:`TrainingInterrupted` is raised."""
    from .flops import Throughput, count_matmuls, matmul_rate
    from .memory import checkpoint_layers, make_optimizer, micro_slices, peak

    ranks = ranks or world()
    rows = ranks.rows(cfg.batch_size)
    if data_id is not None:
        ranks.check_same(data_id, "the training data",
                         "every rank needs the same data: put --out on a folder every machine shares, or copy "
                         "OUT/features* (and the data files) to each machine before launching")
    opt = make_optimizer(cfg, _schedule(cfg))
    if cfg.grad_checkpoint:
        checkpoint_layers(model)
    reduce = reduce or weighted_loss
    ckpt = out / "checkpoint"
    state = load_checkpoint(ckpt, model, opt, config_id) if ranks.main else None
    if ranks.size > 1:  # every rank starts from rank 0's weights, optimiser state and step
        opt.init(model.trainable_parameters())
        state = ranks.broadcast_json(state)
        model.update(ranks.broadcast_tree(model.parameters()))
        opt.state = ranks.broadcast_tree(opt.state)
    step = 0
    acc_ema = [0.5] * n_steps_loss
    tokens_seen = 0
    elapsed_prev = 0.0
    if state is not None:
        step, acc_ema = state["step"], state["acc_ema"]
        tokens_seen, elapsed_prev = state["tokens_seen"], state.get("elapsed_s", 0.0)
    log_path = out / "train_log.jsonl"
    if ranks.main and step < cfg.steps:  # the log continues the checkpoint's history (a kill's partial line and later steps go)
        repair_log(log_path, step)

    whole = {"counts": None}  # micro-batches: the term counts of the whole global batch

    def objective(m, *args):
        *batch, w = args
        sums, correct, counts = loss_fn(m, *batch)
        counts = ranks.sum(mx.stop_gradient(counts)) if whole["counts"] is None else whole["counts"]
        loss, per = reduce(sums, counts, w)
        # summed over ranks, the per-rank losses are the global loss: scaled by the number of ranks,
        # the averaged gradients are its gradient
        return loss * ranks.size, per, correct, counts

    grad_fn = nn.value_and_grad(model, objective)
    log_f = open(log_path, "a") if ranks.main else None
    bar = _Progress(cfg.steps, step, cfg.progress and ranks.main, desc=f"train [{device()['backend']}]")
    peak_before = mx.get_peak_memory()  # (the matmul probe's buffers are not the run's)
    flops = Throughput(matmul_rate() if bar.enabled and step < cfg.steps else None)
    mx.reset_peak_memory()
    micro = micro_slices(rows, cfg.grad_accum) if cfg.grad_accum > 1 else [rows]
    t0 = time.time()
    tokens_start = tokens_seen
    last = {}
    saved = step

    def checkpoint():
        nonlocal saved
        log_f.flush()  # the log holds every step of the checkpoint before it is written
        os.fsync(log_f.fileno())
        save_checkpoint(ckpt, model, opt, {
            "step": step, "acc_ema": acc_ema, "tokens_seen": tokens_seen,
            "elapsed_s": elapsed_prev + time.time() - t0, "drafter_config": config_id,
            "numpy_rng": "data order is a pure function of (seed, step)", "seed": cfg.seed,
            "ranks": ranks.size,
        })
        saved = step

    signalled: list = []  # SIGINT / SIGTERM: the run stops after the step it is in, checkpointed
    restore = _catch_stop_signals(signalled)
    stopped = False
    try:
        while step < cfg.steps:
            if ranks.any(bool(signalled)):
                stopped = True
                break
            if cfg.max_time_s is not None and ranks.any(time.time() - t0 >= cfg.max_time_s):
                break
            if cfg.stop_at is not None and step >= cfg.stop_at:
                break
            t_step = time.perf_counter()
            with count_matmuls() as f_target:
                batches = [make_batch(step, r) for r in micro]
            n_tok = sum(int(b[1].sum()) for b in batches)
            w = mx.array(weights(acc_ema) if weights is not None else
                         step_weights(cfg.step_weights, n_steps_loss, cfg.decay, acc_ema))
            if len(batches) > 1:  # the counts come from the masks alone: nothing else of the graph is evaluated
                whole["counts"] = ranks.sum(sum(mx.stop_gradient(loss_fn(model, *a)[2]) for a, _ in batches))
                mx.eval(whole["counts"])
            with count_matmuls() as f_drafter:
                for i, (args, _) in enumerate(batches):
                    (l_i, p_i, c_i, cnt), g_i = grad_fn(model, *args, w)
                    if i == 0:
                        loss, per, cor, grads = l_i, p_i, c_i, g_i
                    else:
                        loss, per, cor = loss + l_i, per + p_i, cor + c_i
                        grads = tree_map(lambda a, b: a + b, grads, g_i)
                    if len(batches) > 1:
                        mx.eval(grads, loss, per, cor)  # one micro-batch's activations at a time
            if on_grads is not None:
                on_grads(step, grads)
            if ranks.size > 1:
                grads = nn.average_gradients(grads, group=ranks.group)
                # this rank's part of the logged figures, summed over the ranks in one collective
                part = ranks.sum(mx.concatenate([loss[None] / ranks.size, per, cor.astype(mx.float32),
                                                 mx.array([n_tok], mx.float32)]))
                loss, per, cor = part[0], part[1: 1 + n_steps_loss], part[1 + n_steps_loss: 1 + 2 * n_steps_loss]
                n_tok = part[-1]
            grads, gnorm = optim.clip_grad_norm(grads, cfg.grad_clip)
            opt.update(model, grads)
            mx.eval(model.parameters(), opt.state, loss, per, cor, cnt, gnorm, n_tok)
            flops.add(f_drafter.flops, f_target.flops, time.perf_counter() - t_step)
            step += 1
            cnt_np, cor_np = np.array(cnt), np.array(cor)
            acc = [float(c / n) if n > 0 else 0.0 for c, n in zip(cor_np, cnt_np)]
            acc_ema = [cfg.ema * a + (1 - cfg.ema) * b if n > 0 else a for a, b, n in zip(acc_ema, acc, cnt_np)]
            tokens_seen += n_tok if isinstance(n_tok, int) else int(n_tok.item())  # (global: float32 is exact here)
            last = {"step": step, "loss": float(loss.item()), "step_loss": [round(float(x), 5) for x in np.array(per)],
                    "acc": [round(a, 4) for a in acc], "grad_norm": float(gnorm.item()),
                    "lr": float(opt.learning_rate.item()), "tokens_seen": tokens_seen,
                    "elapsed_s": round(elapsed_prev + time.time() - t0, 2)}
            if not ranks.main:
                continue
            log_f.write(json.dumps(last) + "\n")
            if step % cfg.log_every == 0 or step == cfg.steps:
                log_f.flush()
            tps = (tokens_seen - tokens_start) / max(time.time() - t0, 1e-9)
            mem = peak(max(peak_before, mx.get_peak_memory()))
            bar.update(step, f"loss {last['loss']:.4f} acc " + "/".join(f"{a:.2f}" for a in acc_ema)
                       + " " + rate_text(tps, ranks) + f" {flops.text()} peak {mem['mlx_peak_gb']:.2f}/"
                       + f"{mem['rss_peak_gb']:.2f} GB")
            if step % cfg.checkpoint_every == 0 or step in (cfg.steps, cfg.stop_at):
                checkpoint()
        if ranks.main and saved != step:  # stopped by a signal or --max-time after the last checkpoint
            checkpoint()
    finally:
        restore()
        bar.close()
        if log_f is not None:
            log_f.close()
    if stopped:
        raise TrainingInterrupted(step, signalled[0] if signalled else signal.SIGINT, ckpt)
    speed = throughput(tokens_seen - tokens_start, time.time() - t0, ranks)
    speed["peak_memory"] = peak(max(peak_before, mx.get_peak_memory()))
    if flops.steps and flops.rate is None:
        flops.rate = matmul_rate()  # measured after the run when no progress bar needed it before
    speed["flops"] = flops.summary()
    return step, acc_ema, tokens_seen, last, elapsed_prev + time.time() - t0, speed


# ------------------------------------------------------------------------------ train
def training_data(target, data_spec, out: Path, cfg: TrainConfig, examples=None, ranks: Ranks | None = None,
                  taps=(), kv: bool = True):
    """``(examples, feats, distill_summary, cache_summary)`` of a data spec:
    ``distill:`` / ``cache:`` parts are collected (resumably) into
    ``out/features`` / ``out/features-cache`` and loaded (``feats``, and their
    tokens as ``examples``); other specs load as token examples.  With
    several ``ranks`` each collects its share of the shards, then all load
    the whole folder.  ``taps``: target layers whose states ``cache:``
    features keep too (the EAGLE-3 / DFlash kinds), read in this order;
    ``kv``: the kind reads the store-layer K/V (the assistant kind)."""
    feats = None
    distill = cache_summary = None
    feature_parts = _feature_parts(data_spec) if examples is None and isinstance(data_spec, str) else None
    if feature_parts:
        from . import features as feat_mod

        feats = []
        tok = _load_tokenizer(target)
        for kind, spec in feature_parts:
            if kind == "distill":
                prompts = feat_mod.distill_prompts(spec, tok,
                                                   max_prompt_len=max(4, cfg.max_len - cfg.distill_tokens))
                distill = feat_mod.collect(target, prompts, out / "features", max_new=cfg.distill_tokens,
                                           batch_size=cfg.distill_batch, max_time_s=cfg.distill_time_s,
                                           progress=cfg.progress, ranks=ranks)
                feats += feat_mod.load_features(out / "features", kv=kv)
            else:
                texts = data_mod.load_examples(spec, tok, max_len=cfg.max_len, target=target, seed=cfg.seed)
                folder = Path(cfg.cache_dir) if cfg.cache_dir else out / "features-cache"
                cache_summary = feat_mod.collect_text(target, texts, folder, batch_size=cfg.cache_batch,
                                                      max_time_s=cfg.cache_time_s, progress=cfg.progress, ranks=ranks,
                                                      taps=tuple(taps) + tuple(cfg.cache_taps), kv=kv)
                feats += feat_mod.load_features(folder, taps=tuple(taps), kv=kv)
        if not feats:
            raise data_mod.DataError(f"data spec {data_spec!r}: no features collected yet (a time limit of 0?); "
                                     "rerun with a longer --distill-time / --cache-time")
        examples = [data_mod.Example(f.tokens, f.loss) for f in feats]
    elif examples is None:
        tok = _load_tokenizer(target)
        examples = data_mod.load_examples(data_spec, tok, max_len=cfg.max_len, target=target, seed=cfg.seed)
    return examples, feats, distill, cache_summary


def _feature_parts(spec: str) -> list[tuple[str, str]] | None:
    """``[(kind, spec)]`` of a data spec whose parts are cached-feature data
    (``distill:SPEC``, ``cache:SPEC``); ``None`` for on-the-fly data."""
    parts = [q.strip() for q in spec.split(",") if q.strip()]
    kinds = [q.partition(":")[0] for q in parts]
    feat = [k in ("distill", "cache") for k in kinds]
    if not any(feat):
        return None
    if not all(feat):
        raise data_mod.DataError(f"data spec {spec!r} mixes cached-feature parts (distill:, cache:) with other data; "
                                 "write the other parts as cache:SPEC so their features are cached too")
    if len(set(kinds)) != len(kinds):
        raise data_mod.DataError(f"data spec {spec!r}: at most one distill: and one cache: part (each has one "
                                 "features folder); join their data in one file instead")
    return [(k, q.partition(":")[2]) for k, q in zip(kinds, parts)]


def train(target, drafter_config, data_spec, out_dir, config: TrainConfig | None = None, examples=None, **overrides) -> dict:
    """Train a generic assistant drafter for ``target`` (path, repo id or a
    loaded adapter) and write a loadable drafter folder to ``out_dir``.

    Resumes from ``out_dir/checkpoint`` when present.  ``overrides`` are
    :class:`TrainConfig` fields.  Returns a summary dict (also written to
    ``out_dir/train_summary.json``)."""
    cfg = config or TrainConfig()
    if overrides:
        cfg = TrainConfig(**{**asdict(cfg), **overrides})
    from ..config import drafter_options

    drafter_config = drafter_options(cfg.kind, drafter_config)  # checked before anything loads
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ranks = world()
    ranks.rows(cfg.batch_size)  # a batch the ranks cannot share is refused before any data is read
    mx.reset_peak_memory()  # the summary's peak is this run's (target loading included)
    target = _load_target(target, cfg.target_bits)
    if cfg.kind != "assistant":
        from .kinds import train_kind

        return train_kind(cfg.kind, target, drafter_config, data_spec, out, cfg, examples, ranks=ranks)
    mx.random.seed(cfg.seed)
    if cfg.init_from:
        model = _warm_start(target, cfg.init_from, drafter_config)
        dcfg = model.config
    else:
        dcfg = resolve_drafter_config(target, drafter_config)
        model = GenericAssistantModel(dcfg, target)
        if cfg.init == "identity":
            identity_init(model)
    mx.eval(model.parameters())
    examples, feats, distill, cache_summary = training_data(target, data_spec, out, cfg, examples, ranks)
    if feats is not None:
        from .features import feature_batch
    if model.has_draft_vocab and not cfg.init_from:  # a warm start keeps its draft vocabulary
        K = model.draft_vocab.shape[0]
        extra = None
        if cfg.vocab_data:
            extra = data_mod.load_examples(cfg.vocab_data, _load_tokenizer(target), max_len=4096, target=target, seed=cfg.seed)
        model.set_draft_vocab(mx.array(choose_draft_vocab(examples, target.vocab_size, K, sorted(target.eos_ids), extra)))
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

    step, acc_ema, tokens_seen, last, elapsed, speed = optimize(model, loss_fn, make_batch, cfg, out, dcfg, cfg.unroll,
                                                                data_id=data_mod.fingerprint(examples), ranks=ranks)
    summary = {
        "steps": step, "tokens_seen": tokens_seen, "elapsed_s": round(elapsed, 1), "train_speed": speed,
        "examples": len(examples), "loss_tokens_per_epoch": int(sum(n_tokens_ex)),
        "final": last, "acc_ema": acc_ema, "train_config": asdict(cfg), "data": data_spec,
    }
    if distill is not None:
        summary["distill"] = distill
    if cache_summary is not None:
        summary["cache"] = cache_summary
    if ranks.main:
        save_drafter(model, out, dtype=cfg.save_dtype)
        (out / "train_summary.json").write_text(json.dumps(summary, indent=2))
    return summary


# ------------------------------------------------------------------------------ CLI
def add_train_arguments(p) -> None:
    """``mtpflow train --target T --drafter-config C --data SPEC --out DIR``."""
    p.add_argument("--target", required=True, help="target model folder, Hugging Face repo id or packaged name (required)")
    p.add_argument("--drafter-config", help="drafter config: a JSON file (full config, or make_config options such as "
                   '{"num_hidden_layers": 2, "draft_vocab_size": 8192}) or inline JSON; default: 2 layers at the target width')
    p.add_argument("--data", required=True, help="data spec: sharegpt[:N], FILE.jsonl[:N], FILE.json, FILE.txt, DIR, selfgen:N[:L]; comma-separated; "
                   "or distill:PROMPTS (distill:sharegpt:N): the target answers the prompts greedily and its features are cached in OUT/features; "
                   "or cache:SPEC (cache:sharegpt:N): the data's own answers, the target's features cached once in OUT/features-cache; "
                   "distill: and cache: combine (distill:sharegpt:4000,cache:sharegpt:3000) (required)")
    p.add_argument("--out", required=True, help="output drafter folder (resumes from OUT/checkpoint) (required)")
    d = TrainConfig()
    helps = {
        "steps": "optimizer steps", "batch_size": "sequences per step (the global batch: under mlx.launch each of R ranks takes batch/R)", "max_len": "tokens per sequence (longer ones are cut)",
        "unroll": "drafting steps unrolled per position (as at inference)", "checkpoint_every": "steps between checkpoints",
        "seed": "random seed", "lr": "peak learning rate (AdamW)", "weight_decay": "AdamW weight decay",
        "grad_clip": "gradient norm clip", "decay": "geometric weight of unrolled step i: decay**i",
        "min_lr_ratio": "cosine schedule floor, as a fraction of --lr",
    }
    for name in ("steps", "batch_size", "max_len", "unroll", "checkpoint_every", "seed"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name), help=helps[name])
    for name in ("lr", "weight_decay", "grad_clip", "decay", "min_lr_ratio"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name), help=helps[name])
    p.add_argument("--warmup", type=int, default=d.warmup, help="linear warm-up steps")
    p.add_argument("--init", choices=["identity", "random"], default=d.init,
                   help="drafter initialisation (identity: h' starts as the target's hidden state)")
    p.add_argument("--init-from", default=None,
                   help="warm start from a trained drafter folder or packaged drafter name (its config, weights and draft "
                        "vocabulary; fresh optimiser and schedule), e.g. to continue training on more data (default: none, a fresh drafter)")
    p.add_argument("--vocab-data", default=None,
                   help="data spec whose tokens also rank the draft vocabulary (e.g. sharegpt:6000); needs draft_vocab_size (default: none, the training data alone)")
    p.add_argument("--step-weights", choices=["geometric", "position"], default=d.step_weights,
                   help="loss weight per unrolled step: geometric (--decay) or position (dE[tau]/da_i)")
    p.add_argument("--targets", choices=["soft", "hard"], default=d.targets,
                   help="labels: soft = the target's distribution (KL), hard = its argmax")
    p.add_argument("--max-time", type=float, default=None, help="stop after this many seconds (checkpointed; rerun to resume) (default: no limit)")
    p.add_argument("--distill-tokens", type=int, default=d.distill_tokens,
                   help="distill: data: tokens the target generates per prompt (greedy)")
    p.add_argument("--distill-batch", type=int, default=d.distill_batch, help="distill: data: prompts per generation batch")
    p.add_argument("--distill-time", type=float, default=None,
                   help="distill: data: stop collecting after this many seconds and train on what was collected (rerun to add more) (default: no limit)")
    p.add_argument("--cache-batch", type=int, default=d.cache_batch, help="cache: data: rows per target forward")
    p.add_argument("--cache-time", type=float, default=None,
                   help="cache: data: stop collecting features after this many seconds and train on what was collected (rerun to add more) (default: no limit)")
    p.add_argument("--save-dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="dtype of the saved drafter weights (default: as trained, float32)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--kind", choices=["assistant", "eagle3", "dflash", "mtp"], default="assistant",
                   help="drafter kind: assistant (mtpflow's KV-sharing MTP drafter), eagle3 (written as a Speculators "
                        "checkpoint), dflash (written in z-lab's format), mtp (a DeepSeek-style MTP module in the native layout); --drafter-config takes the kind's options, "
                        'e.g. {"draft_vocab_size": 8192} (eagle3) or {"block_size": 16, "num_hidden_layers": 2} (dflash)')
    p.add_argument("--anchors", type=int, default=8, help="dflash: blocks per sequence per step")
    p.add_argument("--schedule", choices=["cosine", "linear"], default=d.schedule,
                   help="learning rate after the warm-up: cosine to --min-lr-ratio, or linear to 0 (Speculators' default)")
    p.add_argument("--dpace-alpha", type=float, default=d.dpace_alpha,
                   help="dflash with --step-weights position (D-PACE): confidence smoothing constant in (0, 1]")
    p.add_argument("--target-bits", type=int, choices=[4, 8], default=None,
                   help="quantize the frozen target to 4 or 8 bits as it loads (mlx affine quantization): the drafter "
                        "trains on the quantized model's features, in a fraction of the memory (default: as loaded)")
    p.add_argument("--optimizer", choices=["adamw", "adafactor"], default=d.optimizer,
                   help="adamw, or adafactor (factored second moments: a much smaller optimizer state)")
    p.add_argument("--grad-accum", type=int, default=d.grad_accum,
                   help="micro-batches per optimizer step (same gradient, batch/N rows of activations at a time)")
    p.add_argument("--grad-checkpoint", action="store_true",
                   help="recompute the drafter layers' activations in the backward pass instead of keeping them")
    p.add_argument("--cache-dir", default=None,
                   help="cache: data: the features folder (default: OUT/features-cache); kinds trained on the same data "
                        "share one, each reading the target layers it needs")
    p.add_argument("--cache-taps", default="",
                   help="cache: data: more target layer ids to collect (comma-separated) so other kinds can train from "
                        "the same --cache-dir (default: only the kind's own)")
    p.add_argument("--tap-cache-mb", type=float, default=0.0,
                   help="eagle3 / dflash: keep the target's hidden states and layer taps of up to this many MiB of "
                        "examples in memory, so later epochs skip the target forward (default: 0, off)")


def run_train(args) -> int:
    dc = args.drafter_config  # inline JSON or a file: checked by train() before anything loads
    cfg = TrainConfig(
        steps=args.steps, batch_size=args.batch_size, max_len=args.max_len, lr=args.lr, warmup=args.warmup,
        min_lr_ratio=args.min_lr_ratio, weight_decay=args.weight_decay, grad_clip=args.grad_clip, unroll=args.unroll,
        step_weights=args.step_weights, decay=args.decay, targets=args.targets, seed=args.seed,
        checkpoint_every=args.checkpoint_every, max_time_s=args.max_time, save_dtype=args.save_dtype,
        progress=not args.no_progress, distill_tokens=args.distill_tokens, distill_batch=args.distill_batch,
        distill_time_s=args.distill_time, cache_batch=args.cache_batch, cache_time_s=args.cache_time, init=args.init, vocab_data=args.vocab_data, init_from=args.init_from,
        kind=args.kind, anchors=args.anchors, tap_cache_mb=args.tap_cache_mb, cache_dir=args.cache_dir,
        schedule=args.schedule, dpace_alpha=args.dpace_alpha, target_bits=args.target_bits, optimizer=args.optimizer,
        grad_accum=args.grad_accum, grad_checkpoint=args.grad_checkpoint,
        cache_taps=tuple(int(t) for t in args.cache_taps.split(",") if t.strip()),
    )
    try:
        summary = train(args.target, dc, args.data, args.out, config=cfg)
    except TrainingInterrupted as stop:
        if world().main:
            print(f"mtpflow: interrupted by {stop}", file=sys.stderr)
        return 128 + stop.signum
    if world().main:  # (under mlx.launch every rank runs this; one line is enough)
        print(json.dumps({k: summary[k] for k in ("steps", "tokens_seen", "elapsed_s", "examples")} | {"out": str(args.out)}))
    return 0
