"""The Gemma 4 assistant body: no KV cache of its own.

One drafting step (spec §4)::

    x = pre_projection(concat(target_embed(tok) * sqrt(Dt), h))
    for each layer: attention of a query at the constant RoPE position to the
        target's store-layer K/V of the layer's type, MLP, layer_scalar
    final = norm(x);  h' = post_projection(final);  token = head(final)
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gemma4_text import MLP, ModelArgs
from mlx_lm.models.rope_utils import initialize_rope

from ...targets.base import SLIDING, rope_at
from .config import AssistantConfig


class AssistantAttention(nn.Module):
    def __init__(self, args: ModelArgs, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        full = layer_type != SLIDING
        self.head_dim = args.global_head_dim if full and args.global_head_dim else args.head_dim
        self.n_heads = args.num_attention_heads
        dim = args.hidden_size
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        rp = args.rope_parameters.get(layer_type, {})
        self.rope = initialize_rope(
            dims=self.head_dim,
            traditional=False,
            base=rp.get("rope_theta", 10000.0),
            scaling_config=rp,
            max_position_embeddings=args.max_position_embeddings,
        )

    def __call__(self, x, keys, values, mask, position):
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim)).transpose(0, 2, 1, 3)
        q = rope_at(self.rope, q, position) if position.ndim == 2 else self.rope(q, offset=position)
        o = mx.fast.scaled_dot_product_attention(q, keys, values, scale=1.0, mask=mask)
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))


class AssistantLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = AssistantAttention(args, layer_type)
        self.mlp = MLP(args, 0)
        eps = args.rms_norm_eps
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=eps)
        self.pre_feedforward_layernorm = nn.RMSNorm(args.hidden_size, eps=eps)
        self.post_feedforward_layernorm = nn.RMSNorm(args.hidden_size, eps=eps)
        self.layer_scalar = mx.ones((1,))

    def __call__(self, x, keys, values, mask, position):
        h = self.self_attn(self.input_layernorm(x), keys, values, mask, position)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        x = x + self.post_feedforward_layernorm(h)
        return x * self.layer_scalar


class AssistantBody(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)  # the tied LM head only
        self.layers = [AssistantLayer(args, t) for t in args.layer_types]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Gemma4AssistantModel(nn.Module):
    """Weights load under the transformers / mlx-community names."""

    def __init__(self, config: AssistantConfig, head_cls):
        super().__init__()
        tc = dict(config.text)
        tc["use_double_wide_mlp"] = False
        self.args = ModelArgs.from_dict(tc)
        self.config = config
        self.sliding_window = tc.get("sliding_window")
        D, Dt = self.args.hidden_size, config.backbone_hidden_size
        self.model = AssistantBody(self.args)
        self.pre_projection = nn.Linear(2 * Dt, D, bias=False)
        self.post_projection = nn.Linear(D, Dt, bias=False)
        head = head_cls.from_config(config, self.args.vocab_size, D)
        if config.use_ordered_embeddings:
            self.masked_embedding = head
        else:
            self._dense_head = head

    @property
    def head(self):
        return self.masked_embedding if self.config.use_ordered_embeddings else self._dense_head

    @property
    def layer_types(self) -> list[str]:
        return list(self.args.layer_types)

    def sanitize(self, weights: dict) -> dict:
        out = {}
        for k, v in weights.items():
            if "rotary_emb" in k or k == "lm_head.weight":
                continue
            if k == "masked_embedding.token_ordering":
                v = v.astype(mx.int32)
            out[k] = v
        return out

    def step(self, x_in: mx.array, kv: dict, masks: dict, position: mx.array):
        """One drafting step for ``B`` rows.

        :param x_in: ``[B, 2*Dt]`` = ``concat(target_embed(tok) * sqrt(Dt), h)``.
        :param kv: ``{layer_type: (keys [B,KVH,S,hd], values)}``.
        :param masks: ``{layer_type: bool [B,1,1,S]}`` from :func:`.masks.drafter_mask`.
        :param position: ``[B]`` int32 RoPE position of the query.
        :return: ``(final [B, Dd], projected [B, Dt])``.
        """
        x = self.pre_projection(x_in[:, None, :])
        for layer in self.model.layers:
            k, v = kv[layer.layer_type]
            x = layer(x, k, v, masks[layer.layer_type], position)
        final = self.model.norm(x)[:, 0]
        return final, self.post_projection(final)

    def step_many(self, x_in: mx.array, kv: dict, masks: dict, positions: mx.array):
        """Drafting steps for ``F`` candidates per row at once (a tree's
        frontier): ``x_in`` ``[B, F, 2*Dt]``, ``positions`` ``[B, F]``; the
        candidates attend to the target's K/V only, never to each other."""
        x = self.pre_projection(x_in)
        for layer in self.model.layers:
            k, v = kv[layer.layer_type]
            x = layer(x, k, v, masks[layer.layer_type], positions)
        final = self.model.norm(x)
        return final, self.post_projection(final)

    def head_support(self, final: mx.array):
        return self.head.support(final, self.model.embed_tokens.weight)

    def head_argmax(self, final: mx.array) -> mx.array:
        return self.head.argmax(final, self.model.embed_tokens.weight)

    def head_logits(self, final: mx.array) -> mx.array:
        return self.head(final, self.model.embed_tokens.weight)
