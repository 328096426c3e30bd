"""The EAGLE-3 drafter body in MLX (weights under the Speculators names).

One drafting step for ``L`` query rows (a catch-up over accepted positions at
step 0, one row per chained step)::

    h0 = fc(input_norm?(concat(g_a, g_b, g_c)))          # step 0: three target layers
    e  = embed(token);  h = previous step's state (h0 at step 0)
    layer:  residual = hidden_norm(h) if norm_before_residual else h
            x = concat(input_layernorm(e), hidden_norm(h))        # 2H
            q, k, v = q/k/v_proj(x); RoPE at the token's position
            h1 = residual + o_proj(attn(q, [cache K, k], [cache V, v]))
            out = h1 + mlp(post_attention_layernorm(h1))
    logits = lm_head(norm(out))     over the draft vocabulary; target id = d + d2t[d]
    next h = norm(out) if norm_output else out

See ``tests/fixtures/eagle3/README.md`` for the reference's exact conventions.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import initialize_rope

from ..layers import MLP

from ...targets.base import rope_at as _rope_at
from .config import Eagle3Config


class Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        H2 = 2 * cfg.hidden_size
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(H2, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(H2, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(H2, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = nn.RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.scale = self.head_dim**-0.5
        self.rope = initialize_rope(self.head_dim, cfg.rope["rope_theta"], False, cfg.rope, cfg.max_position_embeddings)

    def qkv(self, x, positions):
        """``q [B, nh, L, hd]``, ``k, v [B, kvh, L, hd]`` with RoPE at ``positions [B, L]``."""
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim)
        k = self.k_proj(x).reshape(B, L, self.n_kv, self.head_dim)
        v = self.v_proj(x).reshape(B, L, self.n_kv, self.head_dim).transpose(0, 2, 1, 3)
        if "q_norm" in self:
            q, k = self.q_norm(q), self.k_norm(k)
        q = _rope_at(self.rope, q.transpose(0, 2, 1, 3), positions)
        k = _rope_at(self.rope, k.transpose(0, 2, 1, 3), positions)
        return q, k, v

    def attend(self, q, keys, values, mask):
        B, _, L, _ = q.shape
        o = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def attend_ttt(self, q, keys, values, visible):
        """Attention of a training-time-test step ``j = len(keys) - 1``: the queries ``[B, nh, T, hd]``
        see the step-0 keys ``keys[0]`` ``[B, kvh, S, hd]`` where ``visible [T, S]`` allows and, of every later step
        ``i``, only their own row's key ``keys[i][:, :, t]``.  The same attention as
        :meth:`attend` with Speculators' ``[T, T (j + 1)]`` mask (``visible`` then ``j`` diagonal
        blocks), without its ``T j`` hidden columns: one ``[T, T]`` product plus a dot product per
        later step (the same values to float rounding).  The products go through ``mx.matmul``."""
        B, nh, T, hd = q.shape  # (T query rows: all of them, or a training step's later rows only,
        S = keys[0].shape[-2]  # against the S step-0 keys; a later step's own keys are the queries' rows)
        g = nh // self.n_kv
        qs = (q * self.scale).reshape(B, self.n_kv, g, T, hd)
        k0, v0 = keys[0][:, :, None], values[0][:, :, None]  # [B, kvh, 1, S, hd]
        scores = mx.matmul(qs, k0.swapaxes(-1, -2))  # [B, kvh, g, T, S]
        scores = mx.where(visible, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        own = [(qs * k[:, :, None]).sum(-1, keepdims=True) for k in keys[1:]]  # [B, kvh, g, T, 1] each
        p = mx.softmax(mx.concatenate([scores, *own], axis=-1) if own else scores, axis=-1, precise=True)
        o = mx.matmul(p[..., :S], v0)
        for i, v in enumerate(values[1:]):
            o = o + p[..., S + i : S + i + 1] * v[:, :, None]
        return self.o_proj(o.reshape(B, nh, T, hd).transpose(0, 2, 1, 3).reshape(B, T, -1))


class Layer(nn.Module):
    #: what ``--grad-checkpoint`` recomputes (training calls these, not ``__call__``)
    checkpoint_methods = ("finish", "finish_ttt")

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = nn.RMSNorm(H, eps=eps)
        self.hidden_norm = nn.RMSNorm(H, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(H, eps=eps)
        self.self_attn = Attention(cfg)
        self.mlp = MLP(H, cfg.intermediate_size)
        self.norm_before_residual = cfg.norm_before_residual

    def project(self, e, h, positions):
        """``(q, k, v, residual)`` for token embeddings ``e`` and states ``h`` ``[B, L, H]``."""
        hn = self.hidden_norm(h)
        residual = hn if self.norm_before_residual else h
        x = mx.concatenate([self.input_layernorm(e), hn], axis=-1)
        q, k, v = self.self_attn.qkv(x, positions)
        return q, k, v, residual

    def finish(self, q, keys, values, mask, residual):
        h1 = residual + self.self_attn.attend(q, keys, values, mask)
        return h1 + self.mlp(self.post_attention_layernorm(h1))

    def finish_ttt(self, q, keys, values, visible, residual):
        """:meth:`finish` for a training-time-test step (:meth:`Attention.attend_ttt`)."""
        h1 = residual + self.self_attn.attend_ttt(q, keys, values, visible)
        return h1 + self.mlp(self.post_attention_layernorm(h1))


class Eagle3Model(nn.Module):
    """Parameters: ``fc``, ``input_norm`` / ``fc_norm.{i}`` (when the config
    has them), ``layers.0.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d`` and,
    when the checkpoint carries one, ``embed_tokens``."""

    def __init__(self, cfg: Eagle3Config, has_embed: bool, has_t2d: bool = True):
        super().__init__()
        self.cfg = cfg
        H, Ht, n = cfg.hidden_size, cfg.target_hidden_size, cfg.num_aux
        if has_embed:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        if cfg.norm_before_fc:
            self.input_norm = nn.RMSNorm(n * Ht, eps=cfg.rms_norm_eps)
        if cfg.fc_norm:
            self.fc_norm = [nn.RMSNorm(Ht, eps=cfg.rms_norm_eps) for _ in range(n)]
        self.fc = nn.Linear(n * Ht, H, bias=False)
        self.layers = [Layer(cfg)]
        self.norm = nn.RMSNorm(H, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.d2t = mx.zeros((cfg.draft_vocab_size,), dtype=mx.int32)
        if has_t2d:
            self.t2d = mx.zeros((cfg.vocab_size,), dtype=mx.bool_)
        self.freeze(keys=["d2t", "t2d"] if has_t2d else ["d2t"], recurse=False)

    @property
    def layer(self) -> Layer:
        return self.layers[0]

    def sanitize(self, weights: dict) -> dict:
        """SpecForge's ``midlayer.*`` names; integer buffers as int32 / bool."""
        out = {}
        for k, v in weights.items():
            if k.startswith("midlayer."):
                k = "layers.0." + k[len("midlayer."):]
            if k == "d2t":
                v = v.astype(mx.int32)
            elif k == "t2d":
                v = v.astype(mx.bool_)
            out[k] = v
        return out

    def first_hidden(self, g):
        """h0 from the concatenated target states ``g [B, L, n * Ht]``."""
        if "input_norm" in self:
            g = self.input_norm(g)
        if "fc_norm" in self:
            parts = mx.split(g, len(self.fc_norm), axis=-1)
            g = mx.concatenate([norm(p) for norm, p in zip(self.fc_norm, parts)], axis=-1)
        return self.fc(g)

    def head(self, out):
        """Draft-vocabulary logits and the state fed back, from a layer output."""
        normed = self.norm(out)
        return self.lm_head(normed), (normed if self.cfg.norm_output else out)

    def to_target(self, draft_ids):
        return (draft_ids + self.d2t[draft_ids]).astype(mx.int32)
