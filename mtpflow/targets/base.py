"""What every target adapter provides to the round stages.

A target adapter wraps an mlx-lm model and exposes, for any batch of rows at
their own positions:

* ``forward(tokens, cache)`` -> post-norm final hidden state of every position;
* ``logits(hidden)`` -> the model's output logits (softcapping included);
* ``embed(tokens)`` -> the model's *scaled* input embedding;
* ``embed_table`` -> the input embedding module, unscaled (for drafters that
  read the target's table);
* ``shared_kv(cache)`` -> the store layers' K/V per attention type, with
  slot positions (:class:`mtpflow.state.KVView`);
* ``make_cache(batch_size, extra)`` -> a list of :class:`SlotKVCache`, whose
  sliding layers retain ``extra`` positions beyond the window so that
  rollback and drafter hand-over are always exact.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..errors import TargetError  # noqa: F401  (re-exported)
from ..state import KVView
from .cache import SlotKVCache

FULL = "full_attention"
SLIDING = "sliding_attention"


def read_config(path: Path) -> dict:
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        raise TargetError(f"{path}: no config.json; pass a Hugging Face model folder or repo id")
    try:
        return json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise TargetError(f"{cfg_path}: not valid JSON ({exc}); re-download the checkpoint") from None


def load_safetensors(path: Path, what: str = "checkpoint") -> dict:
    """All ``*.safetensors`` tensors of a folder, with one-line errors."""
    import glob

    import mlx.core as mx

    files = sorted(glob.glob(str(Path(path) / "*.safetensors")))
    if not files:
        raise TargetError(f"{path}: no *.safetensors weights; download the full {what}")
    weights = {}
    for f in files:
        try:
            weights.update(mx.load(f))
        except Exception as exc:
            raise TargetError(f"{f}: cannot read safetensors ({exc}); the file is corrupt or truncated, re-download it") from None
    return weights


def cast_floats(weights: dict, dtype: str | None) -> dict:
    """Cast floating-point tensors to ``dtype`` (integer buffers stay as they are)."""
    import mlx.core as mx

    if not dtype:
        return weights
    dt = getattr(mx, dtype)
    return {k: (v.astype(dt) if mx.issubdtype(v.dtype, mx.floating) else v) for k, v in weights.items()}


def read_eos_ids(path: Path, config: dict) -> set[int]:
    """EOS ids from generation_config.json, falling back to config.json."""
    ids: set[int] = set()
    for src in (Path(path) / "generation_config.json",):
        if src.is_file():
            try:
                v = json.loads(src.read_text()).get("eos_token_id")
            except json.JSONDecodeError:
                v = None
            if v is not None:
                ids.update(v if isinstance(v, list) else [v])
    if not ids:
        v = config.get("eos_token_id", config.get("text_config", {}).get("eos_token_id"))
        if v is not None:
            ids.update(v if isinstance(v, list) else [v])
    return {int(i) for i in ids}



def _softcap_ops(logits: mx.array, cap: mx.array) -> mx.array:
    """``tanh(logits / cap) * cap``."""
    return mx.tanh(logits / cap) * cap


#: the same as one fused op (mlx-lm compiles it too)
_softcap = mx.compile(_softcap_ops, shapeless=True)


class Ref:
    """Holds an object outside an ``nn.Module``'s tree (not a parameter, not saved)."""

    def __init__(self, obj):
        self.obj = obj


def rope_at(rope, x, positions):
    """RoPE of ``x [B, h, L, d]`` at per-row, per-query ``positions [B, L]``
    (MLX's fast RoPE takes one offset per batch row: rows and queries are
    folded into the batch, each at its own offset)."""
    B, h, L, d = x.shape
    flat = x.transpose(0, 2, 1, 3).reshape(B * L, h, 1, d)
    out = rope(flat, offset=positions.reshape(B * L))
    return out.reshape(B, L, h, d).transpose(0, 2, 1, 3)


class TreeRope:
    """Stands in for an attention layer's RoPE during a tree verify: every
    query / key at its node's own position (root + depth), whatever offset
    the model code passes."""

    def __init__(self, rope, positions):
        self._rope, self._positions = rope, positions

    def __call__(self, x, offset=0):
        return rope_at(self._rope, x, self._positions)

    def __getattr__(self, name):
        return getattr(self._rope, name)


class _Tap:
    """Stands in for one decoder layer during a forward: records the residual
    stream entering it (and, for the last layer, what leaves it), and with
    ``submit`` starts computing what leaves it (``mx.async_eval``) before the
    next layer's graph is built."""

    def __init__(self, layer, index: int, store: dict, want: set, n_layers: int, submit: bool = False):
        self._layer, self._index, self._store, self._want, self._n = layer, index, store, want, n_layers
        self._submit = submit

    def __call__(self, x, *args, **kwargs):
        if self._index in self._want:
            self._store[self._index] = x
        out = self._layer(x, *args, **kwargs)
        h = out[0] if isinstance(out, tuple) else out
        if self._index == self._n - 1 and self._n in self._want:
            self._store[self._n] = h
        if self._submit:
            mx.async_eval(h)
        return out

    def __getattr__(self, name):
        return getattr(self._layer, name)


class TargetAdapter:
    """Base class; subclasses set the attributes below in ``__init__``.

    ``inner`` is the decoder body (embedding, layers, final norm) of the
    mlx-lm model; ``lm_head_module`` the untied output projection (``None``
    when the head is the tied embedding); ``softcap`` the final logit
    softcapping (``None``: none).
    """

    model_types: tuple[str, ...] = ()
    hidden_size: int
    vocab_size: int
    sliding_window: int | None
    layer_types: list[str]
    store_layers: dict[str, int]
    config: dict
    eos_ids: set[int]
    path: Path
    model: Any
    inner: Any
    softcap: float | None = None
    #: the target can verify a tree of drafts in one forward (a recurrent layer cannot)
    supports_trees: bool = True
    #: the prefix cache may store and reuse this target's cache
    supports_prefix_cache: bool = True

    # subclasses implement
    def forward(self, tokens: mx.array, cache: list) -> mx.array:  # pragma: no cover
        raise NotImplementedError

    def embed(self, tokens: mx.array) -> mx.array:  # pragma: no cover
        raise NotImplementedError

    @property
    def lm_head_module(self):  # pragma: no cover
        raise NotImplementedError

    # shared by every architecture
    def softcapped(self, logits: mx.array) -> mx.array:
        """``logits`` through the target's final softcapping (if any)."""
        cap = self.softcap
        if not cap:
            return logits
        c = getattr(self, "_cap_array", None)  # one constant, not one per call
        if c is None or c[0] != cap or c[1] != logits.dtype:
            from ..backend.profiles import tuning_on  # fused into one node, or three ops (the device's profile)

            fn = _softcap if tuning_on("compile_elementwise") else _softcap_ops
            c = self._cap_array = (cap, logits.dtype, mx.array(cap, dtype=logits.dtype), fn)
        return c[3](logits, c[2])

    def raw_logits(self, hidden: mx.array) -> mx.array:
        """The LM head's output before any softcapping."""
        head = self.lm_head_module
        return head(hidden) if head is not None else self.inner.embed_tokens.as_linear(hidden)

    def logits(self, hidden: mx.array) -> mx.array:
        """The target's output logits from post-norm hidden states (softcapping included)."""
        return self.softcapped(self.raw_logits(hidden))

    def output_rows(self, ids: mx.array) -> mx.array:
        """Rows ``ids`` of the output (LM-head) matrix, ``[K, D]`` (a tied head:
        the raw, unscaled input embedding; quantized ones dequantize)."""
        head = self.lm_head_module
        if head is None:
            return self.inner.embed_tokens(ids)
        if "scales" in head:  # a quantized head: its rows, dequantized
            biases = head["biases"][ids] if "biases" in head else None
            return mx.dequantize(head.weight[ids], head.scales[ids], biases, group_size=head.group_size, bits=head.bits)
        return head.weight[ids]

    @property
    def embed_table(self):
        """The input embedding module (unscaled: a drafter that reads the
        target's table applies its own scaling)."""
        return self.inner.embed_tokens

    def final_norm(self, x: mx.array) -> mx.array:
        """The target's final norm (what turns its last residual stream into
        the post-norm hidden state ``forward`` returns)."""
        return self.inner.norm(x)

    @property
    def decoder_layers(self) -> list:
        return list(self.inner.layers)

    def rope(self, layer_type: str, head_dim: int):
        """The RoPE module of the target's store layer of ``layer_type`` (or
        one built from its config with mlx-lm's ``initialize_rope``)."""
        idx = self.store_layers.get(layer_type)
        layers = self.decoder_layers
        if idx is not None and idx < len(layers):
            attn = getattr(layers[idx], "self_attn", None)
            rope = getattr(attn, "rope", None)
            if rope is not None:
                return rope
        from mlx_lm.models.rope_utils import initialize_rope

        tc = dict(self.config.get("text_config") or self.config)
        rp = (tc.get("rope_parameters") or {}).get(layer_type) or tc.get("rope_scaling")
        base = (rp or {}).get("rope_theta", tc.get("rope_theta", 10000.0))
        return initialize_rope(head_dim, base, False, rp, tc.get("max_position_embeddings", 4096))

    @property
    def cache_layer_types(self) -> list[str]:
        """Attention type of every layer that owns a cache."""
        return list(self.layer_types)

    def make_cache(self, extra: int = 16) -> list[SlotKVCache]:
        out = []
        for t in self.cache_layer_types:
            if t == SLIDING and self.sliding_window:
                out.append(SlotKVCache(window=self.sliding_window, retain=self.sliding_window + 1 + extra))
            else:
                out.append(SlotKVCache())
        return out

    def forward_with_taps(self, tokens: mx.array, cache: list, layers=(), submit: bool = False, **kw):
        """:meth:`forward`, and the hidden states of the target ``layers``:
        ``{l: [B, L, D]}``, the residual stream entering decoder layer ``l``
        (vLLM's / EAGLE-3's convention; ``l = num_layers``: the last layer's
        output before the final norm).  No extra host synchronisation: the
        taps are lazy arrays of the same graph.  ``kw`` goes to :meth:`forward` (e.g. a
        multimodal adapter's precomputed input embeddings).

        ``submit``: start computing each decoder layer's output
        (``mx.async_eval``) as soon as its graph is built, so the layers'
        compute overlaps the building of the rest of the graph.  On a CPU
        stream ``async_eval`` returns only when the last few ops of what it
        was given are in flight, so this is the only way building and compute
        overlap there; the values are the same.  Never inside ``mx.compile``
        or a gradient transform (``async_eval`` refuses tracers)."""
        if not layers and not (submit and hasattr(self.inner, "layers")):
            return self.forward(tokens, cache, **kw), {}
        inner = self.inner
        orig = list(inner.layers)
        n = len(orig)
        want = set(layers)
        store: dict = {}
        # the last layer is left to the caller's async_eval (the final norm and the head follow it)
        inner.layers = [
            _Tap(layer, i, store, want, n, submit and i < n - 1) if (submit or i in want or i == n - 1) else layer
            for i, layer in enumerate(orig)
        ]
        try:
            hidden = self.forward(tokens, cache, **kw)
        finally:
            inner.layers = orig
        return hidden, {lid: store[lid] for lid in layers}

    def forward_tree(self, tokens: mx.array, cache: list, positions: mx.array, visible: mx.array, layers=(),
                     submit: bool = False):
        """One forward over a tree of candidates ``tokens [B, N]`` (node 0:
        the root), node ``i`` at ``positions[:, i]`` (root + depth) seeing the
        cache and, among the nodes, only those with ``visible[:, i, j]`` (its
        ancestors and itself).  ``visible`` may be ``[B, N, T + N]``: its first
        ``T`` columns are the cache's last ``T`` slots, nodes of the same tree
        an earlier call appended (a draft model growing a tree level by
        level); the slots before them are seen by position.  Returns what
        :meth:`forward_with_taps` does (``submit``: as there)."""
        attns = [getattr(layer, "self_attn", None) for layer in self.decoder_layers]
        saved = [(a, a.rope) for a in attns if a is not None and getattr(a, "rope", None) is not None]
        for a, rope in saved:
            a.rope = TreeRope(rope, positions)
        try:
            for c in cache:
                c._tree = (positions, visible)
            return self.forward_with_taps(tokens, cache, layers, submit=submit)
        finally:
            for c in cache:
                c._tree = None
            for a, rope in saved:
                a.rope = rope

    def prefill(self, seqs: list[list[int]], extra: int = 16, step: int = 512, pad_id: int = 0, taps=(), media=None):
        """A fresh cache holding ``seqs`` (left padded: padding has negative
        positions), filled ``step`` tokens at a time (the cache is compacted
        between chunks, so a long prompt never holds more than one chunk of
        sliding-window slack).  Returns ``(cache, last_hidden [B, D])``, the
        post-norm hidden state at every row's last token -- and, with
        ``taps`` (layer ids), a third item: ``{l: [B, L, D]}`` over every
        (padded) prompt position, see :meth:`forward_with_taps`.  ``media``:
        per prompt, its images / audio (``None``: text); a text-only target
        refuses them, a multimodal adapter overrides this method."""
        if media is not None and any(m is not None for m in media):
            raise TargetError(f"{self.path}: this target takes text only (no vision or audio tower); drop the images / audio")
        lens = [len(p) for p in seqs]
        if min(lens) < 1:
            raise ValueError("every prompt needs at least one token")
        L = max(lens)
        tokens = mx.array([[pad_id] * (L - n) + list(p) for p, n in zip(seqs, lens)], dtype=mx.int32)
        cache = self.make_cache(extra=extra)
        starts = mx.array([n - L for n in lens], dtype=mx.int32)
        for c in cache:
            c.dense = min(lens) == L  # no left padding
        chunks: dict = {lid: [] for lid in taps}
        last = L - 1 if self.prefill_last_alone and L > 1 else L  # where the lone last token starts
        for s, e in self.prefill_chunks(L, step):
            # every chunk sets its rows' positions (a cache that does not advance them itself,
            # e.g. a recurrent layer's, masks a left-padded row's steps by them)
            self.set_offsets(cache, starts + s if s else starts)
            hidden, got = self.forward_with_taps(tokens[:, s:e], cache, taps)
            for lid, h in got.items():
                chunks[lid].append(h)
            if e < last:  # between chunks of the prompt (the lone last token follows lazily)
                mx.eval([c.state for c in cache] + [h for hs in chunks.values() for h in hs])
                self.compact(cache, n_valid_max=L, min_positions=[n - L + e for n in lens])
        if not taps:
            return cache, hidden[:, -1]
        return cache, hidden[:, -1], {lid: mx.concatenate(hs, axis=1) if len(hs) > 1 else hs[0] for lid, hs in chunks.items()}

    def extend(self, cache: list, tokens: list[int], start: int, step: int = 512):
        """Continue a one-row ``cache`` holding positions ``< start`` with
        ``tokens`` at ``start ..``, ``step`` at a time; returns the post-norm
        hidden state at the last token ``[1, D]``."""
        ids = mx.array([list(tokens)], dtype=mx.int32)
        self.set_offsets(cache, mx.array([start], dtype=mx.int32))
        n = len(tokens)
        for s, e in self.prefill_chunks(n, step):
            hidden = self.forward(ids[:, s:e], cache)
            if e < (n - 1 if self.prefill_last_alone and n > 1 else n):
                mx.eval([c.state for c in cache])
        return hidden[:, -1]

    #: the prompt's last token runs as a forward of its own (see :meth:`prefill_chunks`)
    prefill_last_alone: bool = True

    def prefill_chunks(self, L: int, step: int) -> list[tuple[int, int]]:
        """The ``(start, end)`` token ranges a prefill of ``L`` tokens runs, ``step``
        at a time, as mlx-lm's generate loop does: the prompt but its last token in
        chunks, then the last token alone, so the first sampled token comes from a
        one-token forward like every later one (on a GPU the same attention kernel:
        a one-query step and a multi-query forward run different ones)."""
        cut = L - 1 if self.prefill_last_alone and L > 1 else L
        out = [(s, min(s + step, cut)) for s in range(0, cut, step)]
        return out + [(cut, L)] if cut < L else out

    def set_offsets(self, cache: list[SlotKVCache], offsets: mx.array) -> None:
        for c in cache:
            c.offset = offsets

    def shared_kv(self, cache: list[SlotKVCache]) -> dict[str, KVView]:
        out = {}
        for t, idx in self.store_layers.items():
            k, v, p = cache[idx].view()
            out[t] = KVView(keys=k, values=v, positions=p)
        return out

    def compact(self, cache: list[SlotKVCache], n_valid_max: int, min_positions: list[int]) -> None:
        """Bound cache growth: sliding layers drop slots older than ``retain``,
        full layers squeeze out holes left by rejected drafts."""
        pos = None
        for c in cache:
            if not _compact_due(c, n_valid_max):
                continue
            if c.window is not None:
                if pos is None:
                    pos = mx.array(min_positions, dtype=mx.int32)
                c.compact(min(c.retain, c.idx), pos - c.retain)
            else:
                c.compact(n_valid_max)

    def compact_due(self, cache: list[SlotKVCache], n_valid_max: int) -> bool:
        """Whether :meth:`compact` would rewrite a cache now (a round that leaves
        it alone, because it built the next round early, asks first)."""
        return any(_compact_due(c, n_valid_max) for c in cache)


def _compact_due(c: SlotKVCache, n_valid_max: int) -> bool:
    """A sliding layer holds a quarter step past what it retains; a full layer
    holds more than ``max(64, a quarter)`` empty slots."""
    if c.window is not None:
        return c.idx > c.retain + c.step // 4
    return c.idx - n_valid_max > max(64, c.idx // 4)
