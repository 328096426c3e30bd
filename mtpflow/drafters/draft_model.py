"""The ``model`` drafter kind: a smaller model with the target's tokenizer.

``--draft-kind model --draft-model PATH`` loads ``PATH`` with the target
adapter registered for its ``model_type`` and drafts autoregressively with
its own :class:`~mtpflow.targets.cache.SlotKVCache` (per-row positions).

One :meth:`DraftModelDrafter.propose` per round, for the whole batch, with no
host synchronisation inside; it

1. relies on :meth:`DraftModelDrafter.commit`, called by the engine after
   acceptance, which keeps each row's accepted proposals in the draft cache,
   invalidates the rejected ones and trims trailing slots rejected by every
   row -- the drafter's own rollback;
2. follows batch changes keyed by ``request.id``: rows that left are selected
   out of the cache, rows that joined are prefilled (left padding, negative
   positions) in a fresh cache that is merged in;
3. runs one *catch-up* forward over the tokens each row emitted since the
   draft cache last saw it (usually the bonus token alone, two tokens when
   every proposal was accepted; rows of different lengths are right-padded,
   the padding slots are invalidated afterwards) and then ``n_draft - 1``
   single-token forwards, all lazily: ``n_draft`` small forwards per round.

Drafts are chosen by argmax (``DraftBlock.probs`` is ``None``: the rejection
sampler verifies them with a one-hot ``q``, which keeps sampling lossless).

:meth:`DraftModelDrafter.propose_tree` drafts a tree instead: after the same
catch-up, one forward per depth over the whole frontier (the adapter's
``forward_tree``, each node seeing the context and its own ancestors' slots);
:meth:`~DraftModelDrafter.commit` then drops every tree slot, and the next
catch-up reads the accepted path with the bonus token.

A hybrid draft model (recurrent layers: Gated DeltaNet, Mamba2) drafts
chains only: its recurrent caches keep their state after the catch-up and
after every draft step, and :meth:`~DraftModelDrafter.commit` gives each row
the state after its own accepted drafts (a ragged catch-up keeps each row's
state after its own tokens), as its slot caches keep their accepted slots.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from ..api import target_supports
from ..state import DraftBlock
from ..targets.base import read_config
from .base import IncompatibleDrafter, TreeBuilder, tree_visibility_step
from ..targets.cache import merge_caches
from ..targets.recurrent import RecurrentCache

PAD_ID = 0


class DraftModelError(IncompatibleDrafter):
    """The draft model cannot draft for this target."""


# --------------------------------------------------------------------------------------
# compatibility checks
# --------------------------------------------------------------------------------------
def _vocab_size(config: dict) -> int | None:
    v = config.get("vocab_size")
    if v is None:
        v = (config.get("text_config") or {}).get("vocab_size")
    return v


def check_vocab(target_config: dict, drafter_config: dict) -> None:
    tv, dv = _vocab_size(target_config), _vocab_size(drafter_config)
    if tv is None or dv is None:
        raise DraftModelError("draft model or target config.json has no vocab_size; cannot check that they share a vocabulary")
    if tv != dv:
        raise DraftModelError(
            f"the draft model's vocab_size ({dv}) differs from the target's ({tv}); "
            "a draft model must share the target's tokenizer and vocabulary"
        )


def tokenizer_vocab(path: Path) -> dict[str, int] | None:
    """``token -> id`` of ``path/tokenizer.json`` (model vocab + added tokens),
    or ``None`` when the folder has no tokenizer.json."""
    f = Path(path) / "tokenizer.json"
    if not f.is_file():
        return None
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DraftModelError(f"{f}: not valid JSON ({exc})") from None
    vocab = (data.get("model") or {}).get("vocab")
    out: dict[str, int] = {}
    if isinstance(vocab, dict):  # BPE / WordPiece / WordLevel
        out.update({str(k): int(v) for k, v in vocab.items()})
    elif isinstance(vocab, list):  # Unigram: [[piece, score], ...]
        out.update({str(p[0] if isinstance(p, (list, tuple)) else p): i for i, p in enumerate(vocab)})
    for t in data.get("added_tokens") or []:
        out[str(t["content"])] = int(t["id"])
    return out


def check_tokenizers(target_path: Path, drafter_path: Path) -> None:
    """If both folders ship tokenizer.json, their vocabularies must be identical."""
    tv, dv = tokenizer_vocab(target_path), tokenizer_vocab(drafter_path)
    if tv is None or dv is None or tv == dv:
        return
    tf, df = Path(target_path) / "tokenizer.json", Path(drafter_path) / "tokenizer.json"
    only_d = sorted(set(dv) - set(tv))
    only_t = sorted(set(tv) - set(dv))
    moved = sorted(t for t in set(tv) & set(dv) if tv[t] != dv[t])
    detail = []
    if moved:
        t = moved[0]
        detail.append(f"token {t!r} has id {dv[t]} in the draft model but {tv[t]} in the target ({len(moved)} tokens differ)")
    if only_d:
        detail.append(f"{len(only_d)} token(s) only in the draft model's, e.g. {only_d[0]!r}")
    if only_t:
        detail.append(f"{len(only_t)} token(s) only in the target's, e.g. {only_t[0]!r}")
    raise DraftModelError(
        f"tokenizer mismatch: {df} differs from {tf} ({'; '.join(detail)}); "
        "a draft model must use exactly the target's tokenizer"
    )


# --------------------------------------------------------------------------------------
# the drafter
# --------------------------------------------------------------------------------------
class _Row:
    """Host bookkeeping of one row of the draft cache."""

    __slots__ = ("request", "fed", "p0")

    def __init__(self, request, fed: int):
        self.request = request  # identity: a reused request id is a new row
        self.fed = fed  # positions 0 .. fed-1 of the row are valid in the draft cache
        self.p0 = None  # position of the row's last token at the last propose


class DraftModelDrafter:
    """Classic speculative decoding with a small autoregressive draft model."""

    kind = "model"
    model_types = ()  # chosen explicitly with --draft-kind model
    needs = frozenset()  # reads nothing from the target

    def __init__(self, model, extra: int = 16, prefill_step: int = 512):
        self.model = model  # a target adapter (forward / logits / make_cache / compact)
        self.extra = extra
        self.prefill_step = prefill_step
        self.cache = None
        self.ids: list[str] = []  # request id of every cache row, in cache order
        self.rows: dict[str, _Row] = {}
        self.tail = 0  # drafted slots at the end of the cache (last propose)
        self.tree = False  # the last propose drafted a tree (its slots are not a chain)
        self.round = None  # state.round at the last propose
        #: recurrent caches' ``(conv, state)`` after the catch-up and after each draft step
        self.snaps: list = []

    @classmethod
    def check(cls, target_config: dict, drafter_config: dict) -> None:
        check_vocab(target_config, drafter_config)

    @classmethod
    def load(cls, path, target, options) -> "DraftModelDrafter":
        if path is None:
            raise DraftModelError("--draft-kind model needs --draft-model PATH (a smaller model with the target's tokenizer)")
        path = Path(path)
        cfg = read_config(path)
        check_vocab(target.config, cfg)
        check_tokenizers(target.path, path)  # before any draft weight is read
        mt = cfg.get("model_type")
        try:
            adapter = options.plugins.targets.get(mt)
        except Exception:
            raise DraftModelError(
                f"{path}/config.json: no target adapter for draft model_type {mt!r}; "
                f"supported: {', '.join(options.plugins.targets.names())}"
            ) from None
        model = adapter.from_path(path, cfg, dtype=options.dtype)
        if model.vocab_size != target.vocab_size:
            raise DraftModelError(f"the draft model's vocab_size ({model.vocab_size}) differs from the target's ({target.vocab_size})")
        tree = getattr(getattr(getattr(options, "config", None), "draft", None), "tree", "off")
        if tree != "off" and not target_supports(model, "trees"):
            raise DraftModelError(f"{path}: this draft model (model_type {mt!r}) has recurrent layers and drafts chains only; "
                                  "set [draft] tree = \"off\" (--draft-tree off)")
        return cls(model)

    # -- cache maintenance -------------------------------------------------------------
    def reset(self) -> None:
        self.cache, self.ids, self.rows, self.tail, self.tree, self.round = None, [], {}, 0, False, None
        self.snaps = []

    def _slots(self) -> list:
        return [c for c in self.cache if not isinstance(c, RecurrentCache)]

    def _states(self) -> list:
        return [c for c in self.cache if isinstance(c, RecurrentCache)]

    def _snapshot(self) -> None:
        states = self._states()
        if states:
            self.snaps.append([(c.conv, c.recurrent) for c in states])

    def _restore_states(self) -> None:
        """Each row's recurrent state after its accepted drafts (``fed``)."""
        if not self.snaps:
            return
        steps = [self.rows[rid].fed - self.rows[rid].p0 - 1 for rid in self.ids]
        for i, c in enumerate(self._states()):
            if len(set(steps)) == 1:
                c.conv, c.recurrent = self.snaps[steps[0]][i]
            else:
                c.conv = mx.concatenate([self.snaps[n][i][0][b : b + 1] for b, n in enumerate(steps)], axis=0)
                c.recurrent = mx.concatenate([self.snaps[n][i][1][b : b + 1] for b, n in enumerate(steps)], axis=0)
        self.snaps = []

    def _invalidate_from(self, limit: mx.array) -> None:
        """Mark every slot at a position ``>= limit[b]`` of row ``b`` empty."""
        for c in self._slots():
            c.dense = False  # holes from here on
            if c.idx:
                pos = c.positions[:, : c.idx]
                c.positions[:, : c.idx] = mx.where(pos >= limit[:, None], -1, pos)

    def commit(self, session, state, accepted) -> None:
        """After acceptance (once per round): keep each row's accepted
        proposals in the draft cache, invalidate the rejected ones and trim
        the slots every row rejected.  ``accepted.counts``: host list, in the
        order of ``state.rows`` (the cache's order since this round's propose)."""
        if self.cache is None or self.round != state.round or not self.tail:
            return  # no proposal of ours in this round
        if self.tree:  # the accepted path's slots lie among its siblings': re-read it next round
            self._rollback()
            return
        kept = 0
        for rid, n in zip(self.ids, accepted.counts):
            info = self.rows[rid]
            n = max(0, min(int(n), self.tail))
            info.fed = info.p0 + 1 + n
            kept = max(kept, n)
        self._drop_tail(self.tail - kept)

    def _drop_tail(self, trim: int) -> None:
        if trim:
            for c in self._slots():
                c.idx -= trim
        self.tail = 0
        limit = mx.array([self.rows[rid].fed for rid in self.ids], dtype=mx.int32)
        self._invalidate_from(limit)
        self._restore_states()

    def _rollback(self) -> None:
        """A proposal that was never committed (a replaced accept stage, an
        aborted round): keep only what was verified before it."""
        if self.cache is None or not self.tail:
            return
        for rid in self.ids:
            info = self.rows[rid]
            if info.p0 is not None:
                info.fed = info.p0 + 1
        self._drop_tail(self.tail)

    def _prefill(self, seqs: list[list[int]]):
        """A fresh cache holding ``seqs`` (left padded, negative positions)."""
        return self.model.prefill(seqs, extra=self.extra, step=self.prefill_step, pad_id=PAD_ID)[0]

    def _sync_rows(self, state) -> None:
        """Make the cache rows the state's rows, in the state's order."""
        want = [r.request.id for r in state.rows]
        if self.ids == want and all(self.rows[r.request.id].request is r.request for r in state.rows):
            return
        keep = [
            i for i, rid in enumerate(self.ids)
            if rid in set(want) and any(r.request is self.rows[rid].request for r in state.rows if r.request.id == rid)
        ]
        if self.cache is not None and keep and len(keep) != len(self.ids):
            idx = mx.array(keep, dtype=mx.int32)
            for c in self.cache:
                c.select(idx)
        if not keep:
            self.cache = None
        ids = [self.ids[i] for i in keep]
        self.rows = {rid: self.rows[rid] for rid in ids}
        new_rows = [r for r in state.rows if r.request.id not in self.rows]
        if new_rows:
            # all but the last token: the last one is the input of the first draft step
            seqs = [(list(r.request.prompt) + list(r.generated))[:-1] for r in new_rows]
            fresh = self._prefill(seqs)
            for r, s in zip(new_rows, seqs):
                self.rows[r.request.id] = _Row(r.request, len(s))
            ids += [r.request.id for r in new_rows]
            self.cache = fresh if self.cache is None else merge_caches([self.cache, fresh])
        if ids != want:
            perm = mx.array([ids.index(rid) for rid in want], dtype=mx.int32)
            for c in self.cache:
                c.select(perm)
        self.ids = want

    # -- drafting ------------------------------------------------------------------------
    def _catch_up(self, session, state):
        """Bring the cache up to each row's last token (rows joined or left,
        the tokens emitted since the last round); returns the draft model's
        logits for the first draft ``[B, V]`` and each row's position of it
        ``[B]``."""
        target = self.model
        self._rollback()
        self._sync_rows(state)
        infos = [self.rows[rid] for rid in self.ids]
        fed = [i.fed for i in infos]
        target.compact(self.cache, n_valid_max=max(fed), min_positions=fed)

        # every token a row emitted since the cache last saw it (right padded)
        seqs = [list(r.request.prompt) + list(r.generated) for r in state.rows]
        catch = [s[f:] for s, f in zip(seqs, fed)]
        lens = [len(c) for c in catch]
        L = max(lens)
        tokens = mx.array([c + [PAD_ID] * (L - n) for c, n in zip(catch, lens)], dtype=mx.int32)
        target.set_offsets(self.cache, mx.array(fed, dtype=mx.int32))
        hidden, _ = target.forward_with_taps(tokens, self.cache, (), submit=session.submit_layers)
        nxt = mx.array([len(s) for s in seqs], dtype=mx.int32)  # p0 + 1 per row
        if L > 1:
            last = mx.array([n - 1 for n in lens], dtype=mx.int32)
            hidden = mx.take_along_axis(hidden, last[:, None, None], axis=1)
            if min(lens) < L:
                self._invalidate_from(nxt)  # the padding slots
                for c in self._states():  # each row's state after its own tokens
                    c.rollback(L, mx.array(lens, dtype=mx.int32), nxt, 0, True, kept=lens)
        self.snaps = []
        self._snapshot()
        for info, s in zip(infos, seqs):
            info.fed = len(s)  # catch-up tokens are real tokens
            info.p0 = len(s) - 1
        self.round = state.round
        return target.logits(hidden[:, -1]), nxt

    def propose(self, session, state, shared, n_draft: int) -> DraftBlock:
        B = state.size
        if n_draft <= 0:
            return DraftBlock(tokens=mx.zeros((B, 0), mx.int32), n_draft=0)
        target = self.model
        submit = session.submit_layers  # as the target's verify: each layer starts as it is built
        logits, nxt = self._catch_up(session, state)
        tok = mx.argmax(logits, axis=-1).astype(mx.int32)
        out = [tok]
        for j in range(n_draft - 1):
            target.set_offsets(self.cache, nxt + j)
            hidden, _ = target.forward_with_taps(tok[:, None], self.cache, (), submit=submit)
            self._snapshot()
            tok = mx.argmax(target.logits(hidden[:, -1]), axis=-1).astype(mx.int32)
            out.append(tok)
        self.tail, self.tree = n_draft - 1, False
        return DraftBlock(tokens=mx.stack(out, axis=1), n_draft=n_draft)

    def propose_tree(self, session, state, shared, shape) -> DraftBlock:
        """A tree of candidates (:class:`~mtpflow.state.TreeShape`): one
        draft-model forward per depth over the whole frontier
        (:meth:`~mtpflow.targets.base.TextTarget.forward_tree`), each node at
        its depth's position seeing the context and its own ancestors' slots
        only.  :meth:`commit` drops every tree slot; the next catch-up reads
        the accepted path with the bonus token (a few tokens in one forward)."""
        B = state.size
        target = self.model
        if not target_supports(target, "trees"):
            raise DraftModelError("a draft model with recurrent layers drafts chains only; set [draft] tree = \"off\"")
        logits, nxt = self._catch_up(session, state)
        lg = logits[:, None]  # [B, 1, V]: the root's children
        grow = TreeBuilder(shape, B)
        anc, before = None, self.cache[0].idx
        for d in range(shape.levels):
            tok, parent = grow.expand(d, lg)
            grow.add(d, tok, parent)
            if d == shape.levels - 1:
                break
            F = tok.shape[1]
            anc = tree_visibility_step(anc, parent)
            pos = mx.broadcast_to((nxt + d)[:, None], (B, F))
            hidden, _ = target.forward_tree(tok, self.cache, pos, anc, (), submit=session.submit_layers)
            lg = target.logits(hidden)
        self.tail, self.tree = self.cache[0].idx - before, True
        return grow.finish()
