"""The frozen target of a training run: loading it (float32, or quantized as it loads), its
tokenizer, and its teacher-forced states -- post-norm hidden states and layer taps, all without
gradients -- kept in memory across epochs by :class:`TargetStates` (``--tap-cache-mb``)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np


def load_target(target, bits: int | None = None):
    """A target adapter (float32); ``bits``: quantized to 4 / 8 bits while it
    loads (:func:`mtpflow.train.memory.quantized_from_path`)."""
    if not isinstance(target, (str, Path)):
        if bits:
            from .memory import quantize_target

            quantize_target(target, bits)
        return target
    from ..engine import resolve_model
    from ..plugins import current_plugins
    from ..targets.base import read_config

    path = resolve_model(str(target))
    cfg = read_config(path)
    cls = current_plugins().targets.get(cfg.get("model_type"))
    if bits:
        from .memory import quantized_from_path

        return quantized_from_path(cls, path, cfg, bits)
    return cls.from_path(path, cfg, dtype="float32")


def load_tokenizer(target):
    """The target folder's tokenizer (mlx-lm's loader), or ``None`` when it has none."""
    p = Path(target.path)
    if not ((p / "tokenizer.json").is_file() or (p / "tokenizer.model").is_file()):
        return None
    from mlx_lm.tokenizer_utils import load as load_tok

    return load_tok(p)


def target_states(target, tokens: mx.array, layers) -> tuple[mx.array, dict]:
    """One teacher-forced target forward over ``tokens [B, T]``: post-norm
    hidden states and the taps of ``layers``, all without gradients."""
    cache = target.make_cache()
    target.set_offsets(cache, mx.zeros((tokens.shape[0],), dtype=mx.int32))
    hidden, taps = target.forward_with_taps(tokens, cache, tuple(layers))
    return mx.stop_gradient(hidden), {k: mx.stop_gradient(v) for k, v in taps.items()}


class TargetStates:
    """The target's post-norm hidden states and concatenated layer taps per
    training example, kept in memory up to ``budget_mb`` (``--tap-cache-mb``):
    a batch whose rows are all kept skips the target forward, so every epoch
    after the first trains on the drafter's cost alone.

    Rows are stored unpadded (host copies) and zero-padded to the batch's
    length when reused; both kinds read a row's states only at positions
    before its length (causal attention, masked labels), so a reused batch
    trains as a recomputed one, up to float rounding."""

    def __init__(self, target, layers, budget_mb: float = 0.0):
        self.target, self.layers = target, tuple(layers)
        self.budget = int(budget_mb * 2**20)
        self.rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.bytes = 0
        self.reused = self.computed = 0  # batches
        self.from_disk = 0

    def preload(self, feats, layers) -> None:
        """Keep the states of ``cache:`` features collected with these taps
        (``OUT/features-cache``, float16 on disk), outside the memory budget:
        example ``i`` is ``feats[i]``."""
        if tuple(layers) != self.layers:
            raise ValueError(f"the cached features hold the target layers {list(layers)}, this drafter reads "
                             f"{list(self.layers)}: collect into a new --out (or delete OUT/features-cache)")
        for i, f in enumerate(feats):
            if f.taps is not None:
                self.rows[i] = (f.hidden, f.taps)
                self.from_disk += 1

    def __call__(self, toks: mx.array, lens, idx=None) -> tuple[mx.array, mx.array]:
        """``(hidden [B, T, H], taps [B, T, n*H])`` of the batch ``toks`` whose
        rows are the examples ``idx`` (``None``: not cacheable)."""
        keep = self.budget > 0 and idx is not None
        if idx is not None and self.rows and all(int(i) in self.rows for i in idx):
            self.reused += 1
            T = toks.shape[1]

            def padded(j):
                return mx.array(np.stack([np.pad(self.rows[int(i)][j], ((0, T - len(self.rows[int(i)][j])), (0, 0)))
                                          for i in idx]).astype(np.float32))

            return padded(0), padded(1)
        self.computed += 1
        hidden, taps = target_states(self.target, toks, self.layers)
        g = mx.concatenate([taps[i] for i in self.layers], axis=-1)
        if keep:
            new = [(r, int(i)) for r, i in enumerate(idx) if int(i) not in self.rows]
            if new and self.bytes < self.budget:
                h_np, g_np = np.array(hidden), np.array(g)  # (the step evaluates them anyway)
                lens = np.asarray(lens)
                for r, i in new:
                    n = int(lens[r])
                    size = n * (h_np.shape[-1] + g_np.shape[-1]) * h_np.itemsize
                    if self.bytes + size <= self.budget:
                        self.rows[i] = (h_np[r, :n].copy(), g_np[r, :n].copy())
                        self.bytes += size
        return hidden, g

    def summary(self) -> dict:
        return {"budget_mb": self.budget / 2**20, "examples": len(self.rows), "from_disk": self.from_disk,
                "mb": round(self.bytes / 2**20, 3), "batches_reused": self.reused, "batches_computed": self.computed}

