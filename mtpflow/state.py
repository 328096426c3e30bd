"""attrs state objects passed between the round stages.

Fields holding ``mx.array`` compare by identity (``eq=False``) and show only
their shape in ``repr`` -- ``repr`` of a lazy array would force evaluation.
"""

from __future__ import annotations

from typing import Any

import attrs
from attrs import define, field, frozen


def _shape_repr(x: Any) -> str:
    if x is None:
        return "None"
    shape = getattr(x, "shape", None)
    if shape is not None:
        return f"<array {tuple(shape)}>"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k!r}: {_shape_repr(v)}" for k, v in x.items()) + "}"
    if isinstance(x, (list, tuple)):
        return f"<{type(x).__name__} of {len(x)}>"
    return repr(x)


def array_field(**kw):
    """An attrs field for arrays: no equality, shape-only repr."""
    return field(eq=False, repr=_shape_repr, **kw)


@frozen(kw_only=True)
class SamplingParams:
    """Per-request sampling settings (applied identically on every path)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(factory=dict)
    #: OpenAI's penalties over the completion's tokens: ``logits[t] -= count(t) *
    #: frequency_penalty + (count(t) > 0) * presence_penalty``
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    #: structured output: an llguidance grammar (:func:`mtpflow.structured.grammar`
    #: from a JSON schema, a regex or a Lark grammar); every token obeys it
    grammar: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@define(kw_only=True)
class Request:
    """One prompt to complete."""

    id: str
    prompt: list[int]
    max_tokens: int = 256
    sampling: SamplingParams = field(factory=SamplingParams)
    stop_ids: frozenset[int] = field(factory=frozenset)
    speculative: bool = True
    #: how many of the prompt's last tokens the request itself generated (a request
    #: resumed after an error, see :mod:`mtpflow.serve.batcher`): the frequency and
    #: presence penalties count them as the completion's
    generated_before: int = 0
    #: images / audio of a multimodal prompt, as the target adapter takes them
    #: (``None``: text only); its prompt holds their placeholder tokens
    media: Any = field(default=None, eq=False, repr=lambda m: "None" if m is None else f"<{type(m).__name__}>")


def completion_start(request: Request) -> int:
    """Where ``request``'s completion begins in prompt + generated tokens."""
    return len(request.prompt) - request.generated_before


@frozen(kw_only=True)
class KVView:
    """K/V of one store layer in slot order, with each slot's absolute position.

    ``keys``/``values``: ``[B, KVH, S, hd]``; ``positions``: ``[B, S]`` int32,
    ``-1`` marks an empty or rejected slot.
    """

    keys: Any = array_field()
    values: Any = array_field()
    positions: Any = array_field()


@frozen(kw_only=True)
class SharedKV:
    """What a drafter reads from the target for one round.

    ``kv`` maps the attention type (``"full_attention"``,
    ``"sliding_attention"``) to a :class:`KVView`; ``bonus_position`` ``[B]``
    is the position of each row's last (not yet verified) token; ``hidden``
    ``[B, D]`` is the target's post-norm hidden state one position before it;
    ``last_tokens`` ``[B]`` the last tokens.
    """

    kv: dict = array_field(factory=dict)
    bonus_position: Any = array_field()
    hidden: Any = array_field()
    last_tokens: Any = array_field()


@frozen(kw_only=True)
class TreeShape:
    """The shape of a draft tree a block policy asks for.

    ``branching``: children per node at each depth (static, e.g. ``(4, 2,
    1)``: 4 + 8 + 8 = 20 nodes); or, with ``width`` set, a **dynamic** tree
    (EAGLE-2): ``depth`` levels, each keeping the ``width`` candidates with
    the highest cumulative draft probability among ``branching[0]`` children
    per frontier node.  ``budget`` (dynamic trees): of all the candidates
    drafted, verify only the ``budget`` of highest cumulative draft
    probability (EAGLE-2's re-ranking; SGLang's ``--speculative-num-draft-tokens``
    less the root), so a deeper, wider search costs no more to verify.  A
    chain of ``k`` drafts is ``TreeShape(branching=(1,) * k)``.
    """

    branching: tuple[int, ...]
    width: int | None = None
    depth: int | None = None
    budget: int | None = None

    @property
    def candidates(self) -> int:
        """Nodes drafted (before a ``budget`` keeps the best of them)."""
        if self.width is not None:
            return sum(min(self.width, self.branching[0] ** (d + 1)) for d in range(self.levels))
        n, per = 0, 1
        for b in self.branching:
            per *= b
            n += per
        return n

    @property
    def levels(self) -> int:
        return self.depth if self.width is not None else len(self.branching)

    @property
    def nodes(self) -> int:
        """Nodes verified (drafted tokens in the verify)."""
        n = self.candidates
        return n if self.budget is None else min(n, self.budget)

    @property
    def is_chain(self) -> bool:
        return self.width is None and all(b == 1 for b in self.branching)

    def describe(self) -> str:
        if self.width is not None:
            tail = "" if self.budget is None else f"x{self.budget}"
            return f"dynamic:{self.branching[0]}x{self.width}x{self.depth}{tail}"
        return "[" + ",".join(str(b) for b in self.branching) + "]"

    @classmethod
    def parse(cls, text: str) -> "TreeShape":
        """``"4,2,1"`` / ``"[4,2,1]"`` (static) or ``"dynamic:TOPK:WIDTH:DEPTH[:NODES]"``."""
        t = str(text).strip()
        try:
            if t.startswith("dynamic:"):
                fields = [int(x) for x in t.split(":")[1:]]
                if len(fields) not in (3, 4) or min(fields) < 1:
                    raise ValueError
                k, w, d = fields[:3]
                return cls(branching=(k,), width=w, depth=d, budget=fields[3] if len(fields) == 4 else None)
            parts = tuple(int(x) for x in t.strip("[]").split(",") if x.strip())
            if not parts or min(parts) < 1:
                raise ValueError
            return cls(branching=parts)
        except ValueError:
            raise ValueError(f"tree shape {text!r}: use a list of children per depth like '4,2,1' "
                             "or 'dynamic:TOPK:WIDTH:DEPTH' (optionally ':NODES', the nodes verified)") from None


@frozen(kw_only=True)
class DraftBlock:
    """Drafted tokens ``[B, k]`` (``k`` may be 0) and, for sampling, the
    drafter's processed distribution: ``probs`` ``[B, k, V]`` or ``None`` when
    the drafter drafted by argmax (then ``q`` is one-hot).  An inactive row
    accepts nothing and takes its token from the target distribution alone."""

    tokens: Any = array_field()
    n_draft: int
    probs: Any = array_field(default=None)
    #: ``[B]`` bool, rows whose drafts may be accepted; ``None`` = all rows
    #: (rows of requests with ``speculative=False`` are inactive)
    active: Any = array_field(default=None)
    #: a **tree** of candidates instead of a chain: ``parents`` ``[B, k]`` int32,
    #: the parent of each drafted node as an index into the verified inputs
    #: ``[last, tokens...]`` (0 = the root, ``last``; a node's parent comes
    #: before it), and ``depth`` ``[B, k]`` (1 = a child of the root).  ``None``:
    #: a chain (node ``i``'s parent is node ``i - 1``) -- the one-branch tree.
    parents: Any = array_field(default=None)
    depth: Any = array_field(default=None)
    max_depth: int = 0

    @property
    def is_tree(self) -> bool:
        return self.parents is not None


@frozen(kw_only=True)
class VerifyResult:
    """Target output for ``[last, drafts...]``: ``logits`` ``[B, k+1, V]``
    (softcapped, before sampling processors) and post-norm ``hidden``
    ``[B, k+1, D]``."""

    logits: Any = array_field()
    hidden: Any = array_field()
    #: the verified inputs ``[B, k+1]`` and, when a drafter needs target
    #: layers, their hidden states ``{N: [B, k+1, D]}``
    inputs: Any = array_field(default=None)
    taps: dict = array_field(factory=dict)


@frozen(kw_only=True)
class AcceptResult:
    """Per row: ``counts`` accepted drafts and ``tokens`` ``[B, k+1]`` whose first
    ``counts+1`` entries are emitted (accepted drafts, then the recovered or
    bonus token).  Lazy arrays before the round's sync, host lists after."""

    counts: Any = array_field()
    tokens: Any = array_field()
    #: trees: ``[B, D]`` the verified-input index of the accepted node at each
    #: depth ``1..D`` (entries past ``counts`` carry no meaning); ``None``: a chain
    path: Any = array_field(default=None)


@define(kw_only=True)
class RowState:
    """Host-side bookkeeping of one live row."""

    request: Request
    generated: list[int] = field(factory=list)
    position: int = 0  # absolute position of the last (unverified) token
    finished: bool = False
    finish_reason: str | None = None
    slot: int = 0
    #: the row's PRNG key (set and advanced by the sampler; from the request's seed)
    rng: Any = array_field(default=None)


@define(kw_only=True)
class BatchState:
    """The live batch between rounds (mutated by ``mtpflow_advance``)."""

    rows: list[RowState]
    cache: Any = array_field()
    last_tokens: Any = array_field()  # [B] int32
    hidden: Any = array_field()  # [B, D] post-norm hidden before the last token
    positions: Any = array_field()  # [B] int32 (device copy of row.position)
    round: int = 0
    keys: Any = array_field(default=None)  # per-row PRNG keys for sampling
    #: what the target's last forward computed, for drafters that read target
    #: layers (``needs`` with ``"layer:N"``): ``fwd_tokens`` ``[B, L]`` its
    #: inputs, ``fwd_positions`` ``[B, L]`` their positions (``-1``: padding
    #: or a rejected draft), ``taps`` ``{N: [B, L, D]}`` the residual stream
    #: entering layer ``N`` at each input.  Set by prefill (the prompt) and by
    #: advance (the verified block, before the drafter's ``commit``).
    fwd_tokens: Any = array_field(default=None)
    fwd_positions: Any = array_field(default=None)
    taps: dict = array_field(factory=dict)
    #: the next round (its draft, verify and accept), built before this round's
    #: sync so that its graph building overlaps this round's compute (see
    #: :class:`Lookahead`); ``None`` when none is pending
    lookahead: Any = array_field(default=None)

    @property
    def size(self) -> int:
        return len(self.rows)

    def settle(self) -> None:
        """Drop a pending :attr:`lookahead`: its slots leave every cache, which
        then holds exactly the rows' accepted positions again (a drafting
        round's rejected slots stay as holes).  Called before anything but the
        round built ahead touches the cache."""
        la, self.lookahead = self.lookahead, None
        if la is None:
            return
        for c in self.cache:
            c.trim(la.slots)
            c.offset = self.positions

    def select(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` (in that order): rows that finished leave."""
        import mlx.core as mx

        self.settle()
        idx = mx.array(keep, dtype=mx.int32)
        for c in self.cache:
            c.select(idx)
        self.rows = [self.rows[i] for i in keep]
        self.last_tokens = self.last_tokens[idx]
        self.hidden = self.hidden[idx]
        self.positions = self.positions[idx]
        self.fwd_tokens = self.fwd_positions = None  # consumed by the drafter already
        self.taps = {}
        for c in self.cache:  # all caches share the one positions array after select
            c.offset = self.positions

    def merge(self, new: "BatchState") -> None:
        """Append the rows of a freshly prefilled batch (continuous batching)."""
        import mlx.core as mx

        from .targets.cache import merge_caches

        self.settle()
        self.cache = merge_caches([self.cache, new.cache])
        self.rows = self.rows + new.rows
        self.last_tokens = mx.concatenate([self.last_tokens, new.last_tokens])
        self.hidden = mx.concatenate([self.hidden, new.hidden])
        self.positions = mx.concatenate([self.positions, new.positions])
        self.fwd_tokens = self.fwd_positions = None  # consumed by the drafter already
        self.taps = {}


@frozen
class Lookahead:
    """The next round's draft and verify, built before this round's sync
    (mlx-lm's ``generate_step`` overlaps the same way): its inputs are this
    round's lazy tokens, hidden states and positions, and its K/V already sit
    in the cache, ``slots`` slots past this round's.  The next round adopts it
    when it drafts as many tokens (``draft``; ``None``: none) for the same
    rows; otherwise :meth:`BatchState.settle` drops it."""

    rows: tuple  # the row objects it was built for
    verify: Any = array_field()
    accepted: Any = array_field()
    #: the next round's inputs (this round's last tokens and positions, lazy):
    #: the batch's state after this round's advance, which adopts them
    #: instead of building them again
    last_tokens: Any = array_field(default=None)
    positions: Any = array_field(default=None)
    #: the next round's :class:`DraftBlock` (``None``: a null round)
    draft: Any = array_field(default=None)

    @property
    def n_draft(self) -> int:
        return 0 if self.draft is None else self.draft.n_draft

    @property
    def slots(self) -> int:
        """The cache slots its verify appended (its drafts + 1)."""
        return self.n_draft + 1


@frozen(kw_only=True)
class RoundRecord:
    """One round, in plain Python numbers (what tracing and metrics see)."""

    round: int
    batch_size: int
    block_size: int
    drafted: int
    accepted: list[int]
    emitted: list[int]
    draft_s: float
    verify_s: float
    host_s: float
    syncs: int = 1
    #: nodes verified per row (a chain: ``drafted``); a tree's shape, if any
    nodes: int | None = None
    tree: str | None = None
    #: per row, tokens the round's target forward produced: ``emitted`` plus
    #: the stop token that ended the row (produced, not emitted); ``None`` =
    #: same as ``emitted``.  τ counts these (see :mod:`mtpflow.metrics`).
    produced: list[int] | None = None
    #: the round's draft and verify were built during the previous round's
    #: compute (the lookahead, see :class:`Lookahead`)
    overlapped: bool = False
    #: the round built the next round's verify and started it before its own
    #: sync; its ``verify_s`` includes the time the host waited to submit that
    #: graph (on a CPU device, which keeps only a few operations in flight, most
    #: of the next forward).  The next round, when it adopts that verify
    #: (``overlapped``), reads that much less; when it does not (it drafts
    #: another block, or rows finished), that forward was computed for nothing.
    built_ahead: bool = False

    @property
    def produced_tokens(self) -> list[int]:
        return self.emitted if self.produced is None else self.produced

    def as_event(self) -> dict:
        d = attrs.asdict(self)
        d["produced"] = list(self.produced_tokens)
        d["accepted_total"] = sum(self.accepted)
        d["emitted_total"] = sum(self.emitted)
        return d
