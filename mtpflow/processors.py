"""Logits processors: mtpflow's batched form and mlx-lm's per-sequence form.

mtpflow's form is ``processor(logits, rows)`` on ``[B, L, V]`` target logits
(``[B, V]`` at prefill), optionally with a keyword ``drafts`` (the ``[B, L-1]``
drafted tokens that follow ``rows``' tokens inside the verified block).

mlx-lm's form is ``processor(tokens, logits)``: ``tokens`` are all the ids of
one sequence so far (prompt, then generated, including the token whose
next-token logits these are) and ``logits`` is ``[1, V]`` -- the
``logits_processors`` of ``mlx_lm.generate.generate_step``.
:func:`as_batch_processor` adapts one to mtpflow's form: per row and verified
position it passes exactly the tokens target-only decoding would have passed
(prompt + generated + the drafts before that position), so output through
the speculative path equals output through the target-only path.  It builds
the token arrays lazily (no host synchronisation) but calls the processor
once per row and position: mlx-lm processors cost ``B * L`` calls a round.
"""

from __future__ import annotations

import inspect
from typing import Callable


def is_mlx_lm_processor(fn: Callable) -> bool:
    """Whether ``fn`` takes ``(tokens, logits)`` (mlx-lm's logits-processor
    form): its second parameter is named ``logits`` (mlx-lm's own processors
    name the first ``tokens`` or ``_``), or it is marked ``fn.mlx_lm = True``."""
    if getattr(fn, "mlx_lm", None) is not None:
        return bool(fn.mlx_lm)
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return False
    return len(params) >= 2 and params[1] == "logits"


def accepts_drafts(fn: Callable) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "drafts" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


class MLXLMProcessor:
    """An mlx-lm ``(tokens, logits)`` processor in mtpflow's batched form."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def __call__(self, logits, rows, drafts=None):
        import mlx.core as mx

        squeeze = logits.ndim == 2
        x = logits[:, None, :] if squeeze else logits
        B, L, _ = x.shape
        out_rows = []
        for b, row in enumerate(rows[:B]):
            ctx = mx.array(list(row.request.prompt) + list(row.generated), dtype=mx.int32)
            cols = []
            for pos in range(L):
                toks = ctx if pos == 0 or drafts is None else mx.concatenate([ctx, drafts[b, :pos].astype(mx.int32)])
                cols.append(self.fn(toks, x[b : b + 1, pos, :])[0])
            out_rows.append(mx.stack(cols))
        out = mx.stack(out_rows)
        return out[:, 0, :] if squeeze else out


def as_batch_processor(fn: Callable) -> Callable:
    """``fn`` in mtpflow's batched form (mlx-lm processors are wrapped)."""
    return MLXLMProcessor(fn) if is_mlx_lm_processor(fn) else fn


def with_drafts(fn: Callable) -> Callable:
    """``fn`` as ``fn(logits, rows, drafts=None)`` (resolved once, not per round)."""
    fn = as_batch_processor(fn)
    if accepts_drafts(fn):
        return fn
    return lambda logits, rows, drafts=None: fn(logits, rows)
