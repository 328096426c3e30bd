"""The DFlash drafter body in MLX (weights under z-lab's names).

For ``C`` context positions and a block of ``L`` tokens
(``[last token, mask, ..., mask]`` at positions ``start .. start+L-1``)::

    ctx = hidden_norm(fc(concat(target layer outputs)))         # once per position
    every layer:  K/V of the context = k_norm(k_proj(ctx)), v_proj(ctx), RoPE at
                  their own positions (cached; the block's K/V never are)
    x = embed_target(block) * input_embedding_scale
    every layer:  h = input_layernorm(x); q = q_norm(q_proj(h)); block K/V from h
                  x = x + o_proj(attn(q, [ctx K, block K], [ctx V, block V]))
                  x = x + mlp(post_attention_layernorm(x))
    out = norm(x);  logits of rows 1.. = target LM head (x output_multiplier, softcap)

Full layers see all context and the whole block (non-causal); sliding layers
are causal inside the block, keys within ``W`` positions of the query.  See
``tests/fixtures/dflash/README.md`` for the reference's exact conventions.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import initialize_rope

from ..layers import MLP

from .config import DFlashConfig


class Attention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        H = cfg.hidden_size
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(H, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(H, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(H, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, H, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.scale = self.head_dim**-0.5
        self.rope = initialize_rope(self.head_dim, cfg.rope["rope_theta"], False, cfg.rope, cfg.max_position_embeddings)

    def kv(self, x, offset):
        """Rotated keys and values ``[B, kvh, L, hd]`` of ``x [B, L, H]`` at ``offset + l``."""
        B, L, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv, self.head_dim)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv, self.head_dim).transpose(0, 2, 1, 3)
        return self.rope(k, offset=offset), v

    def __call__(self, h, offset, ctx_k, ctx_v, mask):
        B, L, _ = h.shape
        q = self.q_norm(self.q_proj(h).reshape(B, L, self.n_heads, self.head_dim)).transpose(0, 2, 1, 3)
        q = self.rope(q, offset=offset)
        k, v = self.kv(h, offset)
        keys = mx.concatenate([ctx_k.astype(k.dtype), k], axis=2)
        values = mx.concatenate([ctx_v.astype(v.dtype), v], axis=2)
        o = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))


class Layer(nn.Module):
    def __init__(self, cfg: DFlashConfig, index: int):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = nn.RMSNorm(H, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(H, eps=eps)
        self.self_attn = Attention(cfg)
        self.mlp = MLP(H, cfg.intermediate_size)
        self.window = cfg.sliding_window if cfg.layer_types[index] == "sliding_attention" else None
        self.causal = cfg.causal[index]

    def __call__(self, x, offset, ctx_k, ctx_v, mask):
        x = x + self.self_attn(self.input_layernorm(x), offset, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashModel(nn.Module):
    """Parameters: ``fc``, ``hidden_norm``, ``layers.N.*``, ``norm`` (the
    embedding and the LM head are the target's)."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.cfg = cfg
        n_in = len(cfg.target_layer_ids) * cfg.target_hidden_size
        self.fc = nn.Linear(n_in, cfg.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.layers = [Layer(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def context(self, features):
        """``hidden_norm(fc(features))``: the context rows every layer projects."""
        return self.hidden_norm(self.fc(features))

    def context_kv(self, features, offset):
        """Per layer ``(K, V)`` of context features ``[B, C, n*Ht]`` at ``offset + c``."""
        ctx = self.context(features)
        return [layer.self_attn.kv(ctx, offset) for layer in self.layers]

    def block(self, x, offset, layer_kv, masks):
        """``norm`` of the layers' output over a block ``x [B, L, H]`` at ``offset + l``,
        given each layer's context ``(K, V)`` and its mask."""
        for layer, (k, v), m in zip(self.layers, layer_kv, masks):
            x = layer(x, offset, k, v, m)
        return self.norm(x)
