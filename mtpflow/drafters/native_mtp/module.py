"""The DeepSeek-style MTP module in MLX, and its native checkpoint layout.

One MTP layer ``i`` (of ``D``), for a token embedding ``e`` (the token after
the one whose state is ``h``) and a hidden state ``h`` (the target's
post-norm hidden state at depth 0, the previous layer's output after)::

    x   = eh_proj(concat([enorm(e), hnorm(h)]))      # [..., 2H] -> [..., H]; e first
    x   = block(x, mask, cache)                      # one decoder layer of the family
    out = shared_head.norm(x)                        # logits = target.lm_head(out)

``out`` is also the hidden state the next depth reads (as SGLang and mlx-vlm
feed it; vLLM feeds ``x`` before the norm).  The module owns no embedding and
no output head: both are the target's.

Native layout (what the target checkpoint carries, what ``mtpflow export``
writes for a trained module): layer ``i`` sits at ``model.layers.{N + i}``
(``N = num_hidden_layers``) with ``enorm``, ``hnorm``, ``eh_proj``,
``shared_head.norm`` and the decoder block under the family's own layer key
names (``self_attn.*``, ``mlp.*``, ``input_layernorm``,
``post_attention_layernorm``).  DeepSeek-V3's copies of the target's
``embed_tokens`` and ``shared_head.head`` inside that layer are ignored.
:func:`from_native` / :func:`to_native` map the two namings.
"""

from __future__ import annotations

import re

import mlx.core as mx
import mlx.nn as nn

#: tensors of an MTP layer that are not part of its decoder block
OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")
#: tensors an MTP layer may carry that are copies of the target's (ignored)
COPIES = ("embed_tokens.", "shared_head.head.")


class SharedHead(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.norm = nn.RMSNorm(hidden_size, eps=eps)


class MTPLayer(nn.Module):
    """One MTP layer around a decoder ``block`` (an instance of the family's
    mlx-lm decoder-layer class, called as ``block(x, mask, cache)``)."""

    def __init__(self, hidden_size: int, eps: float, block: nn.Module):
        super().__init__()
        self.enorm = nn.RMSNorm(hidden_size, eps=eps)
        self.hnorm = nn.RMSNorm(hidden_size, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.block = block
        self.shared_head = SharedHead(hidden_size, eps)

    def fuse(self, e: mx.array, h: mx.array) -> mx.array:
        """``eh_proj([enorm(e); hnorm(h)])``."""
        return self.eh_proj(mx.concatenate([self.enorm(e), self.hnorm(h)], axis=-1))

    def __call__(self, e: mx.array, h: mx.array, mask=None, cache=None) -> mx.array:
        x = self.block(self.fuse(e, h), mask, cache)
        if isinstance(x, tuple):
            x = x[0]
        return self.shared_head.norm(x)


class NativeMTP(nn.Module):
    """``D`` chained MTP layers (``layers[i]`` drafts depth ``i + 1``)."""

    def __init__(self, layers: list[MTPLayer]):
        super().__init__()
        self.layers = layers

    @property
    def depth(self) -> int:
        return len(self.layers)


def from_native(weights: dict, num_hidden_layers: int, depth: int) -> dict:
    """``model.layers.{N+i}.X`` tensors -> this module's names (``layers.i.X``,
    the block under ``layers.i.block.``); other tensors are left out."""
    out = {}
    pat = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
    for k, v in weights.items():
        m = pat.match(k)
        if not m:
            continue
        i = int(m.group(1)) - num_hidden_layers
        if not 0 <= i < depth:
            continue
        rest = m.group(2)
        if rest.startswith(COPIES):
            continue
        out[f"layers.{i}.{rest}" if rest.startswith(OWN) else f"layers.{i}.block.{rest}"] = v
    return out


def to_native(weights: dict, num_hidden_layers: int) -> dict:
    """The inverse of :func:`from_native`: this module's (flattened) tensors
    under the native ``model.layers.{N+i}.*`` names."""
    out = {}
    pat = re.compile(r"^layers\.(\d+)\.(block\.)?(.+)$")
    for k, v in weights.items():
        m = pat.match(k)
        if not m:
            raise ValueError(f"not an MTP module tensor: {k}")
        out[f"model.layers.{num_hidden_layers + int(m.group(1))}.{m.group(3)}"] = v
    return out
