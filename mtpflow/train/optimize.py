"""The optimiser loop every drafter kind trains with (:func:`optimize`): AdamW (or Adafactor)
with warm-up and a cosine or linear schedule, gradient clipping and accumulation, resumable
checkpoints, ``train_log.jsonl``, a progress bar, data-parallel ranks, and SIGINT / SIGTERM
stopping after the step in progress (:class:`TrainingInterrupted`).  What a kind brings is its
``loss_fn`` and ``make_batch``; nothing here knows which kind it trains."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_map

from .checkpoint import load_checkpoint, repair_log, save_checkpoint
from .config import TrainConfig
from .objective import step_weights, weighted_loss
from .parallel import Ranks, device, rate_text, throughput, world
from .progress import Progress


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
    :func:`mtpflow.drafters.mtpflow_assistant.train.drafter_loss_terms`); the
    loss is their :func:`weighted_loss` with the counts of the whole global
    batch and :func:`step_weights` from the running accuracy.  Data-parallel
    over ``ranks`` (default: :func:`mtpflow.train.parallel.world`; see that
    module): gradients are averaged, rank 0 reads and writes the checkpoint
    and the log, and every rank must hold the same data (``data_id``, a
    fingerprint).  ``config_id``: what the checkpoint must have been written
    for.  Returns ``(step, acc_ema, tokens_seen, last_log, elapsed_s,
    speed)``; ``speed``: this sitting's training tokens per second, over all
    ranks and per device (:func:`mtpflow.train.parallel.throughput`), with
    ``flops`` (the step's FLOPs against the machine's measured matmul rate,
    :mod:`mtpflow.train.flops`) and ``peak_memory``
    (:func:`mtpflow.train.memory.peak`).

    A kind may replace the step weights (``weights(acc_ema) -> [S]``) and the
    reduction (``reduce(sums, counts, weights) -> (loss, per_step)``, default
    :func:`weighted_loss`); ``on_grads(step, grads)`` sees each step's
    gradients before clipping.  ``cfg.grad_accum`` micro-batches make one
    step (:mod:`mtpflow.train.memory`).  SIGINT / SIGTERM stop the run after
    the step it is in: that step is checkpointed, then
    :class:`TrainingInterrupted` is raised."""
    from .memory import checkpoint_layers, make_optimizer

    ranks = ranks or world()
    rows = ranks.rows(cfg.batch_size)
    if data_id is not None:
        ranks.check_same(data_id, "the training data",
                         "every rank needs the same data: put --out on a folder every machine shares, or copy "
                         "OUT/features* (and the data files) to each machine before launching")
    opt = make_optimizer(cfg, _schedule(cfg))
    if cfg.grad_checkpoint:
        checkpoint_layers(model)
    loop = _Loop(model, opt, loss_fn, cfg, out, config_id, n_steps_loss, ranks, weights, reduce or weighted_loss)
    loop.resume()
    loop.start(rows)
    signalled: list = []  # SIGINT / SIGTERM: the run stops after the step it is in, checkpointed
    restore = _catch_stop_signals(signalled)
    stopped = False
    try:
        while loop.step < cfg.steps:
            if ranks.any(bool(signalled)):
                stopped = True
                break
            if cfg.max_time_s is not None and ranks.any(time.time() - loop.t0 >= cfg.max_time_s):
                break
            if cfg.stop_at is not None and loop.step >= cfg.stop_at:
                break
            loop.run_step(make_batch, on_grads)
        if ranks.main and loop.saved != loop.step:  # stopped by a signal or --max-time after the last checkpoint
            loop.checkpoint()
    finally:
        restore()
        loop.close()
    if stopped:
        raise TrainingInterrupted(loop.step, signalled[0] if signalled else signal.SIGINT, loop.ckpt)
    return loop.result()


def _accumulate(total, out):
    """``(total, counts)``: ``total`` (``[loss, per_step, correct, grads]`` or ``None``) plus one
    micro-batch's or part's ``grad_fn`` output ``((loss, per_step, correct, counts), grads)``."""
    (loss, per, cor, cnt), grads = out
    if total is None:
        return [loss, per, cor, grads], cnt
    return [total[0] + loss, total[1] + per, total[2] + cor, tree_map(lambda a, b: a + b, total[3], grads)], cnt


class _Loop:
    """One sitting of :func:`optimize`: the resumed counters, the objective and
    its gradient, the log, the progress bar and the checkpoints."""

    def __init__(self, model, opt, loss_fn, cfg: TrainConfig, out: Path, config_id, n_steps_loss: int, ranks: Ranks,
                 weights, reduce):
        self.model, self.opt, self.loss_fn, self.cfg, self.ranks = model, opt, loss_fn, cfg, ranks
        self.config_id, self.n, self.weights, self.reduce = config_id, n_steps_loss, weights, reduce
        self.ckpt, self.log_path = out / "checkpoint", out / "train_log.jsonl"
        self.step, self.acc_ema, self.tokens_seen, self.elapsed_prev = 0, [0.5] * n_steps_loss, 0, 0.0
        self.whole_counts = None  # micro-batches: the term counts of the whole global batch
        self.last: dict = {}

    def resume(self) -> None:
        """The checkpoint's weights, optimiser state and counters (rank 0's, on every rank)."""
        model, opt, ranks = self.model, self.opt, self.ranks
        state = load_checkpoint(self.ckpt, model, opt, self.config_id) if ranks.main else None
        if ranks.size > 1:  # every rank starts from rank 0's weights, optimiser state and step
            opt.init(model.trainable_parameters())
            state = ranks.broadcast_json(state)
            model.update(ranks.broadcast_tree(model.parameters()))
            opt.state = ranks.broadcast_tree(opt.state)
        if state is not None:
            self.step, self.acc_ema = state["step"], state["acc_ema"]
            self.tokens_seen, self.elapsed_prev = state["tokens_seen"], state.get("elapsed_s", 0.0)
        if ranks.main and self.step < self.cfg.steps:  # the log continues the checkpoint's history (a kill's
            repair_log(self.log_path, self.step)  # partial line and later steps go)

    def objective(self, m, *args):
        from .flops import count_matmuls

        count_matmuls.trained(m.trainable_parameters())  # (the arrays the gradient is taken of, here)
        *batch, w = args
        sums, correct, counts = self.loss_fn(m, *batch)
        counts = self.ranks.sum(mx.stop_gradient(counts)) if self.whole_counts is None else self.whole_counts
        loss, per = self.reduce(sums, counts, w)
        # summed over ranks, the per-rank losses are the global loss: scaled by the number of ranks,
        # the averaged gradients are its gradient
        return loss * self.ranks.size, per, correct, counts

    def start(self, rows: slice) -> None:
        """Open the log, the bar and the FLOP count; the clock starts."""
        from .flops import Throughput, matmul_rate
        from .lanes import Lanes, lane_count
        from .memory import micro_slices

        cfg, ranks = self.cfg, self.ranks
        self.grad_fn = nn.value_and_grad(self.model, self.objective)
        self.apply = self._update_fn()
        self.log_f = open(self.log_path, "a") if ranks.main else None
        self.bar = Progress(cfg.steps, self.step, cfg.progress and ranks.main, desc=f"train [{device()['backend']}]")
        self.peak_before = mx.get_peak_memory()  # (the matmul probe's buffers are not the run's)
        self.flops = Throughput(matmul_rate() if self.bar.enabled and self.step < cfg.steps else None)
        mx.reset_peak_memory()
        self.micro = micro_slices(rows, cfg.grad_accum) if cfg.grad_accum > 1 else [rows]
        # a memory budget (checkpointing, the chunked update) defaults to one lane: lanes hold their
        # parts' activations side by side
        lanes = cfg.lanes or (1 if cfg.grad_checkpoint or cfg.chunked_update else 0)
        n_lanes = lane_count(lanes, min(m.stop - m.start for m in self.micro), ranks.size)
        self.lanes = Lanes(n_lanes) if n_lanes > 1 else None
        if self.lanes is not None:  # every micro-batch cut into lanes, evaluated side by side
            self.micro = micro_slices(rows, cfg.grad_accum * n_lanes)
        self.t0 = time.time()
        self.tokens_start = self.tokens_seen
        self.saved = self.step
        self.first_step = self.step

    def run_step(self, make_batch, on_grads=None) -> None:
        """One optimizer step: its batches, gradients, update, log line and (when due) checkpoint."""
        from .flops import count_matmuls

        t_step = time.perf_counter()
        w = mx.array(self.weights(self.acc_ema) if self.weights is not None else
                     step_weights(self.cfg.step_weights, self.n, self.cfg.decay, self.acc_ema))
        f_target, f_drafter = count_matmuls(), count_matmuls()
        if self.lanes is not None:
            loss, per, cor, cnt, grads, n_tok = self._lane_step(make_batch, w, f_target, f_drafter)
        else:
            with f_target:
                batches = [make_batch(self.step, r) for r in self.micro]
            n_tok = sum(int(b[1].sum()) for b in batches)
            if len(batches) > 1:  # the counts come from the masks alone: nothing else of the graph is evaluated
                self._count_whole([mx.stop_gradient(self.loss_fn(self.model, *a)[2]) for a, _ in batches])
            with f_drafter:
                loss, per, cor, cnt, grads = self._gradients(batches, w)
        if on_grads is not None:
            on_grads(self.step, grads)
        if self.ranks.size > 1:
            grads, loss, per, cor, n_tok = self._all_reduce(grads, loss, per, cor, n_tok)
        gnorm = self.apply(grads)
        mx.eval(self.model.parameters(), self.opt.state, loss, per, cor, cnt, gnorm, n_tok)
        self.flops.add(f_drafter.flops, f_target.flops, time.perf_counter() - t_step, f_drafter.frozen, f_drafter.recomputed)
        self.step += 1
        self._record(loss, per, cor, cnt, gnorm, n_tok)
        if self.ranks.main:
            self._report()

    def _update_fn(self):
        """The clipping and the optimiser's update, compiled (``mx.compile``, the weights and the
        optimiser state as its implicit inputs and outputs): a few fused kernels a parameter
        instead of a dozen passes over it, which on a CPU run on one core while the other idles
        (DFlash at 8 M trained parameters: ~90 -> ~50 ms a step).  The same values: the graph is
        the same, fused.  Built once the state is in place (resumed or initialised), as the
        compiled function holds the state's trees."""
        model, opt, clip = self.model, self.opt, self.cfg.grad_clip
        opt.init(model.trainable_parameters())  # the state's missing entries (a resumed state is kept)
        if self.cfg.chunked_update:
            return self._chunked_update

        def apply(grads):
            grads, gnorm = optim.clip_grad_norm(grads, clip)
            opt.update(model, grads)
            return gnorm

        state = [model.state, opt.state]
        return mx.compile(apply, inputs=state, outputs=state)

    def _chunked_update(self, grads):
        """``--chunked-update``: the clipping, then the optimiser's update one parameter array at a
        time, each evaluated before the next, so the old and the new weights and optimiser state
        are held together for one array only (a compiled update over every array holds the whole
        drafter's twice at its peak).  The same values as the update of every array at once: the
        schedule and the step counter advance once (``apply_gradients`` on one array at a time,
        from the same step)."""
        from mlx.utils import tree_flatten, tree_unflatten

        model, opt = self.model, self.opt
        grads, gnorm = optim.clip_grad_norm(grads, self.cfg.grad_clip)
        step = opt.state["step"]
        for name, g in tree_flatten(grads):
            opt.state["step"] = step
            model.update(opt.apply_gradients(tree_unflatten([(name, g)]), model))
            mx.eval(model.parameters(), opt.state)
        return gnorm

    def _count_whole(self, counts) -> None:
        """The loss-term counts of the whole global batch (every micro-batch or part normalises by them)."""
        self.whole_counts = self.ranks.sum(sum(counts))
        mx.eval(self.whole_counts)

    def _gradients(self, batches, w):
        """Loss figures and gradients summed over the micro-batches."""
        total = None
        for args, _ in batches:
            total, cnt = _accumulate(total, self.grad_fn(self.model, *args, w))
            if len(batches) > 1:
                mx.eval(total)  # one micro-batch's activations at a time
        loss, per, cor, grads = total
        return loss, per, cor, cnt, grads

    def _lane_step(self, make_batch, w, f_target, f_drafter):
        """:meth:`run_step`'s batches and gradients with lanes (:mod:`mtpflow.train.lanes`): each
        micro-batch's parts built here, each on its lane's stream, and evaluated side by side; the
        first step of a sitting runs them inline (one after another, the same sums)."""
        from ..backend.blas import blas_threads

        lanes, model, n = self.lanes, self.model, self.lanes.n
        lanes.inline = self.step == self.first_step
        groups = [self.micro[i:i + n] for i in range(0, len(self.micro), n)]
        params = model.trainable_parameters()
        batches, counts = [], []
        with blas_threads(1):
            for group in groups:  # the batches, and the loss-term counts of the whole batch
                for j, rows in enumerate(group):
                    with lanes.stream(j):
                        with f_target:
                            args, lens = make_batch(self.step, rows)
                        c = mx.stop_gradient(self.loss_fn(model, *args)[2])
                    lanes.submit(j, (args, c))
                    batches.append((args, lens))
                    counts.append(c)
                lanes.wait()
            self._count_whole(counts)
            total = None
            for k, group in enumerate(groups):
                outs = []
                for j in range(len(group)):
                    with lanes.stream(j):
                        with f_drafter:
                            outs.append(self.grad_fn(model, *batches[k * n + j][0], w))
                        model.update(params)  # (value_and_grad leaves the lane's tracers in the model)
                    lanes.submit(j, outs[-1])
                lanes.wait()
                for out in outs:
                    total, cnt = _accumulate(total, out)
                if len(groups) > 1:
                    mx.eval(total)
        loss, per, cor, grads = total
        return loss, per, cor, cnt, grads, sum(int(lens.sum()) for _, lens in batches)

    def _all_reduce(self, grads, loss, per, cor, n_tok):
        """Gradients averaged over the ranks, the logged figures summed."""
        ranks, n = self.ranks, self.n
        grads = nn.average_gradients(grads, group=ranks.group)
        # this rank's part of the logged figures, summed over the ranks in one collective
        part = ranks.sum(mx.concatenate([loss[None] / ranks.size, per, cor.astype(mx.float32),
                                         mx.array([n_tok], mx.float32)]))
        return grads, part[0], part[1: 1 + n], part[1 + n: 1 + 2 * n], part[-1]

    def _record(self, loss, per, cor, cnt, gnorm, n_tok) -> None:
        """The running accuracy, the token count and the step's log record."""
        cfg = self.cfg
        cnt_np, cor_np = np.array(cnt), np.array(cor)
        acc = [float(c / n) if n > 0 else 0.0 for c, n in zip(cor_np, cnt_np)]
        self.acc_ema = [cfg.ema * a + (1 - cfg.ema) * b if n > 0 else a for a, b, n in zip(self.acc_ema, acc, cnt_np)]
        self.tokens_seen += n_tok if isinstance(n_tok, int) else int(n_tok.item())  # (global: float32 is exact here)
        self.last = {"step": self.step, "loss": float(loss.item()),
                     "step_loss": [round(float(x), 5) for x in np.array(per)],
                     "acc": [round(a, 4) for a in acc], "grad_norm": float(gnorm.item()),
                     "lr": float(self.opt.learning_rate.item()), "tokens_seen": self.tokens_seen,
                     "elapsed_s": round(self.elapsed_prev + time.time() - self.t0, 2)}

    def _report(self) -> None:
        """Rank 0: the log line, the bar, and the checkpoint when one is due."""
        from .memory import peak

        cfg, step, last = self.cfg, self.step, self.last
        self.log_f.write(json.dumps(last) + "\n")
        if step % cfg.log_every == 0 or step == cfg.steps:
            self.log_f.flush()
        tps = (self.tokens_seen - self.tokens_start) / max(time.time() - self.t0, 1e-9)
        mem = peak(max(self.peak_before, mx.get_peak_memory()))
        self.bar.update(step, f"loss {last['loss']:.4f} acc " + "/".join(f"{a:.2f}" for a in self.acc_ema)
                        + " " + rate_text(tps, self.ranks) + f" {self.flops.text()} peak {mem['mlx_peak_gb']:.2f}/"
                        + f"{mem['rss_peak_gb']:.2f} GB")
        if step % cfg.checkpoint_every == 0 or step in (cfg.steps, cfg.stop_at):
            self.checkpoint()

    def checkpoint(self) -> None:
        self.log_f.flush()  # the log holds every step of the checkpoint before it is written
        os.fsync(self.log_f.fileno())
        save_checkpoint(self.ckpt, self.model, self.opt, {
            "step": self.step, "acc_ema": self.acc_ema, "tokens_seen": self.tokens_seen,
            "elapsed_s": self.elapsed_prev + time.time() - self.t0, "drafter_config": self.config_id,
            "numpy_rng": "data order is a pure function of (seed, step)", "seed": self.cfg.seed,
            "ranks": self.ranks.size,
        })
        self.saved = self.step

    def close(self) -> None:
        self.grad_fn = None  # (it holds self.objective: without this the run's arrays wait for the GC)
        if getattr(self, "lanes", None) is not None:
            self.lanes.close()
        self.bar.close()
        if self.log_f is not None:
            self.log_f.close()

    def result(self):
        """What :func:`optimize` returns (see there)."""
        from ..backend.heap import status as heap_status
        from .flops import matmul_rate
        from .memory import peak

        elapsed = time.time() - self.t0
        speed = throughput(self.tokens_seen - self.tokens_start, elapsed, self.ranks)
        speed["peak_memory"] = peak(max(self.peak_before, mx.get_peak_memory()))
        if self.flops.steps and self.flops.rate is None:
            self.flops.rate = matmul_rate()  # measured after the run when no progress bar needed it before
        speed["flops"] = self.flops.summary()
        speed["lanes"] = self.lanes.n if self.lanes is not None else 1
        speed["heap"] = heap_status()  # freed memory kept for reuse (mtpflow.backend.heap) or glibc's own
        return self.step, self.acc_ema, self.tokens_seen, self.last, self.elapsed_prev + time.time() - self.t0, speed
