"""``mtpflow train``'s entry point: :func:`train` finds the kind's trainer among the registered
drafter kinds (those with the :class:`mtpflow.api.TrainableDrafter` capability), lets it check
the settings, loads the frozen target and hands over (see :mod:`mtpflow.train.kind`)."""

from __future__ import annotations

import importlib
from dataclasses import asdict
from pathlib import Path

from .config import TrainConfig
from .parallel import world
from .target import load_target


def trainable_kinds(plugins=None) -> dict:
    """``{train_kind: drafter class}`` of the registered drafter kinds that
    declare :class:`mtpflow.api.TrainableDrafter` (``plugins``: default the
    session's being loaded, else the process-wide ones)."""
    from ..api import TrainableDrafter, has
    from ..plugins import PluginError, current_plugins

    plugins = plugins or current_plugins()
    out: dict = {}
    for name, cls in plugins.drafters.items():
        if not has(cls, TrainableDrafter):
            continue
        kind = cls.train_kind
        if kind in out:
            raise PluginError(f"drafter kinds {out[kind][0]!r} and {name!r} both train as --kind {kind}")
        out[kind] = (name, cls)
    return {kind: cls for kind, (_, cls) in out.items()}


def trainer_for(kind: str, plugins=None):
    """The trainer (a :class:`mtpflow.train.kind.KindTrainer`) of the ``--kind`` ``kind``."""
    kinds = trainable_kinds(plugins)
    if kind not in kinds:
        raise ValueError(f"kind must be one of {', '.join(repr(k) for k in sorted(kinds))} (got {kind!r})")
    trainer = kinds[kind].trainer
    if isinstance(trainer, str):  # "module:Class": imported when training starts
        module, _, attr = trainer.partition(":")
        trainer = getattr(importlib.import_module(module), attr)
    return trainer


def tap_layers(kind: str, target, options, plugins=None) -> tuple[int, ...]:
    """The target layers a fresh drafter of ``kind`` with ``options`` reads
    (what ``cache:`` features keep for it; ``()`` for kinds that read none)."""
    return tuple(trainer_for(kind, plugins).tap_layers(target, options))


def train(target, drafter_config, data_spec, out_dir, config: TrainConfig | None = None, examples=None, plugins=None,
          **overrides) -> dict:
    """Train a drafter of ``config.kind`` (default: the assistant kind) for
    ``target`` (path, repo id or a loaded adapter) and write a loadable
    drafter folder to ``out_dir``.

    Resumes from ``out_dir/checkpoint`` when present.  ``overrides`` are
    :class:`TrainConfig` fields; ``plugins``: the plugins whose drafter kinds
    and target adapters to use (default: the process-wide ones).  Returns a
    summary dict (also written to ``out_dir/train_summary.json``)."""
    cfg = config or TrainConfig()
    if overrides:
        cfg = TrainConfig(**{**asdict(cfg), **overrides})
    if plugins is not None:
        with plugins.active():
            return train(target, drafter_config, data_spec, out_dir, cfg, examples)
    trainer = trainer_for(cfg.kind)
    trainer.check(cfg)
    from ..config import drafter_options

    drafter_config = drafter_options(cfg.kind, drafter_config)  # checked before anything loads
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ranks = world()
    ranks.rows(cfg.batch_size)  # a batch the ranks cannot share is refused before any data is read
    import mlx.core as mx

    mx.reset_peak_memory()  # the summary's peak is this run's (target loading included)
    target = load_target(target, cfg.target_bits)
    return trainer.train(target, drafter_config, data_spec, out, cfg, examples, ranks=ranks)
