"""The ``native_mtp`` drafter kind: the MTP head shipped inside the target checkpoint.

Per round, with no host synchronisation of its own (as EAGLE-3's kind):

* the target's prefill and every verify expose the last decoder layer's
  output (``needs = {"layer:N"}``, N = the target's layer count); the kind
  applies the target's final norm, giving the post-norm hidden state ``h_p``
  the head was trained on;
* :meth:`NativeMTPDrafter.prefilled` runs MTP layer 0 over the whole prompt
  (pairs token ``x_{p+1}`` with ``h_p``, at position ``p + 1``), appending
  their K/V to the head's own cache (one
  :class:`~mtpflow.targets.cache.SlotKVCache` per layer, two for a sparse
  DSA layer; rows keyed by request) and keeping each row's last output: the
  next block's first draft is ``argmax(lm_head(out))``;
* :meth:`NativeMTPDrafter.propose` chains the rest: draft ``d_j`` with the
  previous output, through layer ``min(j, D - 1)`` (depth ``j + 1`` runs MTP
  layer ``j``; a block longer than the head reuses its *last* layer, the one
  trained on the deepest inputs -- vLLM cycles ``j mod D`` instead, which is
  the same for the usual ``D = 1``);
* :meth:`NativeMTPDrafter.commit` rolls the chain back: entries of rejected
  drafts go; with ``context = "verified"`` (default) layer 0's entries are
  re-made from the verified target hidden states for every accepted pair plus
  the bonus token, with ``"drafted"`` (mlx-vlm's choice) accepted chain
  entries stay and only the rest is computed; deeper layers keep their
  accepted chain entries (they have no target-side input).

Drafts are greedy (argmax); the rejection sampler verifies them with a
one-hot ``q``.  Trees are not drafted (chains only).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ...errors import IncompatibleDrafter, TargetError
from ...state import DraftBlock
from ...targets.base import cast_floats, read_config
from ...targets.recurrent import arange
from ..base import RowCaches
from .config import NativeMTPSettings, check_head
from .families import family_for, text_config


def load_head(src: Path, model, dtype: str | None, target_config: dict | None = None):
    """``(family, NativeMTP, config)`` from folder ``src`` (a target checkpoint
    or a trained module in the native layout) for mlx-lm ``model`` (whose
    embedding and LM head the head uses).  Reads only the head's tensors."""
    cfg = read_config(src)
    fam, D, files, names = check_head(cfg, src, target_config, "checkpoint" if target_config is None else "module")
    raw, meta = {}, {}
    for f in sorted(files):
        try:
            loaded, m = mx.load(str(Path(src) / f), return_metadata=True)
        except Exception as exc:
            raise TargetError(f"{Path(src) / f}: cannot read safetensors ({exc}); re-download it") from None
        raw.update({k: loaded[k] for k in names if k in loaded})
        meta.update(m or {})
    # a family whose conversions depend on who wrote the file (Qwen's zero-centred norms) reads its metadata
    weights = fam.to_module(raw, cfg, model, metadata=meta) if getattr(fam, "reads_metadata", False) else fam.to_module(raw, cfg, model)
    head = fam.build(model, cfg, D)
    if any(k.endswith(".scales") for k in weights):
        q = cfg.get("quantization") or cfg.get("quantization_config") or {}
        n = text_config(cfg)["num_hidden_layers"]

        def quantized(p, m):
            # mlx-lm's mixed quantization names per-layer settings by checkpoint path
            if f"{p}.scales" not in weights:
                return False
            i, _, rest = p[len("layers."):].partition(".")
            own = q.get(f"model.layers.{n + int(i)}.{rest.removeprefix('block.')}")
            return own if isinstance(own, dict) else True

        nn.quantize(head, group_size=q.get("group_size", 64), bits=q.get("bits", 4), mode=q.get("mode", "affine"),
                    class_predicate=quantized)
    else:
        weights = cast_floats(weights, dtype or "float32")
    try:
        head.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise IncompatibleDrafter(
            f"{src}: the MTP head's tensors do not match the {text_config(cfg).get('model_type')} layer built from "
            f"config.json ({exc}); the module was made for another target"
        ) from None
    if dtype and not any(k.endswith(".scales") for k in weights):
        head.set_dtype(getattr(mx, dtype))
    mx.eval(head.parameters())
    return fam, head, cfg


class NativeMTPDrafter:
    kind = "native_mtp"
    model_types = ()  # recognised by matches(): a module's config is its target's (model_type included)
    needs = frozenset()  # an instance needs the target's last layer output
    settings = NativeMTPSettings
    #: a request for these kinds without a drafter checkpoint runs this one when
    #: the target checkpoint carries an MTP head (see ``in_target``)
    aliases = ("mtp",)
    #: pick this kind by itself when the target carries a head and no drafter is given
    auto_detect = True
    label = "native MTP head"
    #: ``mtpflow train --kind mtp`` (mtpflow.api.TrainableDrafter)
    train_kind, trainer = "mtp", "mtpflow.drafters.native_mtp.train:MTPTrainer"

    def __init__(self, family, head, cfg: dict, target, settings: NativeMTPSettings | None = None):
        self.family, self.model, self.cfg, self.target = family, head, cfg, target
        self.settings_ = settings or NativeMTPSettings()
        self.depth = head.depth
        self.n_layers = len(target.decoder_layers)
        self.needs = frozenset({f"layer:{self.n_layers}"})
        self.per_layer = family.caches_per_layer
        self.label = f"native MTP head (depth {self.depth}, {cfg.get('model_type')})"
        self.reset()

    def reset(self) -> None:
        self.rows = RowCaches()
        self.chain: list[list[int]] = [[] for _ in range(self.depth)]  # per layer: the depths j of its chain slots

    # -- the checkpoint -------------------------------------------------------------------
    @classmethod
    def in_target(cls, target_config: dict, target_path=None) -> bool:
        """Whether the target checkpoint carries an MTP head this kind runs
        (config.json and safetensors headers only)."""
        if target_path is None:
            return False
        try:
            check_head(target_config, Path(target_path))
        except (TargetError, OSError):
            return False
        return True

    @classmethod
    def check_target(cls, target_config: dict, target_path) -> None:
        """Raise a one-line error when the target carries no usable head."""
        check_head(target_config, Path(target_path))

    @classmethod
    def matches(cls, config: dict) -> bool:
        return family_for(config) is not None and bool(text_config(config).get("num_nextn_predict_layers"))

    @classmethod
    def check(cls, target_config: dict, drafter_config: dict, drafter_path=None):
        check_head(drafter_config, Path(drafter_path), target_config, "module")

    @classmethod
    def recommended_block_size(cls, config: dict, path=None) -> int | None:
        fam = family_for(config)
        return fam.depth(config) + 1 if fam is not None and fam.depth(config) > 1 else None

    @classmethod
    def load(cls, path, target, options) -> "NativeMTPDrafter":
        src = Path(path) if path is not None else Path(target.path)
        fam, head, cfg = load_head(src, target.model, options.dtype, target.config if path is not None else None)
        return cls(fam, head, cfg, target, getattr(options, "settings", None))

    # -- pieces of a step -----------------------------------------------------------------
    def _caches(self, li: int) -> list:
        return self.rows.caches[li * self.per_layer : (li + 1) * self.per_layer]

    @property
    def last_out(self):
        return self.rows.extras["last_out"]

    def _run(self, li: int, tokens, h, positions, caches=None, dense: bool | None = None):
        """MTP layer ``li`` over pairs (``tokens [B, L]``, states ``h [B, L, H]``)
        at ``positions [B, L]`` (``-1``: no pair): appends their K/V to the
        layer's caches, returns the outputs ``[B, L, H]``.  ``dense`` (default:
        the row caches'): one row whose cached and new positions follow one
        another with no gap slot -- the block then gets mlx-lm's ``None`` /
        ``"causal"`` mask (where its family takes them) and the caches' own
        positions (``offset + i``, the same numbers)."""
        caches = caches if caches is not None else self._caches(li)
        B, L = positions.shape
        c0 = caches[0]
        if (self.rows.dense if dense is None else dense) and self.family.plain_masks:
            start = positions[:, 0]
            for c in caches:
                c.offset = start
            mask = None if L == 1 else "causal"
            return self.model.layers[li](self.target.embed(tokens), h, mask, self.family.block_cache(caches))
        rel = arange(L)[None]
        start = mx.max(mx.where(positions >= 0, positions - rel, -(2**30)), axis=1)
        old = c0.positions[:, : c0.idx] if c0.idx else mx.zeros((B, 0), mx.int32)
        kv = mx.concatenate([old, positions], axis=1)
        mask = (kv[:, None, :] >= 0) & (kv[:, None, :] <= positions[:, :, None])
        own = arange(c0.idx + L)[None, :] == (c0.idx + arange(L))[:, None]  # no empty softmax row
        mask = (mask | own[None])[:, None]
        for c in caches:
            c.offset = start
        out = self.model.layers[li](self.target.embed(tokens), h, mask, self.family.block_cache(caches))
        for c in caches:
            c.positions[:, c.idx - L : c.idx] = positions
        return out

    def _hidden(self, state):
        return self.target.final_norm(state.taps[self.n_layers])

    def _pairs(self, state):
        """Context pairs of the last forward: tokens ``x_{p+1}`` and positions ``p + 1``."""
        tokens = mx.concatenate([state.fwd_tokens[:, 1:], state.last_tokens[:, None]], axis=1)
        pos = state.fwd_positions
        return tokens, mx.where(pos >= 0, pos + 1, -1)

    # -- the engine's calls ---------------------------------------------------------------
    def prefilled(self, session, state) -> None:
        """New rows: layer 0 over their whole prompts."""
        tokens, positions = self._pairs(state)
        caches = [c for _ in range(self.depth) for c in self.family.make_caches()]
        dense = state.size == 1  # one prompt: no left padding
        out = self._run(0, tokens, self._hidden(state), positions, caches[: self.per_layer], dense=dense)
        last = out[:, -1]
        mx.async_eval([c.keys for c in caches[: self.per_layer]], last)
        self.rows.add([r.request for r in state.rows], caches, {"last_out": last}, dense=dense)

    def _drop_chain(self, counts=None) -> None:
        """Drop the last proposal's chain slots; with host-side accepted
        ``counts``, keep those of accepted drafts where the layer keeps them."""
        keep_l0 = self.settings_.context == "drafted"
        for li, js in enumerate(self.chain):
            if not js:
                continue
            n = len(js)
            kept = [0] * (1 if counts is None else len(counts))
            if counts is not None and (li > 0 or keep_l0):
                kept = [sum(1 for j in js if j <= a) for a in counts]
            for c in self._caches(li):
                if max(kept):
                    keep = mx.array(kept, dtype=mx.int32)[:, None]
                    tail = c.positions[:, c.idx - n : c.idx]
                    c.positions[:, c.idx - n : c.idx] = mx.where(arange(n)[None] < keep, tail, -1)
                c.idx -= n - max(kept)
            self.chain[li] = []

    def commit(self, session, state, accepted) -> None:
        """After a verify: roll the chain back, take in the accepted pairs."""
        counts_host = list(accepted.counts)
        live = [r.request for r in state.rows]
        if self.rows.pending or len(live) != len(self.rows.requests) or any(a is not b for a, b in zip(live, self.rows.requests)):
            self._drop_chain()  # rows changed since the proposal: keep nothing of it
            counts_host = None
        else:
            self._drop_chain(counts_host)
        self.rows.sync(state.rows)
        c = accepted.counts
        # pairs past every row's accepted count + 1 are no pair in any row: left out
        k1 = min(state.fwd_tokens.shape[1], max(c) + 1)
        hidden = self._hidden(state)[:, :k1]
        drafted = counts_host is not None and self.settings_.context == "drafted" and self._last_chain0
        if min(c) == max(c) and not drafted:
            # every row takes the same pairs (one row always): static slices, the last pair the bonus token's
            tokens = mx.concatenate([state.fwd_tokens[:, 1:k1], state.last_tokens[:, None]], axis=1)
            pos = state.fwd_positions[:, :k1]
            out = self._run(0, tokens, hidden, pos + 1 if self.rows.dense else mx.where(pos >= 0, pos + 1, -1))
            self.rows.extras["last_out"] = out[:, k1 - 1]
        else:
            counts = mx.array(c, dtype=mx.int32)
            rel = arange(k1)[None]
            tokens, positions = self._pairs(state)
            tokens, positions = tokens[:, :k1], positions[:, :k1]
            tokens = mx.where(rel == counts[:, None], state.last_tokens[:, None], tokens)
            if drafted:
                # pairs whose chain entry stayed in layer 0's cache: pair i holds draft j = i + 1
                kept = mx.array([[j for j in self._last_chain0]], dtype=mx.int32)  # [1, n0]
                have = ((rel[:, :, None] + 1) == kept[:, None, :]).any(axis=-1) & (rel < counts[:, None])
                positions = mx.where(have, -1, positions)
                self.rows.dense = False  # those pairs leave holes
            out = self._run(0, tokens, hidden, positions)
            self.rows.extras["last_out"] = mx.take_along_axis(out, counts[:, None, None], axis=1)[:, 0]
        rows = [r.position for r in state.rows]
        used = [c.idx for c in self.rows.caches]
        session.target.compact(self.rows.caches, n_valid_max=max(rows), min_positions=rows)
        if used != [c.idx for c in self.rows.caches]:
            self.rows.dense = False  # compacted: empty slots may lead
        mx.async_eval([c.keys for c in self.rows.caches], self.last_out)
        self._last_chain0 = []

    _last_chain0: list = []

    def propose(self, session, state, shared, n_draft: int) -> DraftBlock:
        B = state.size
        if n_draft <= 0:
            return DraftBlock(tokens=mx.zeros((B, 0), mx.int32), n_draft=0)
        self._drop_chain()
        self.rows.sync(state.rows)
        logits = self.target.logits(self.last_out)
        tok = mx.argmax(logits, axis=-1).astype(mx.int32)
        out, h = [tok], self.last_out
        anchor = state.positions[:, None]  # the bonus token's position
        for j in range(1, n_draft):
            li = min(j, self.depth - 1)
            h = self._run(li, tok[:, None], h[:, None], anchor + j)[:, 0]
            self.chain[li].append(j)
            tok = mx.argmax(self.target.logits(h), axis=-1).astype(mx.int32)
            out.append(tok)
        self._last_chain0 = list(self.chain[0])
        return DraftBlock(tokens=mx.stack(out, axis=1), n_draft=n_draft)
