"""Layers the drafter kinds share (each kind's folder imports them from here)."""

from __future__ import annotations

import mlx.nn as nn


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` (the drafters' shared MLP)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))
