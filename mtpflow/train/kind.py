"""What a drafter kind's trainer is (``mtpflow train --kind K``), and the run shared by the
kinds that read target layer taps.

A drafter kind becomes trainable by declaring the :class:`mtpflow.api.TrainableDrafter`
capability on its registered class: ``train_kind`` (the ``--kind`` name) and ``trainer`` (a
:class:`KindTrainer` subclass, or its ``"module:Class"`` path, imported when training starts).
:func:`mtpflow.train.run.train` finds it among the session's registered drafter kinds, asks it to
:meth:`~KindTrainer.check` the settings before anything loads, loads the frozen target and calls
:meth:`~KindTrainer.train`.  A trainer builds its batches and loss and hands them to
:func:`mtpflow.train.optimize.optimize`; the built-in ones live next to their drafters
(``mtpflow/drafters/<kind>/train.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from . import data as data_mod
from .optimize import optimize
from .parallel import world
from .sources import training_data


class KindTrainer:
    """The base of a drafter kind's trainer (class-level members are what the entry point uses)."""

    #: the ``mtpflow train --kind`` name
    kind: str = ""
    #: the frozen attrs class ``--drafter-config`` is checked against, or its ``"module:Class"``
    #: path (``None``: the trainer checks its options itself)
    options = None
    #: whether ``--drafter-config`` may also be a complete drafter ``config.json`` (``model_type`` set)
    takes_model_config: bool = False

    @classmethod
    def check(cls, cfg) -> None:
        """Refuse settings this kind cannot train with, before anything loads
        (default: no warm start, ``--init-from``)."""
        if cfg.init_from:
            raise ValueError("--init-from warm-starts assistant drafters only")

    @classmethod
    def tap_layers(cls, target, options) -> tuple[int, ...]:
        """The target layers (mtpflow's tap convention) a fresh drafter of this
        kind with ``options`` reads: what ``cache:`` features keep for it (default: none)."""
        return ()

    @classmethod
    def train(cls, target, options, data_spec, out: Path, cfg, examples=None, ranks=None) -> dict:
        """Train a drafter for the loaded ``target`` and write it to ``out``;
        returns the summary (also written to ``out/train_summary.json``)."""
        raise NotImplementedError


def read_options(options):
    """``--drafter-config`` as a dict: a JSON file's path is read (inline JSON and dicts pass)."""
    if isinstance(options, (str, Path)) and not str(options).lstrip().startswith("{"):
        return json.loads(Path(options).read_text())
    return options


class TappedTrainer(KindTrainer):
    """A kind whose drafter reads the target's states at a few layers (EAGLE-3, DFlash): the
    states come from one teacher-forced target forward per batch
    (:class:`mtpflow.train.target.TargetStates`, kept with ``--tap-cache-mb``), or from ``cache:``
    features that keep these layers.  An instance is one run's trainer: ``model``, ``config_id``,
    ``states``, ``n_loss`` (loss terms per step), ``weights(acc_ema)``, ``loss(model, *batch)``,
    ``step_batch(...)``, ``save(out, dtype)`` and ``reduce`` (``None``: the weighted mean)."""

    reduce = None

    def step_batch(self, toks, lmask, lens, step: int, row0: int, idx):
        """The loss arguments of rows ``row0 ..`` of ``step``'s global batch (the examples ``idx``)."""
        raise NotImplementedError

    @classmethod
    def train(cls, target, options, data_spec, out: Path, cfg, examples=None, ranks=None) -> dict:
        """Train and write the drafter in its published format (a Speculators
        checkpoint / a z-lab DFlash checkpoint).  Data-parallel over ``ranks``
        like every kind (:mod:`mtpflow.train.parallel`)."""
        ranks = ranks or world()
        options = read_options(options)
        taps = cls.tap_layers(target, options)  # what the drafter reads: cache: features keep them
        examples, feats, distill, cache_summary = training_data(target, data_spec, out, cfg, examples, ranks,
                                                                taps=taps, kv=False)
        mx.random.seed(cfg.seed)
        trainer = cls(target, options, examples, cfg)
        if feats is not None and any(f.taps is not None for f in feats):
            trainer.states.preload(feats, taps)

        def make_batch(step, rows):
            idx = data_mod.batch_indices(len(examples), cfg.batch_size, cfg.seed, step, rows)  # these rows' examples
            toks_np, loss_np, lens_np = data_mod.batches(examples, cfg.batch_size, cfg.seed, step, idx=idx)
            toks, lmask, lens = mx.array(toks_np), mx.array(loss_np), mx.array(lens_np)
            return trainer.step_batch(toks, lmask, lens, step, rows.start or 0, idx), lens_np

        step, acc_ema, tokens_seen, last, elapsed, speed = optimize(trainer.model, trainer.loss, make_batch, cfg, out,
                                                                    trainer.config_id, trainer.n_loss,
                                                                    data_id=data_mod.fingerprint(examples), ranks=ranks,
                                                                    weights=trainer.weights, reduce=trainer.reduce)
        if ranks.main:
            trainer.save(out, dtype=cfg.save_dtype)
        summary = {
            "kind": cls.kind, "steps": step, "tokens_seen": tokens_seen, "elapsed_s": round(elapsed, 1),
            "train_speed": speed, "examples": len(examples),
            "loss_tokens_per_epoch": int(sum(int(e.loss.sum()) for e in examples)), "final": last,
            "acc_ema": acc_ema, "data": data_spec,
        }
        add_data_summaries(summary, distill, cache_summary)
        if cfg.tap_cache_mb or trainer.states.from_disk:
            summary["tap_cache"] = trainer.states.summary()
        if ranks.main:
            (out / "train_summary.json").write_text(json.dumps(summary, indent=2, default=str))
        return summary


def add_data_summaries(summary: dict, distill, cache_summary) -> None:
    """The feature collections' own summaries (``distill:`` / ``cache:`` data), when there were any."""
    if distill is not None:
        summary["distill"] = distill
    if cache_summary is not None:
        summary["cache"] = cache_summary
