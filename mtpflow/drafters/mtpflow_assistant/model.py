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


class _Ref:
    """Holds an object outside the module tree (not a parameter, not saved)."""

    def __init__(self, obj):
        self.obj = obj


def _target_layers(target):
    for path in ("inner", "model.model", "model"):
        obj = target
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
            layers = obj.layers
        except AttributeError:
            continue
        if isinstance(layers, list) and layers:
            return layers
    return None


def target_rope(target, layer_type: str, head_dim: int):
    """The target's RoPE module for ``layer_type`` (from its store layer), or
    one built from the target config with mlx-lm's ``initialize_rope``."""
    layers = _target_layers(target) if target is not None else None
    if layers is not None:
        idx = target.store_layers.get(layer_type)
        if idx is not None and idx < len(layers):
            layer = layers[idx]
            attn = getattr(layer, "self_attn", None) or getattr(layer, "attention", None)
            rope = getattr(attn, "rope", None)
            if rope is not None:
                return rope
    from mlx_lm.models.rope_utils import initialize_rope

    tc = dict((target.config if target is not None else {}) or {})
    tc = dict(tc.get("text_config") or tc)
    rp = (tc.get("rope_parameters") or {}).get(layer_type) or tc.get("rope_scaling")
    base = (rp or {}).get("rope_theta", tc.get("rope_theta", 10000.0))
    return initialize_rope(head_dim, base, False, rp, tc.get("max_position_embeddings", 4096))


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
        q = rope(q.transpose(0, 2, 1, 3), offset=offset)
        o = mx.fast.scaled_dot_product_attention(q, keys.astype(q.dtype), values.astype(q.dtype), scale=self.scale, mask=mask)
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


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
    ``post_projection`` and (``lm_head: own``) ``lm_head``.

    ``target`` supplies the RoPE modules and, for ``lm_head: target``, the
    LM head; it is referenced, never part of the parameter tree."""

    def __init__(self, config: dict, target=None):
        super().__init__()
        self._config = _Ref(dict(config))
        Dd, Dt = config["hidden_size"], config["backbone_hidden_size"]
        self.model = Body(config)
        self.pre_projection = nn.Linear(2 * Dt, Dd, bias=False)
        self.post_projection = nn.Linear(Dd, Dt, bias=False)
        # small start: h' (and, with the target head, the first logits) near zero
        self.post_projection.weight = self.post_projection.weight * 0.01
        self.head_kind = config.get("lm_head", "target")
        K = int(config.get("draft_vocab_size") or 0)
        if K:
            # EAGLE-3-style reduced draft vocabulary: drafts come from these ids only
            self.draft_vocab = mx.arange(K, dtype=mx.int32)
            self.freeze(keys=["draft_vocab"], recurse=False)
        if self.head_kind == "own":
            self.lm_head = nn.Linear(Dd, K or config["vocab_size"], bias=False)
        self.sliding_window = config.get("sliding_window")
        self.hidden_norm = config.get("hidden_norm") == "target"
        self.bind_target(target)

    @property
    def config(self) -> dict:
        return self._config.obj

    def bind_target(self, target) -> None:
        self._target = _Ref(target)
        ropes = {}
        for t in sorted(set(self.config["layer_types"])):
            ropes[t] = target_rope(target, t, self.config["attention"][t]["head_dim"])
        self._ropes = _Ref(ropes)

    @property
    def layer_types(self) -> list[str]:
        return list(self.config["layer_types"])

    def __call__(self, x_in: mx.array, kv: dict, masks: dict, offset):
        """``x_in`` ``[B, L, 2*Dt]``; ``kv`` ``{type: (K [B,KVH,S,hd], V)}``;
        ``masks`` ``{type: bool [B, 1, L, S]}``; ``offset``: RoPE position of
        query 0 (int or ``[B]``), query ``l`` is at ``offset + l``.
        Returns ``(head_input, h')``: what the LM head reads, and the
        projected state fed back as the next ``h`` (``[B, L, Dt]``)."""
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
        return (proj if self.head_kind == "target" else final), proj

    def step(self, x_in: mx.array, kv: dict, masks: dict, position: mx.array):
        """One inference step, the :class:`Gemma4AssistantModel` signature:
        ``x_in`` ``[B, 2*Dt]``, masks ``[B,1,1,S]``, ``position`` ``[B]``."""
        z, h = self(x_in[:, None, :], kv, masks, position)
        return z[:, 0], h[:, 0]

    @property
    def has_draft_vocab(self) -> bool:
        return "draft_vocab" in self

    def vocab_rows(self) -> mx.array:
        """The target's output-embedding rows of the draft vocabulary ``[K, Dt]``."""
        key = id(self.draft_vocab)
        cached = getattr(self, "_rows_cache", None)
        if cached is None or cached.obj[0] != key:
            rows = output_rows(self._target.obj, self.draft_vocab)
            self._rows_cache = _Ref((key, rows))
            return rows
        return cached.obj[1]

    def head_logits(self, z: mx.array) -> mx.array:
        """Logits over the full vocabulary, or over the draft vocabulary
        (``draft_vocab_size``; index ``k`` = token ``draft_vocab[k]``)."""
        if self.head_kind == "own":
            return self.lm_head(z)
        target = self._target.obj
        if not self.has_draft_vocab:
            return target.logits(z)
        out = z @ self.vocab_rows().astype(z.dtype).T
        cap = getattr(target, "softcap", None)
        return mx.tanh(out / cap) * cap if cap else out

    def head_argmax(self, z: mx.array) -> mx.array:
        best = mx.argmax(self.head_logits(z), axis=-1)
        if self.has_draft_vocab:
            best = self.draft_vocab[best]
        return best.astype(mx.int32)


def output_rows(target, ids: mx.array) -> mx.array:
    """Rows ``ids`` of the target's output (LM-head) matrix, ``[K, Dt]``
    (tied heads: the raw, unscaled input embedding; quantized ones dequantize)."""
    owner = getattr(target, "head_owner", None) or getattr(target, "model", None)
    inner = getattr(target, "inner", None) or getattr(getattr(target, "model", None), "model", None)
    lm_head = getattr(owner, "lm_head", None) if owner is not None else None
    tied = getattr(owner, "tie_word_embeddings", None)
    if tied is None:
        tied = getattr(getattr(owner, "args", None), "tie_word_embeddings", lm_head is None)
    if (tied or lm_head is None) and inner is not None:
        return inner.embed_tokens(ids)
    w = getattr(lm_head, "weight", None)
    if w is None or "scales" in lm_head:
        raise ValueError("draft_vocab_size needs an unquantized LM head on an untied target")
    return w[ids]
