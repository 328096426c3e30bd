"""Settings of the native-MTP kind, and the checks that run before any weight is read."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from attrs import field, frozen, validators

from ...errors import IncompatibleDrafter, TargetError
from .families import family_for, supported, text_config


@frozen(kw_only=True)
class NativeMTPSettings:
    """``[plugins.native_mtp]``.

    ``context``: what the head's own K/V cache keeps for accepted drafts.
    ``"verified"`` (default): every accepted position is (re)computed from the
    target's verified hidden state, as the head was trained (the chain's own
    entries are dropped at commit).  ``"drafted"``: the chain entries of
    accepted drafts are kept, made from the head's own hidden state, and only
    the rest is computed from the target (mlx-vlm 0.7.10's choice).
    """

    context: str = field(default="verified", validator=validators.in_(("verified", "drafted")))


def tensor_files(path: Path) -> dict[str, str]:
    """``{tensor name: file}`` of a folder's safetensors, from the index or the
    file headers (no tensor data is read)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            return dict(json.loads(index.read_text())["weight_map"])
        except (json.JSONDecodeError, KeyError) as exc:
            raise TargetError(f"{index}: unreadable index ({exc}); re-download the checkpoint") from None
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        try:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
        except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise TargetError(f"{f}: cannot read the safetensors header ({exc}); re-download it") from None
        out.update({k: f.name for k in header if k != "__metadata__"})
    return out


def check_head(config: dict, path: Path, target_config: dict | None = None, what: str = "checkpoint"):
    """The family, depth and head tensor files of ``path`` (a target
    checkpoint, or a trained module's folder), or a one-line error saying what
    to do -- from config.json and the safetensors headers only."""
    tc = text_config(config)
    mt = tc.get("model_type")
    fam = family_for(config)
    if fam is None:
        raise IncompatibleDrafter(
            f"{path}: model_type {mt!r} has no native-MTP family adapter and its config states no "
            f"num_nextn_predict_layers; native MTP runs {', '.join(supported())} (or a module trained with "
            "`mtpflow train --kind mtp`, passed with --draft-model)"
        )
    D = fam.depth(config)
    if D < 1:
        raise IncompatibleDrafter(
            f"{path}: {fam.depth_field} is {tc.get(fam.depth_field)!r}: this {what} carries no MTP head; "
            "pick another drafter (--draft-model with eagle3 / dflash / assistant) or train one with `mtpflow train --kind mtp`"
        )
    if target_config is not None:
        tt = text_config(target_config)
        for k in ("hidden_size", "vocab_size"):
            if k in tc and k in tt and tc[k] != tt[k]:
                raise IncompatibleDrafter(
                    f"{path}: the MTP module's {k} is {tc[k]} but the target's is {tt[k]}; "
                    "use a module trained for this target"
                )
    files = tensor_files(path)
    names = [k for k in files if fam.selects(k, config)]
    missing = [p for p in fam.expected(config) if not any(k.startswith(p) for k in names)]
    if missing:
        raise IncompatibleDrafter(
            f"{path}: config.json says {fam.depth_field}={D} but the weights have no {', '.join(p + '*' for p in missing)} "
            "(the MTP head): a converter dropped them (mlx-lm's convert does); run the original Hugging Face "
            "checkpoint, or pass a folder holding the MTP layers (config.json + safetensors in the native layout) "
            "with --draft-model"
        )
    return fam, D, {files[k] for k in names}, names


def _depth_weights(inst, attribute, value):
    if value is not None and (len(value) != inst.depth or any(w < 0 for w in value) or sum(value) <= 0):
        raise ValueError(f"must be {inst.depth} non-negative weights, one per depth, not all zero")


@frozen(kw_only=True)
class TrainOptions:
    """``mtpflow train --kind mtp --drafter-config`` options (see :mod:`mtpflow.train.mtp`)."""

    depth: int = field(default=1, validator=validators.ge(1))
    depth_weights: list[float] | None = field(default=None, validator=_depth_weights)
    init: str = field(default="last_layer", validator=validators.in_(("last_layer", "random")))
    from_target: bool = False
