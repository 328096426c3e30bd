"""Sessions: every plugin resolved once, the target, drafter and tokenizer loaded.

:func:`load_session` resolves the target adapter, drafter kind, sampler, block
and batch policies into plain objects (a :class:`Session`) that the generation
loop (:mod:`mtpflow.engine`) drives.  Every name and the drafter/target
compatibility are checked on the two ``config.json`` files before any weight
is read.
"""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path
from typing import Any

import attrs
from attrs import define, field, frozen

from .api import (
    CheckedDrafter, CommittingDrafter, HeadedDrafter, InTargetDrafter, SessionBound, TargetCheckedDrafter, TreeDrafter, TreeSampler,
    check_needs, has, target_supports,
)
from .config import Config, DraftConfig
from .errors import LoadError, TargetError
from .logs import round_logger
from .metrics import SpecDecodingStats
from .plugins import PluginError, Plugins, get_plugins
from .resolve import (
    DEFAULT_DRAFTER, DEFAULT_TARGET, check_moe_dtype, detect_draft_kind, head_mismatch, head_name, in_target_kind,
    read_model_config, resolve_draft_config, resolve_model,
)

@frozen(kw_only=True)
class DrafterOptions:
    """What ``Drafter.load(path, target, options)`` receives."""

    plugins: Any
    dtype: str | None
    position_convention: str = "bonus"
    #: ``[draft] head``: "auto" (the checkpoint's head) or a registered head name
    head: str = "auto"
    #: the drafter kind's validated ``settings`` (``[plugins.KIND]``), or None
    settings: Any = None
    #: the session's config
    config: Any = None


def _prefix_cache(config: Config):
    mb = config.batch.prefix_cache_mb
    if not mb:
        return None
    from .prefix_cache import PrefixCache

    return PrefixCache(mb * 2**20)


def build_processors(plugins: Plugins, config: Config) -> list:
    """The configured logits processors (``[sampling] processors``), in order
    (mlx-lm ``(tokens, logits)`` processors are adapted by the samplers, see
    :mod:`mtpflow.processors`)."""
    return [plugins.build("logits_processors", n, config, config) for n in config.sampling.processors]


_taps_memo: tuple = (None, ())


@define(kw_only=True)
class Session:
    config: Config
    plugins: Plugins
    target: Any
    drafter: Any = None
    draft_kind: str | None = None
    tokenizer: Any = None
    sampler: Any = None
    block_policy: Any = None
    batch_policy: Any = None
    log: Any = None
    stats: SpecDecodingStats = field(factory=SpecDecodingStats)
    #: the ``[draft]`` settings a config that sets none gets for this pair
    default_draft: Any = None
    #: prefix caching across requests (``[batch] prefix_cache_mb``), or None
    prefix_cache: Any = None
    #: the dtype the target and drafter run in (``[model] dtype`` resolved, see :mod:`mtpflow.backend.dtypes`)
    dtype: str | None = None
    #: the registered names this session runs: drafter_kind, head, sampler,
    #: block_policy, batch_policy (``None``: no drafter, or a kind without heads)
    selection: dict = field(factory=dict)

    @property
    def hook(self):
        return self.plugins.hook

    @property
    def tap_layers(self) -> tuple[int, ...]:
        """Target layers whose hidden states the drafter reads (``"layer:N"`` needs)."""
        global _taps_memo
        needs = self.drafter.needs if self.drafter is not None else ()
        if _taps_memo[0] is not needs:  # asked every round: one entry per needs object
            from .api import needed_layers

            _taps_memo = (needs, needed_layers(needs))
        return _taps_memo[1]

    @property
    def submit_layers(self) -> bool:
        """Whether a verify (and a draft model's forwards) starts each layer as
        it is built (``[generation] submit_layers``; "auto": the device profile, on for a CPU)."""
        return on_for_device(self.config.generation.submit_layers, "submit_layers")

    def trees_supported(self, state) -> bool:
        """Whether this round may verify a tree: a drafter that drafts trees and
        a sampler whose processing does not read the drafts' history."""
        return (has(self.drafter, TreeDrafter) and target_supports(self.target, "trees")
                and has(self.sampler, TreeSampler) and self.sampler.supports_trees(state))

    @property
    def drafter_commit(self):
        """The drafter's ``commit(session, state, accepted)``, or ``None``."""
        return self.drafter.commit if has(self.drafter, CommittingDrafter) else None

    @property
    def max_block_size(self) -> int:
        return max(self.config.draft.size, self.config.draft.max_block_size)

    def reset_stats(self) -> None:
        self.stats = SpecDecodingStats()



def on_for_device(mode: str, tuning: str = "submit_layers") -> bool:
    """An ``"auto"`` / ``"on"`` / ``"off"`` setting of ``tuning`` (``submit_layers``,
    ``fuse_ops``): "auto" is the current device's profile (:mod:`mtpflow.backend.profiles`)."""
    from .backend.profiles import tuning_on

    return tuning_on(tuning, mode)


def fusable_modules(target, drafter=None) -> list:
    """The ``nn.Module`` trees :mod:`mtpflow.backend.fusion` may fuse: the target's
    model and the drafter's (its ``model``: a module, or a draft model's
    target adapter)."""
    import mlx.nn as nn

    out = [target.model] if isinstance(getattr(target, "model", None), nn.Module) else []
    m = getattr(drafter, "model", None)
    m = getattr(m, "model", m) if not isinstance(m, nn.Module) else m
    if isinstance(m, nn.Module) and all(m is not o for o in out):
        out.append(m)
    return out


def load_session(
    config: Config,
    plugins: Plugins | None = None,
    log: Any = None,
    load_tokenizer: bool = True,
    extra_plugins: list | None = None,
) -> Session:
    """Resolve plugins and load target, drafter and tokenizer.

    ``plugins``: a ready plugin manager (default: the process-wide one).
    ``extra_plugins``: plugin objects or module names to load on top of the
    installed ones and the config's ``plugins`` list.  The drafter/target
    compatibility check runs on the two config.json files before any weight
    is read.  MLX work must stay on the thread that loaded the session.
    """
    if plugins is not None and (config.plugins.load or extra_plugins):
        raise ValueError("pass either a ready plugin manager or plugins to load (config.plugins / extra_plugins), not both")
    if config.plugins.load or extra_plugins:
        from .plugins import make_plugin_manager

        plugins = make_plugin_manager(list(extra_plugins or []) + list(config.plugins.load))
    plugins = plugins or get_plugins()
    with plugins.active():  # drafter checks and loaders use these plugins, not the process-wide ones
        return _load_session(config, plugins, log, load_tokenizer)


def _load_session(config: Config, plugins: Plugins, log: Any, load_tokenizer: bool) -> Session:
    plugins.check_settings(config)
    mc = config.model
    _check_kind_name(plugins, mc.draft_kind)
    tpath, draft_model = _model_paths(plugins, mc)
    tcfg = read_model_config(tpath)
    check_moe_dtype(tcfg, mc.dtype, tpath)
    target_cls = _target_class(plugins, tcfg, tpath)
    kind, drafter_cls, dpath, dcfg = _drafter_kind(plugins, mc, tcfg, tpath, draft_model)

    # what a config that leaves [draft] alone gets for this pair (bench's "default" variant)
    default_draft = resolve_draft_config(
        attrs.evolve(config, draft=DraftConfig(position=config.draft.position)), drafter_cls, dcfg, dpath
    ).draft
    config = resolve_draft_config(config, drafter_cls, dcfg, dpath)
    sampler_name = _check_names(plugins, config, kind, drafter_cls)

    from .backend import dtypes

    dtype = dtypes.resolve_dtype(mc.dtype, tpath, tcfg)  # "auto": the checkpoint's on a GPU, float32 on a CPU
    target = target_cls.from_path(tpath, tcfg, dtype=dtype)
    config = _fit_to_target(config, target, tpath, tcfg.get("model_type"))
    drafter = None
    if drafter_cls is not None:
        drafter = _load_drafter(plugins, config, kind, drafter_cls, dpath, dcfg, target, dtype)
    _fuse(config, target, drafter)

    session = Session(
        config=config,
        plugins=plugins,
        target=target,
        drafter=drafter,
        draft_kind=kind,
        tokenizer=_tokenizer(tpath, target) if load_tokenizer else None,
        sampler=plugins.build("samplers", sampler_name, config, config, build_processors(plugins, config)),
        block_policy=plugins.build("block_policies", config.draft.policy, config, config),
        batch_policy=plugins.build("batch_policies", config.batch.policy, config, config),
        default_draft=default_draft,
        prefix_cache=_prefix_cache(config),
        dtype=dtypes.ran_dtype(target, tcfg, dtype),
        selection={
            "drafter_kind": kind,
            "head": head_name(config.draft.head, drafter_cls, dcfg),
            "sampler": sampler_name,
            "block_policy": config.draft.policy if drafter_cls is not None else None,
            "batch_policy": config.batch.policy,
        },
        log=log if log is not None else round_logger(),
    )
    if has(session.sampler, SessionBound):
        session.sampler.bind_session(session)
    return session


def _check_kind_name(plugins: Plugins, draft_kind: str | None) -> None:
    """An unknown ``--draft-kind`` is an error listing the registered kinds
    (``none`` and an in-target kind's aliases are known)."""
    aliases = {a for _, cls in plugins.drafters.items() if has(cls, InTargetDrafter) for a in cls.aliases}
    if draft_kind not in (None, "none") and draft_kind not in aliases:
        plugins.drafters.get(draft_kind)


def _model_paths(plugins: Plugins, mc) -> tuple[Path, str | None]:
    """The target folder and the drafter checkpoint asked for (``None``: none)."""
    if mc.model is not None:
        return resolve_model(mc.model), mc.draft_model
    # the built-in target; its drafter unless another drafter or kind is asked for
    tpath = resolve_model(DEFAULT_TARGET)
    draft_model = mc.draft_model
    if draft_model is None:
        dpath = resolve_model(DEFAULT_DRAFTER)
        if mc.draft_kind is None or mc.draft_kind == detect_draft_kind(plugins, read_model_config(dpath), None):
            draft_model = str(dpath)
    return tpath, draft_model


def _target_class(plugins: Plugins, tcfg: dict, tpath: Path):
    """The target adapter registered for the target's ``model_type``."""
    mt = tcfg.get("model_type")
    try:
        return plugins.targets.get(mt)
    except PluginError:
        raise LoadError(
            f"{tpath}/config.json: unsupported target model_type {mt!r}; supported: {', '.join(plugins.targets.names())}"
        ) from None


def _drafter_kind(plugins: Plugins, mc, tcfg: dict, tpath: Path, draft_model: str | None) -> tuple:
    """``(kind, drafter class, drafter path, drafter config)`` (``None`` where
    there is none), the drafter checked against the target before any weight
    is read."""
    if draft_model is not None:
        dpath = resolve_model(draft_model)
        dcfg = read_model_config(dpath)
        kind = detect_draft_kind(plugins, dcfg, mc.draft_kind)
        drafter_cls = plugins.drafters.get(kind)
        if has(drafter_cls, CheckedDrafter):
            check = drafter_cls.check
            if "drafter_path" in inspect.signature(check).parameters:
                check(tcfg, dcfg, drafter_path=dpath)
            else:
                check(tcfg, dcfg)
        return kind, drafter_cls, dpath, dcfg
    kind = drafter_cls = None
    if mc.draft_kind is not None or mc.model is not None:
        kind = in_target_kind(plugins, tcfg, tpath, mc.draft_kind)
        drafter_cls = plugins.drafters.get(kind) if kind is not None else None
        if has(drafter_cls, TargetCheckedDrafter):
            drafter_cls.check_target(tcfg, tpath)
    return kind, drafter_cls, None, None


def _check_names(plugins: Plugins, config: Config, kind: str | None, drafter_cls) -> str:
    """Every plugin name the config uses resolves (before any weight is read);
    the sampler's name."""
    sc = config.sampling
    # "auto": the rejection sampler, which verifies greedy rows by exact argmax
    # matching and samples the others losslessly (per request)
    sampler_name = sc.sampler if sc.sampler != "auto" else "rejection"
    plugins.samplers.get(sampler_name)
    for n in sc.processors:
        plugins.logits_processors.get(n)
    plugins.block_policies.get(config.draft.policy)
    plugins.batch_policies.get(config.batch.policy)
    if config.draft.head != "auto":
        plugins.lm_heads.get(config.draft.head)
        if drafter_cls is not None and not has(drafter_cls, HeadedDrafter):
            raise LoadError(
                f"[draft] head = {config.draft.head!r}: drafter kind {kind!r} has no LM head to replace; "
                "remove [draft] head (or set it to \"auto\")"
            )
    return sampler_name


def _fit_to_target(config: Config, target, tpath: Path, mt: str | None) -> Config:
    """``config`` without what the target cannot do (the prefix cache, trees), with a warning."""
    if config.batch.prefix_cache_mb and not target_supports(target, "prefix_cache"):
        warnings.warn(f"{tpath}: the prefix cache cannot serve this target (model_type {mt!r}); running without it "
                      "(set [batch] prefix_cache_mb = 0 to silence this)", stacklevel=3)
        config = attrs.evolve(config, batch=attrs.evolve(config.batch, prefix_cache_mb=0))
    if config.draft.tree != "off" and not target_supports(target, "trees"):
        warnings.warn(f"{tpath}: this target (model_type {mt!r}) verifies chains only; drafting chains instead of trees", stacklevel=3)
        config = attrs.evolve(config, draft=attrs.evolve(config.draft, tree="off"))
    return config


def _load_drafter(plugins: Plugins, config: Config, kind: str, drafter_cls, dpath, dcfg, target, dtype):
    """The drafter, loaded for ``target``; a head that does not fit the
    checkpoint is named as such."""
    opts = DrafterOptions(
        plugins=plugins, dtype=dtype, position_convention=config.draft.position, head=config.draft.head,
        settings=plugins.settings_for(kind, drafter_cls, config), config=config,
    )
    try:
        drafter = drafter_cls.load(dpath, target, opts)
    except TargetError as exc:
        mismatch = head_mismatch(config.draft.head, drafter_cls, dcfg, dpath)
        if mismatch is None:
            raise
        raise mismatch from exc
    why = check_needs(getattr(drafter, "needs", None))
    if why:
        raise PluginError(f"drafter kind {kind!r}: {why}")
    return drafter


def _fuse(config: Config, target, drafter) -> None:
    """Fuse the target's and drafter's ops (``[generation] fuse_ops``)."""
    from .backend import fusion

    if on_for_device(config.generation.fuse_ops, "fuse_ops"):
        for m in fusable_modules(target, drafter):
            fusion.fuse(m)


def _tokenizer(tpath: Path, target):
    """The target folder's tokenizer, or ``None`` when it has none."""
    if not ((tpath / "tokenizer.json").is_file() or (tpath / "tokenizer.model").is_file()):
        return None
    from mlx_lm.tokenizer_utils import load as load_tok

    return load_tok(tpath, eos_token_ids=sorted(target.eos_ids) or None)


__all__ = ["Session", "DrafterOptions", "LoadError", "load_session", "build_processors", "on_for_device", "fusable_modules"]
