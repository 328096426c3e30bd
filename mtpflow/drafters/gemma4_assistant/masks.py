"""Which handed-over K/V slots a drafting step attends to ("clean" hand-over).

``positions`` are the slots' absolute positions (negative = empty/rejected),
``bonus`` the position of the row's last, unverified token.  Full-attention
layers see every accepted position before ``bonus``; sliding layers see the
last ``window + 1`` of them (transformers' bidirectional-mask quirk, spec L7),
that is positions ``[bonus - window - 1, bonus - 1]``.
"""

from __future__ import annotations

import mlx.core as mx


def drafter_mask(positions: mx.array, bonus: mx.array, window: int | None) -> mx.array:
    """Boolean mask ``[B, 1, 1, S]`` for one query per row."""
    b = bonus[:, None]
    m = (positions >= 0) & (positions < b)
    if window is not None:
        m = m & (positions >= b - window - 1)
    return m[:, None, None, :]
