"""Configuration: frozen attrs classes structured by cattrs from TOML files.

A bad file fails with the path of the bad field, e.g.
``$.draft.block_size: must be >= 1 (got 0)``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Literal

import cattrs
from attrs import field, frozen

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """A configuration file or value is invalid."""


class FieldError(ValueError):
    """A validator failure that remembers its field (for the error path)."""

    def __init__(self, field_name: str, msg: str):
        super().__init__(f"{field_name}: {msg}")
        self.field_name = field_name
        self.msg = msg


def _ge(lo):
    def check(inst, attr, value):
        if value is not None and value < lo:
            raise FieldError(attr.name, f"must be >= {lo} (got {value})")

    return check


def _in_range(lo, hi, lo_open=False):
    def check(inst, attr, value):
        bad = value > hi or (value <= lo if lo_open else value < lo)
        if bad:
            left = "(" if lo_open else "["
            raise FieldError(attr.name, f"must be in {left}{lo}, {hi}] (got {value})")

    return check


@frozen(kw_only=True)
class ModelConfig:
    #: target: local folder or Hugging Face repo id
    model: str | None = None
    #: drafter checkpoint (folder or repo id); none decodes with the target alone
    draft_model: str | None = None
    #: drafter kind; detected from the drafter's config.json when unset
    draft_kind: str | None = None
    #: "auto": the checkpoint's own dtype on a GPU (Metal, CUDA), float32 on a CPU (:mod:`mtpflow.backend.dtypes`)
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"


def _check_tree(value) -> None:
    if value in ("off", "auto"):
        return
    from .state import TreeShape

    try:
        TreeShape.parse(value)
    except ValueError as exc:
        raise FieldError("tree", str(exc)) from None


#: block size when neither the config nor the drafter checkpoint names one
FALLBACK_BLOCK_SIZE = 4
#: the largest block size
MAX_BLOCK_SIZE = 32


@frozen(kw_only=True)
class DraftConfig:
    #: tokens verified per round: drafts + 1 (1 = no drafting); unset = the
    #: drafter checkpoint's recommended block size, else 4 (the adaptive
    #: policy starts there)
    block_size: int | None = field(default=None, validator=[_ge(1)])
    #: drafter query RoPE position: "bonus" (transformers) or "bonus-1" (mlx-vlm)
    position: Literal["bonus", "bonus-1"] = "bonus"
    #: block-size policy plugin: "adaptive" (measures, and falls back to no
    #: drafting when drafting does not pay), "fixed", or "auto" = "fixed" when
    #: ``block_size`` is set, else "adaptive" starting at the drafter's
    #: recommended block size
    policy: str = "auto"
    #: largest block the adaptive policy may choose
    max_block_size: int = field(default=8, validator=[_ge(1)])
    #: drafter LM head: "auto" = what the drafter checkpoint says, or the name
    #: of a registered head (``mtpflow_register_lm_heads``)
    head: str = "auto"
    #: draft trees: "off" (chains), a shape ("4,2,1": children per depth;
    #: "dynamic:TOPK:WIDTH:DEPTH[:NODES]": EAGLE-2's, verifying the NODES most
    #: probable candidates when given), or "auto" (the adaptive policy
    #: measures a few shapes against the chains and uses a tree only where it pays)
    tree: str = field(default="off", validator=lambda i, a, v: _check_tree(v))

    def __attrs_post_init__(self):
        if self.block_size is not None and self.block_size > MAX_BLOCK_SIZE:
            raise FieldError("block_size", f"must be <= {MAX_BLOCK_SIZE} (got {self.block_size})")

    @property
    def size(self) -> int:
        """The block size to start from (``block_size`` or the fallback)."""
        return self.block_size if self.block_size is not None else FALLBACK_BLOCK_SIZE


@frozen(kw_only=True)
class SamplingConfig:
    temperature: float = field(default=0.0, validator=[_ge(0.0)])
    top_p: float = field(default=1.0, validator=[_in_range(0.0, 1.0, lo_open=True)])
    top_k: int = field(default=0, validator=[_ge(0)])
    min_p: float = field(default=0.0, validator=[_in_range(0.0, 1.0)])
    repetition_penalty: float = field(default=1.0, validator=[_in_range(0.0, 100.0, lo_open=True)])
    seed: int | None = None
    #: acceptance sampler plugin; "auto" = the rejection sampler (exact argmax
    #: matching for greedy rows, lossless rejection sampling for the others)
    sampler: str = "auto"
    #: logits-processor plugins applied, in order, before the built-in processing
    processors: list[str] = field(factory=list)


@frozen(kw_only=True)
class BatchConfig:
    policy: str = "static"
    max_batch_size: int = field(default=8, validator=[_ge(1)])
    prefill_step_size: int = field(default=512, validator=[_ge(1)])
    #: prefix caching across requests: keep the target's K/V of finished rows
    #: (an LRU of this many MiB) and prefill only a new prompt's uncached
    #: suffix; 0 = off
    prefix_cache_mb: int = field(default=0, validator=[_ge(0)])


@frozen(kw_only=True)
class GenerationConfig:
    max_tokens: int = field(default=256, validator=[_ge(1)])
    #: start computing each layer of a verify (and of a draft model's forwards) as
    #: soon as its graph is built, so building overlaps compute: "auto" = on a CPU device, where
    #: ``mx.async_eval`` cannot run ahead of the host; "on"; "off"
    submit_layers: Literal["auto", "on", "off"] = "auto"
    #: build the target's and the drafter's RMSNorm, RoPE and linear layers with fewer graph nodes
    #: (:mod:`mtpflow.backend.fusion`; the same values): "auto" = on a CPU device, where MLX runs RMSNorm
    #: and RoPE as graphs of primitives; "on"; "off" (mlx-lm's own modules)
    fuse_ops: Literal["auto", "on", "off"] = "auto"
    #: pad a verify (chain length, tree node count, batch rows) to a bucket (:mod:`mtpflow.backend.shapes`): "auto" = on a GPU device
    bucket_shapes: Literal["auto", "on", "off"] = "auto"


@frozen(kw_only=True)
class TraceConfig:
    #: write one JSON line per round here
    file: str | None = None
    #: synchronise after drafting to split draft / verify time exactly (2 syncs
    #: per round); also turns off the lookahead, whose overlapped rounds have
    #: no separate draft and verify time
    sync_timing: bool = False


def _plugins_config(value):
    """``plugins = ["mod"]`` (a load list) or ``[plugins]`` with ``load`` and ``[plugins.NAME]`` tables."""
    if isinstance(value, PluginsConfig):
        return value
    if isinstance(value, (list, tuple)):
        return PluginsConfig(load=list(value))
    raise TypeError(f"expected a PluginsConfig or a list, got {type(value).__name__}")


@frozen(kw_only=True)
class PluginsConfig:
    """``[plugins]``: modules to load, and one settings table per registered name.

    ``load``: extra plugin modules to import (an unloadable one is an error
    naming it).  ``settings``: ``{NAME: {key: value}}`` from the
    ``[plugins.NAME]`` tables, handed to the plugin registered as ``NAME``
    after validation by its own attrs ``settings`` class (see
    :mod:`mtpflow.api`).
    """

    load: list[str] = field(factory=list)
    settings: dict = field(factory=dict)


@frozen(kw_only=True)
class Config:
    model: ModelConfig = field(factory=ModelConfig)
    draft: DraftConfig = field(factory=DraftConfig)
    sampling: SamplingConfig = field(factory=SamplingConfig)
    batch: BatchConfig = field(factory=BatchConfig)
    generation: GenerationConfig = field(factory=GenerationConfig)
    trace: TraceConfig = field(factory=TraceConfig)
    #: ``[plugins]``: ``load = [...]`` modules and ``[plugins.NAME]`` settings
    #: tables (a plain list is the load list)
    plugins: PluginsConfig = field(factory=PluginsConfig, converter=_plugins_config)


def _strict(kind, accept):
    def hook(value, _type):
        if not accept(value):
            raise TypeError(f"expected {kind}, got {type(value).__name__} {value!r}")
        return value

    return hook


def _converter() -> cattrs.Converter:
    """cattrs converter that rejects unknown keys and lossy coercions
    (``"no"`` as a bool, ``2.5`` as an int, a string as a list)."""
    c = cattrs.Converter(forbid_extra_keys=True)
    c.register_structure_hook(bool, _strict("a boolean", lambda v: isinstance(v, bool)))
    c.register_structure_hook(
        int, _strict("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool))
    )
    c.register_structure_hook(
        float, lambda v, _: float(_strict("a number", lambda x: isinstance(x, (int, float)) and not isinstance(x, bool))(v, _))
    )
    c.register_structure_hook(str, _strict("a string", lambda v: isinstance(v, str)))
    c.register_structure_hook_func(
        lambda t: t == list[str],
        lambda v, _: [c.structure(x, str) for x in _strict("a list", lambda x: isinstance(x, list))(v, _)],
    )

    def structure_plugins(value, _type):
        if isinstance(value, list):
            return PluginsConfig(load=c.structure(value, list[str]))
        if not isinstance(value, dict):
            raise TypeError(f"expected a table ([plugins]) or a list of modules, got {type(value).__name__} {value!r}")
        value = dict(value)
        load = c.structure(value.pop("load", []), list[str])
        for name, table in value.items():
            if not isinstance(table, dict):
                raise FieldError(name, f"expected a table of settings for the plugin registered as {name!r}")
        return PluginsConfig(load=load, settings=value)

    c.register_structure_hook(PluginsConfig, structure_plugins)
    c.register_unstructure_hook(PluginsConfig, lambda p: {"load": list(p.load), **{k: dict(v) for k, v in p.settings.items()}})
    return c


converter = _converter()


_SEP = "\x00"


def _format(exc: BaseException, type_) -> str:
    if isinstance(exc, FieldError):
        return f"{exc.field_name}{_SEP}{exc.msg}"
    if isinstance(exc, cattrs.ForbiddenExtraKeysError):
        return f"unknown key(s) {', '.join(sorted(exc.extra_fields))}"
    if isinstance(exc, KeyError):
        return "required field missing"
    if isinstance(exc, (ValueError, TypeError)) and type_ is not None and str(exc):
        msg = str(exc)
        if isinstance(exc, TypeError) and msg.startswith("expected "):
            return msg
        if "invalid literal" in msg or "could not convert" in msg or isinstance(exc, TypeError):
            return f"expected {getattr(type_, '__name__', type_)} ({msg})"
        return msg
    if "not in literal" in str(exc):
        allowed = ", ".join(repr(a) for a in getattr(type_, "__args__", ()))
        return f"must be one of {allowed}"
    return cattrs.v.format_exception(exc, type_)


def _relocate(line: str) -> str:
    """``"msg @ $.a"`` -> ``"$.a: msg"``; a field-tagged message moves into the path."""
    msg, _, path = line.rpartition(" @ ")
    if _SEP in msg:
        fld, msg = msg.split(_SEP, 1)
        path = f"{path}.{fld}"
    return f"{path}: {msg}"


def structure(data: dict[str, Any]) -> Config:
    try:
        return converter.structure(data, Config)
    except cattrs.BaseValidationError as exc:
        msgs = [_relocate(m) for m in cattrs.transform_error(exc, path="$", format_exception=_format)]
        raise ConfigError("; ".join(msgs)) from None


#: The configs that ship with mtpflow (``configs/`` in the repository is a link here).
SHIPPED_DIR = Path(__file__).resolve().parent / "data" / "configs"


def shipped_configs() -> dict[str, Path]:
    """``{name: path}`` of the shipped configs (``gemma4-e2b`` -> ``.../gemma4-e2b.toml``)."""
    return {p.stem: p for p in sorted(SHIPPED_DIR.glob("*.toml"))}


def find_config(name: str | Path) -> Path:
    """A config file path, or the name of a shipped config (``gemma4-e2b``,
    with or without ``.toml``)."""
    p = Path(name).expanduser()
    if p.is_file():
        return p
    shipped = shipped_configs()
    stem = p.name[: -len(".toml")] if p.name.endswith(".toml") else p.name
    if p.parent != Path("."):
        raise ConfigError(f"config file {p} does not exist")
    if stem in shipped:
        return shipped[stem]
    raise ConfigError(f"config {str(name)!r} is neither a file nor a shipped config ({', '.join(shipped)})")


def parse_set(item: str) -> tuple[list[str], Any]:
    """``"plugins.fixed_temp.temperature=0.7"`` -> ``(["plugins", "fixed_temp", "temperature"], 0.7)``;
    the value is read as a TOML value (``0.7``, ``true``, ``"s"``, ``[1, 2]``), else as a string."""
    key, sep, raw = item.partition("=")
    parts = [k.strip() for k in key.split(".")]
    if not sep or not all(parts):
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE with a dotted KEY, e.g. plugins.NAME.key=1")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return parts, value


def apply_sets(data: dict, sets) -> dict:
    """Apply ``--set`` items (see :func:`parse_set`) to a config dict, in place."""
    for item in sets or ():
        parts, value = parse_set(item)
        node = data
        for i, k in enumerate(parts[:-1]):
            nxt = node.setdefault(k, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"--set {item!r}: $.{'.'.join(parts[: i + 1])} is not a table")
            node = nxt
        node[parts[-1]] = value
    return data


def load_config(path: str | Path | None = None, overrides: dict[str, dict] | None = None, sets=None) -> Config:
    """Read a TOML config (optional: a path or a shipped config's name), apply
    ``{section: {key: value}}`` overrides, then ``sets`` (``--set
    a.b.c=value`` items)."""
    data: dict[str, Any] = {}
    if path is not None:
        p = find_config(path)
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{p}: not valid TOML ({exc})") from None
    for section, values in (overrides or {}).items():
        values = {k: v for k, v in values.items() if v is not None}
        if values:
            data.setdefault(section, {})
            if not isinstance(data[section], dict):
                raise ConfigError(f"$.{section}: expected a table")
            data[section].update(values)
    if isinstance(data.get("plugins"), list) and any(str(x).startswith("plugins.") for x in sets or ()):
        data["plugins"] = {"load": data["plugins"]}
    apply_sets(data, sets)
    try:
        return structure(data)
    except ConfigError as exc:
        where = f"{path}: " if path else ""
        raise ConfigError(f"{where}{exc}") from None


def structure_settings(cls, table: dict, path: str):
    """A plugin's settings: ``table`` structured into its attrs class ``cls``
    (unknown keys and bad values are errors with their path under ``path``)."""
    try:
        return converter.structure(dict(table), cls)
    except cattrs.BaseValidationError as exc:
        field_msgs = _field_errors(cls, table, path)
        if field_msgs:  # a plugin's own validators raise plain errors: name their fields
            raise ConfigError("; ".join(field_msgs)) from None
        msgs = [_relocate(m) for m in cattrs.transform_error(exc, path=path, format_exception=_format)]
        raise ConfigError("; ".join(msgs)) from None
    except (TypeError, ValueError) as exc:
        if isinstance(exc, FieldError):
            raise ConfigError(f"{path}.{exc.field_name}: {exc.msg}") from None
        raise ConfigError(f"{path}: {exc}") from None


def _field_errors(cls, table: dict, path: str) -> list[str]:
    """``$.path.field: message`` for every field of ``table`` whose own
    attrs validator rejects its value (run one field at a time)."""
    import attrs

    out = []
    for f in attrs.fields(cls):
        if f.name not in table or f.validator is None:
            continue
        try:
            value = converter.structure(table[f.name], f.type) if f.type is not None else table[f.name]
            f.validator(None, f, value)
        except cattrs.BaseValidationError:
            continue  # a type error: transform_error reports it with its path
        except (ValueError, TypeError) as exc:
            msg = exc.msg if isinstance(exc, FieldError) else str(exc)
            out.append(f"{path}.{f.name}: {msg}")
    return out


def unstructure(cfg: Config) -> dict:
    return converter.unstructure(cfg)


__all__ = ["Config", "ConfigError", "PluginsConfig", "apply_sets", "load_config", "structure", "unstructure"]
