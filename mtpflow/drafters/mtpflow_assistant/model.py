"""The generic assistant body (no KV cache of its own).

One drafting step, for ``L`` queries per row (``L = 1`` at inference; all
positions of a sequence at training time)::

    x = pre_projection(concat(target_embed(tok), h))        # [B, L, Dd]
    for each layer (type t):
        x = x + o_proj(attn(rope(q_norm?(q_proj(norm(x)))), K_t, V_t, mask_t))
        x = x + mlp(norm(x))                                   # SwiGLU
    final = norm(x);  h' = post_projection(final)              # [B, L, Dt]
    h' = target.final_norm(h')          (config "hidden_norm": "target")
    logits = target.logits(h')   (lm_head "target")  |  lm_head(final)  ("own")

``K_t, V_t`` are the target's store-layer K/V (already RoPE'd by the target);
the query is rotated by the target's own RoPE module for that layer type (so
llama3 / proportional / yarn scaling is identical by construction).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ...targets.base import Ref as _Ref
from ...targets.base import rope_at
from ..layers import MLP


class Attention(nn.Module):
    def __init__(self, dim: int, geo: dict, eps: float):
        super().__init__()
        self.n_heads = geo["num_attention_heads"]
        self.head_dim = geo["head_dim"]
        self.scale = float(geo["scale"])
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=False)
        if geo.get("q_norm"):
            self.q_norm = nn.RMSNorm(self.head_dim, eps=eps)

    def __call__(self, x, keys, values, mask, offset, rope):
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim)
        if "q_norm" in self:
            q = self.q_norm(q)
        q = q.transpose(0, 2, 1, 3)
        q = rope_at(rope, q, offset) if isinstance(offset, mx.array) and offset.ndim == 2 else rope(q, offset=offset)
        o = mx.fast.scaled_dot_product_attention(q, keys.astype(q.dtype), values.astype(q.dtype), scale=self.scale, mask=mask)
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))


class Layer(nn.Module):
    def __init__(self, cfg: dict, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        D, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.self_attn = Attention(D, cfg["attention"][layer_type], eps)
        self.mlp = MLP(D, cfg["intermediate_size"])
        self.input_layernorm = nn.RMSNorm(D, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(D, eps=eps)

    def __call__(self, x, keys, values, mask, offset, rope):
        x = x + self.self_attn(self.input_layernorm(x), keys, values, mask, offset, rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.layers = [Layer(cfg, t) for t in cfg["layer_types"]]
        self.norm = nn.RMSNorm(cfg["hidden_size"], eps=cfg["rms_norm_eps"])


class GenericAssistantModel(nn.Module):
    """Parameters: ``pre_projection``, ``model.layers.*``, ``model.norm``,
    ``post_projection`` and the LM head's own (``lm_head.*``: ``weight`` of
    the ``own`` head, ``draft_vocab`` of a draft vocabulary).

    ``target`` supplies the RoPE modules and, for the ``target`` heads, the
    LM head; it is referenced, never part of the parameter tree.  The head is
    a registered LM head (``head_cls``, default: the one the config names,
    :func:`.heads.head_name`); the model never branches on its kind."""

    def __init__(self, config: dict, target=None, head_cls=None):
        super().__init__()
        self._config = _Ref(dict(config))
        Dd, Dt = config["hidden_size"], config["backbone_hidden_size"]
        self.model = Body(config)
        self.pre_projection = nn.Linear(2 * Dt, Dd, bias=False)
        self.post_projection = nn.Linear(Dd, Dt, bias=False)
        # small start: h' (and, with the target head, the first logits) near zero
        self.post_projection.weight = self.post_projection.weight * 0.01
        if head_cls is None:
            from .heads import OwnHead, TargetHead, TargetSubsetHead, head_name

            head_cls = {"own": OwnHead, "target": TargetHead, "target_subset": TargetSubsetHead}[head_name(config)]
        width = Dd if getattr(head_cls, "input_space", "target") == "drafter" else Dt
        self.lm_head = head_cls.from_config(config, config["vocab_size"], width, target=target)
        self.sliding_window = config.get("sliding_window")
        self.hidden_norm = config.get("hidden_norm") == "target"
        self.bind_target(target)

    @property
    def config(self) -> dict:
        return self._config.obj

    def bind_target(self, target) -> None:
        self._target = _Ref(target)
        if hasattr(self.lm_head, "_target"):
            self.lm_head._target = _Ref(target)
        self._ropes = _Ref({} if target is None else {
            t: target.rope(t, self.config["attention"][t]["head_dim"]) for t in sorted(set(self.config["layer_types"]))
        })

    @property
    def layer_types(self) -> list[str]:
        return list(self.config["layer_types"])

    def __call__(self, x_in: mx.array, kv: dict, masks: dict, offset):
        """``x_in`` ``[B, L, 2*Dt]``; ``kv`` ``{type: (K [B,KVH,S,hd], V)}``;
        ``masks`` ``{type: bool [B, 1, L, S]}``; ``offset``: RoPE position of
        query 0 (int or ``[B]``), query ``l`` is at ``offset + l``.
        Returns ``(head_input, h')``: what the LM head reads (its
        ``input_space``), and the projected state fed back as the next ``h``
        (``[B, L, Dt]``)."""
        ropes = self._ropes.obj
        x = self.pre_projection(x_in)
        for layer in self.model.layers:
            k, v = kv[layer.layer_type]
            x = layer(x, k, v, masks[layer.layer_type], offset, ropes[layer.layer_type])
        final = self.model.norm(x)
        proj = self.post_projection(final)
        if self.hidden_norm:
            # h' through the target's own final norm: the fed-back state and the
            # head input live where the target's post-norm hidden state does
            proj = self._target.obj.final_norm(proj)
        return (final if getattr(self.lm_head, "input_space", "target") == "drafter" else proj), proj

    def step(self, x_in: mx.array, kv: dict, masks: dict, position: mx.array):
        """One inference step, the :class:`Gemma4AssistantModel` signature:
        ``x_in`` ``[B, 2*Dt]``, masks ``[B,1,1,S]``, ``position`` ``[B]``."""
        z, h = self(x_in[:, None, :], kv, masks, position)
        return z[:, 0], h[:, 0]

    def step_many(self, x_in: mx.array, kv: dict, masks: dict, positions: mx.array):
        """``F`` candidates per row at once (a tree's frontier): ``x_in``
        ``[B, F, 2*Dt]`` at ``positions`` ``[B, F]``; they attend to the
        target's K/V only, never to each other."""
        return self(x_in, kv, masks, positions)

    def head_support(self, z: mx.array):
        return self.lm_head.support(z)

    # -- the draft vocabulary lives in the head --------------------------------------
    @property
    def has_draft_vocab(self) -> bool:
        return "draft_vocab" in self.lm_head

    @property
    def draft_vocab(self) -> mx.array:
        return self.lm_head.draft_vocab

    def set_draft_vocab(self, ids: mx.array) -> None:
        """Replace the draft vocabulary (a method: ``nn.Module`` stores an array
        assigned to an attribute in its own dict, bypassing a property setter)."""
        self.lm_head.draft_vocab = ids

    def head_logits(self, z: mx.array) -> mx.array:
        """Logits over the head's vocabulary: the full one, or the draft
        vocabulary (index ``k`` = token ``draft_vocab[k]``)."""
        return self.lm_head.support(z)[1]

    def head_argmax(self, z: mx.array) -> mx.array:
        return self.lm_head.argmax(z)

    def sanitize(self, weights: dict) -> dict:
        """Checkpoints written before the heads were plugins keep the draft
        vocabulary at the top level."""
        if "draft_vocab" in weights:
            weights = dict(weights)
            weights["lm_head.draft_vocab"] = weights.pop("draft_vocab")
        return weights
