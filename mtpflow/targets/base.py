"""What every target adapter provides to the round stages.

A target adapter wraps an mlx-lm model and exposes, for any batch of rows at
their own positions:

* ``forward(tokens, cache)`` -> post-norm final hidden state of every position;
* ``logits(hidden)`` -> the model's output logits (softcapping included);
* ``embed(tokens)`` -> the model's *scaled* input embedding;
* ``shared_kv(cache)`` -> the store layers' K/V per attention type, with
  slot positions (:class:`mtpflow.state.KVView`);
* ``make_cache(batch_size, extra)`` -> a list of :class:`SlotKVCache`, whose
  sliding layers retain ``extra`` positions beyond the window so that
  rollback and drafter hand-over are always exact.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..state import KVView
from .cache import SlotKVCache

FULL = "full_attention"
SLIDING = "sliding_attention"


class TargetError(ValueError):
    """A target checkpoint cannot be used."""


def read_config(path: Path) -> dict:
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        raise TargetError(f"{path}: no config.json; pass a Hugging Face model folder or repo id")
    try:
        return json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise TargetError(f"{cfg_path}: not valid JSON ({exc}); re-download the checkpoint") from None


def load_safetensors(path: Path, what: str = "checkpoint") -> dict:
    """All ``*.safetensors`` tensors of a folder, with one-line errors."""
    import glob

    import mlx.core as mx

    files = sorted(glob.glob(str(Path(path) / "*.safetensors")))
    if not files:
        raise TargetError(f"{path}: no *.safetensors weights; download the full {what}")
    weights = {}
    for f in files:
        try:
            weights.update(mx.load(f))
        except Exception as exc:
            raise TargetError(f"{f}: cannot read safetensors ({exc}); the file is corrupt or truncated, re-download it") from None
    return weights


def cast_floats(weights: dict, dtype: str | None) -> dict:
    """Cast floating-point tensors to ``dtype`` (integer buffers stay as they are)."""
    import mlx.core as mx

    if not dtype:
        return weights
    dt = getattr(mx, dtype)
    return {k: (v.astype(dt) if mx.issubdtype(v.dtype, mx.floating) else v) for k, v in weights.items()}


def read_eos_ids(path: Path, config: dict) -> set[int]:
    """EOS ids from generation_config.json, falling back to config.json."""
    ids: set[int] = set()
    for src in (Path(path) / "generation_config.json",):
        if src.is_file():
            try:
                v = json.loads(src.read_text()).get("eos_token_id")
            except json.JSONDecodeError:
                v = None
            if v is not None:
                ids.update(v if isinstance(v, list) else [v])
    if not ids:
        v = config.get("eos_token_id", config.get("text_config", {}).get("eos_token_id"))
        if v is not None:
            ids.update(v if isinstance(v, list) else [v])
    return {int(i) for i in ids}


class TargetAdapter:
    """Base class; subclasses set the attributes below in ``__init__``."""

    model_types: tuple[str, ...] = ()
    hidden_size: int
    vocab_size: int
    sliding_window: int | None
    layer_types: list[str]
    store_layers: dict[str, int]
    config: dict
    eos_ids: set[int]
    path: Path
    model: Any

    # subclasses implement
    def forward(self, tokens: mx.array, cache: list) -> mx.array:  # pragma: no cover
        raise NotImplementedError

    def logits(self, hidden: mx.array) -> mx.array:  # pragma: no cover
        raise NotImplementedError

    def embed(self, tokens: mx.array) -> mx.array:  # pragma: no cover
        raise NotImplementedError

    def final_norm(self, x: mx.array) -> mx.array:
        """The target's final norm (what turns its last residual stream into
        the post-norm hidden state ``forward`` returns)."""
        inner = getattr(self, "inner", None) or self.model.model
        return inner.norm(x)

    @property
    def cache_layer_types(self) -> list[str]:
        """Attention type of every layer that owns a cache."""
        return list(self.layer_types)

    def make_cache(self, extra: int = 16) -> list[SlotKVCache]:
        out = []
        for t in self.cache_layer_types:
            if t == SLIDING and self.sliding_window:
                out.append(SlotKVCache(window=self.sliding_window, retain=self.sliding_window + 1 + extra))
            else:
                out.append(SlotKVCache())
        return out

    def set_offsets(self, cache: list[SlotKVCache], offsets: mx.array) -> None:
        for c in cache:
            c.offset = offsets

    def shared_kv(self, cache: list[SlotKVCache]) -> dict[str, KVView]:
        out = {}
        for t, idx in self.store_layers.items():
            k, v, p = cache[idx].view()
            out[t] = KVView(keys=k, values=v, positions=p)
        return out

    def compact(self, cache: list[SlotKVCache], n_valid_max: int, min_positions: list[int]) -> None:
        """Bound cache growth: sliding layers drop slots older than ``retain``,
        full layers squeeze out holes left by rejected drafts."""
        pos = mx.array(min_positions, dtype=mx.int32)
        for c in cache:
            if c.window is not None:
                if c.idx > c.retain + c.step // 4:
                    c.compact(min(c.retain, c.idx), pos - c.retain)
            elif c.idx - n_valid_max > max(64, c.idx // 4):
                c.compact(n_valid_max)
