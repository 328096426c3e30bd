"""LM heads of the generic assistant drafter, registered like the Gemma ones
(``mtpflow.builtins.heads``): ``target``, ``target_subset`` and ``own``.

* ``target``: the target's own LM head on the projected state ``h'``
  (softcapping included): the drafter owns no vocabulary-sized matrix.
* ``target_subset``: the target's LM-head rows of a reduced **draft
  vocabulary** (EAGLE-3's), ``draft_vocab`` ``[K]`` sorted target ids; drafts
  come from those ids only.
* ``own``: an own ``Linear(hidden_size, K or V)`` on the drafter's final
  normed state (optionally over a draft vocabulary).

``input_space`` says which state a head reads: ``"target"`` (``h'``, the
target's hidden space) or ``"drafter"`` (the drafter's final normed state).
:meth:`support` gives the head's native output -- logits over its
vocabulary, the draft vocabulary when it has one -- which training reads.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ...targets.base import Ref


class _DraftVocab:
    """A draft-vocabulary buffer ``draft_vocab`` (frozen: saved, never trained)."""

    def _init_vocab(self, k: int) -> None:
        if k:
            self.draft_vocab = mx.arange(k, dtype=mx.int32)
            self.freeze(keys=["draft_vocab"], recurse=False)

    @property
    def has_draft_vocab(self) -> bool:
        return "draft_vocab" in self

    def _ids(self, logits):
        if self.has_draft_vocab:
            return mx.broadcast_to(self.draft_vocab, logits.shape)
        return mx.broadcast_to(mx.arange(logits.shape[-1], dtype=mx.int32), logits.shape)

    def support(self, x, E=None):
        lg = self._native(x)
        return self._ids(lg), lg

    def argmax(self, x, E=None):
        best = mx.argmax(self._native(x), axis=-1)
        if self.has_draft_vocab:
            best = self.draft_vocab[best]
        return best.astype(mx.int32)

    def __call__(self, x, E=None):
        lg = self._native(x)
        if not self.has_draft_vocab:
            return lg
        fill = mx.full((*lg.shape[:-1], self.vocab_size), -mx.inf, lg.dtype)
        return mx.put_along_axis(fill, mx.broadcast_to(self.draft_vocab, lg.shape), lg, axis=-1)


class TargetHead(_DraftVocab, nn.Module):
    """The target's own LM head on ``h'`` (no parameters)."""

    name = "target"
    input_space = "target"

    def __init__(self, target, vocab_size: int):
        super().__init__()
        self._target = Ref(target)
        self.vocab_size = vocab_size

    @classmethod
    def from_config(cls, config, vocab_size: int, hidden_size: int, **context) -> "TargetHead":
        return cls(context.get("target"), vocab_size)

    def _native(self, x):
        return self._target.obj.logits(x)


class TargetSubsetHead(TargetHead):
    """The target's LM-head rows of the draft vocabulary ``draft_vocab``."""

    name = "target_subset"

    def __init__(self, target, vocab_size: int, k: int):
        super().__init__(target, vocab_size)
        self._init_vocab(k)

    @classmethod
    def from_config(cls, config, vocab_size: int, hidden_size: int, **context) -> "TargetSubsetHead":
        k = int(config.get("draft_vocab_size") or 0)
        if not k:
            raise ValueError("the target_subset head needs draft_vocab_size in the drafter config")
        return cls(context.get("target"), vocab_size, k)

    def rows(self) -> mx.array:
        """The target's output-embedding rows of the draft vocabulary ``[K, Dt]``, cached per
        vocabulary array and per stream: a lazy cache built on one stream is never handed to a
        graph of another (training lanes evaluate parts side by side, :mod:`mtpflow.train.lanes`)."""
        vocab, stream = self.draft_vocab, str(mx.default_stream(mx.default_device()))
        cached = getattr(self, "_rows", None)
        if cached is None or cached.obj[0] is not vocab or cached.obj[1] != stream:
            cached = Ref((vocab, stream, self._target.obj.output_rows(vocab)))
            self._rows = cached
        return cached.obj[2]

    def _native(self, x):
        target = self._target.obj
        return target.softcapped(x @ self.rows().astype(x.dtype).T)


class OwnHead(_DraftVocab, nn.Module):
    """An own ``Linear(hidden_size, K or V)`` on the drafter's final state."""

    name = "own"
    input_space = "drafter"

    def __init__(self, hidden_size: int, vocab_size: int, k: int = 0):
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = mx.random.normal((k or vocab_size, hidden_size)) * hidden_size**-0.5
        self._init_vocab(k)

    @classmethod
    def from_config(cls, config, vocab_size: int, hidden_size: int, **context) -> "OwnHead":
        return cls(hidden_size, vocab_size, int(config.get("draft_vocab_size") or 0))

    def _native(self, x):
        return x @ self.weight.T


def head_name(config: dict) -> str:
    """The head a generic-assistant config asks for (``lm_head`` and ``draft_vocab_size``)."""
    if config.get("lm_head", "target") == "own":
        return "own"
    return "target_subset" if config.get("draft_vocab_size") else "target"
