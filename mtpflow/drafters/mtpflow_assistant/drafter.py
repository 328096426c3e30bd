"""The ``assistant`` drafter kind (``model_type: mtpflow_assistant``).

The propose loop and the K/V hand-over masks are the Gemma 4 assistant's
(:class:`~mtpflow.drafters.kv_sharing.KVSharingDrafter`, which both kinds
subclass): only loading, the model and the check differ.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from ...targets.base import TargetError, read_config
from ..base import head_class, load_weights
from ..kv_sharing import KVSharingDrafter
from . import MODEL_TYPES
from .config import check_compatible
from .heads import head_name
from .model import GenericAssistantModel

WEIGHTS = "model.safetensors"


def save_drafter(model: GenericAssistantModel, out_dir, dtype: str | None = None, extra_files: dict | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (Hugging Face-style folder)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(model.config)
    weights = dict(tree_flatten(model.parameters()))
    if dtype:
        dt = getattr(mx, dtype)
        weights = {k: (v.astype(dt) if mx.issubdtype(v.dtype, mx.floating) else v) for k, v in weights.items()}
        cfg["torch_dtype"] = dtype
    mx.save_safetensors(str(out / WEIGHTS), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for name, text in (extra_files or {}).items():
        (out / name).write_text(text)
    return out


def load_model(path, target, dtype: str | None = None, head_cls=None) -> GenericAssistantModel:
    """Check ``path`` against the target, then build and load its model
    (``head_cls``: a registered LM head; default: the one its config names)."""
    path = Path(path)
    cfg = check_compatible(target.config, read_config(path))
    model = GenericAssistantModel(cfg, target, head_cls)
    if not (path / WEIGHTS).is_file():
        raise TargetError(f"{path}: no {WEIGHTS}")
    load_weights(model, path, dtype)
    return model


class GenericAssistantDrafter(KVSharingDrafter):
    """KV-sharing MTP drafter for any target (reads ``hidden`` + ``shared_kv``)."""

    kind = "assistant"
    model_types = MODEL_TYPES
    needs = frozenset({"hidden", "shared_kv"})
    #: ``mtpflow train --kind assistant`` (mtpflow.api.TrainableDrafter)
    train_kind, trainer = "assistant", "mtpflow.drafters.mtpflow_assistant.train:AssistantTrainer"

    @classmethod
    def check(cls, target_config: dict, drafter_config: dict):
        return check_compatible(target_config, drafter_config)

    @classmethod
    def head_of(cls, config: dict) -> str:
        """The registered head the checkpoint was trained with."""
        return head_name(config)

    @classmethod
    def load(cls, path, target, options) -> "GenericAssistantDrafter":
        head = head_class(options, head_name(read_config(path)))
        model = load_model(path, target, options.dtype, head)
        return cls(model, options.position_convention)

    @classmethod
    def from_model(cls, model: GenericAssistantModel, position_convention: str = "bonus") -> "GenericAssistantDrafter":
        return cls(model, position_convention)
