"""The ``mtp`` drafter kind: proposes a block with a Gemma 4 assistant."""

from __future__ import annotations

from pathlib import Path

from ...targets.base import read_config
from ..base import head_class, load_weights
from ..kv_sharing import POSITION_CONVENTIONS, KVSharingDrafter  # noqa: F401  (POSITION_CONVENTIONS re-exported)
from . import MODEL_TYPES
from .config import AssistantConfig, check_compatible
from .model import Gemma4AssistantModel


class Gemma4AssistantDrafter(KVSharingDrafter):
    """Gemma 4 MTP assistant: reads the target's last hidden state and store-layer K/V."""

    kind = "mtp"
    model_types = MODEL_TYPES
    needs = frozenset({"hidden", "shared_kv"})

    @classmethod
    def check(cls, target_config: dict, drafter_config: dict):
        return check_compatible(target_config, drafter_config)

    @classmethod
    def head_of(cls, config: dict) -> str:
        """The registered head the checkpoint was trained with."""
        return AssistantConfig.from_dict(config).head_kind

    @classmethod
    def load(cls, path, target, options) -> "Gemma4AssistantDrafter":
        path = Path(path)
        acfg = check_compatible(target.config, read_config(path))
        model = Gemma4AssistantModel(acfg, head_class(options, acfg.head_kind))
        load_weights(model, path, options.dtype)
        return cls(model, options.position_convention)
