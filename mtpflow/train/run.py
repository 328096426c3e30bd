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
    return _resolve(kinds[kind].trainer)  # a "module:Class" path is imported when training starts


def _resolve(ref):
    """A class, or a ``"module:Class"`` path imported now."""
    if isinstance(ref, str):
        module, _, attr = ref.partition(":")
        return getattr(importlib.import_module(module), attr)
    return ref


def drafter_options(kind: str, value, plugins=None) -> dict | None:
    """``--drafter-config`` of a training run of ``kind``: ``None``, inline
    JSON, the path of a JSON file or a dict; returned as a dict after its keys
    and values are checked against the kind's options class (its trainer's
    ``options``; unknown keys and bad values are one-line errors with their
    path, before anything loads).  A complete drafter ``config.json``
    (``model_type`` set) is returned as it is where the trainer takes one
    (``takes_model_config``): it is checked against the target."""
    import json

    import attrs

    from ..config import ConfigError, structure_settings

    if value is None:
        return None
    where = "--drafter-config"
    if isinstance(value, (str, Path)):
        text = str(value)
        if not text.lstrip().startswith("{"):
            where = f"--drafter-config {text}"
            try:
                text = Path(text).expanduser().read_text()
            except OSError as exc:
                raise ConfigError(f"{where}: cannot be read ({exc.strerror or exc}); pass a JSON file or inline JSON") from None
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a JSON object of options, got {type(value).__name__}")
    trainer = trainer_for(kind, plugins)
    # both members are optional: a trainer written before them (or not a KindTrainer) checks its own options
    options = getattr(trainer, "options", None)
    if options is None or (getattr(trainer, "takes_model_config", False) and value.get("model_type")):
        return dict(value)
    cls = _resolve(options)
    try:
        structure_settings(cls, value, "$")
    except ConfigError as exc:
        known = f" (the {kind} kind's options: {', '.join(f.name for f in attrs.fields(cls))})"
        raise ConfigError(f"{where}: {exc}{known if 'unknown key' in str(exc) else ''}") from None
    return dict(value)


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
    drafter_config = drafter_options(cfg.kind, drafter_config)  # checked before anything loads
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ranks = world()
    ranks.rows(cfg.batch_size)  # a batch the ranks cannot share is refused before any data is read
    import mlx.core as mx

    mx.reset_peak_memory()  # the summary's peak is this run's (target loading included)
    target = load_target(target, cfg.target_bits)
    return trainer.train(target, drafter_config, data_spec, out, cfg, examples, ranks=ranks)
