"""The stable API for plugin authors: everything a third-party plugin needs.

A plugin registers objects through the ``mtpflow_register_*`` hooks (see
:mod:`mtpflow.hookspecs`, ``docs/hooks.md``) and imports only from here::

    from mtpflow.api import hookimpl, Sampler, RejectionSampler, DraftBlock

What each registry accepts is a :class:`typing.Protocol` below.  The host
checks a registration against the protocol of its kind (:data:`KINDS`, the
one source of truth: ``docs/plugins.md`` and the hook docstrings are tested
against it) and names the plugin and the missing members when it fails.

Kinds, what is registered, and what the host calls:

========================  ===============================  ==========================================
registry                  registered object                built by the host as
========================  ===============================  ==========================================
``lm_heads``              a class, :class:`LMHead`         ``cls.from_config(config, vocab_size,
                                                           hidden_size, **context)``
``samplers``              a factory                        ``factory(config, processors)`` ->
                                                           :class:`Sampler`
``logits_processors``     a factory                        ``factory(config)`` -> a
                                                           :class:`LogitsProcessor` or an mlx-lm
                                                           processor ``(tokens, logits)``
``drafters``              a class, :class:`Drafter`        ``cls.load(path, target, options)``
``block_policies``        a factory                        ``factory(config)`` -> :class:`BlockPolicy`
``batch_policies``        a factory                        ``factory(config)`` -> :class:`BatchPolicy`
``targets``               a class, :class:`Target`         ``cls.from_path(path, config, dtype=...)``
========================  ===============================  ==========================================

**Settings.**  A registered object (class or factory) may carry a
``settings`` attribute: a frozen attrs class.  The ``[plugins.NAME]`` table
of the config (``--set plugins.NAME.key=value`` on the command line, NAME
being the registered name) is structured into it -- unknown keys and bad
values are errors with their path, ``$.plugins.NAME.key: ...`` -- and the
instance is handed over as the keyword ``settings=`` (factories,
``from_config``) or as ``options.settings`` (``Drafter.load``).

Names are resolved and checked before any weight is loaded.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from . import hookimpl
from .state import (
    AcceptResult,
    BatchState,
    DraftBlock,
    KVView,
    Request,
    RoundRecord,
    RowState,
    SamplingParams,
    SharedKV,
    VerifyResult,
)


# --------------------------------------------------------------------------------------
# protocols: what each registry accepts
# --------------------------------------------------------------------------------------
@runtime_checkable
class LMHead(Protocol):
    """A drafter LM head (``mtpflow_register_lm_heads``): a class.

    ``E`` is the drafter's (tied) embedding matrix when the drafter owns one,
    else ``None``; heads that read something else (the target's own head)
    take it from the ``target`` passed to :meth:`from_config`.

    Optional attribute ``input_space``: which state the head reads on the
    generic assistant drafter, ``"target"`` (default: its output projected
    into the target's hidden space) or ``"drafter"`` (its own final state).
    """

    @classmethod
    def from_config(cls, config: Any, vocab_size: int, hidden_size: int, **context: Any) -> "LMHead":
        """``context`` may hold ``target`` (the target adapter) and ``settings``."""

    def __call__(self, x: Any, E: Any = None) -> Any:
        """Dense logits over the whole target vocabulary, ``[..., V]``."""

    def argmax(self, x: Any, E: Any = None) -> Any:
        """The most likely target token id per row, ``[...]`` int32."""

    def support(self, x: Any, E: Any = None) -> tuple[Any, Any]:
        """``(ids [..., S], logits [..., S])`` of the tokens the head can draft."""


@runtime_checkable
class Sampler(Protocol):
    """An acceptance sampler, what a ``mtpflow_register_samplers`` factory returns."""

    def prepare(self, rows: list[RowState], vocab_size: int) -> None:
        """Called when the batch's rows change."""

    def first(self, logits: Any, state: BatchState | None) -> Any:
        """The prefill token per row ``[B]`` from ``[B, V]`` target logits."""

    def accept(self, logits: Any, draft: DraftBlock, state: BatchState) -> AcceptResult:
        """Accepted counts and emitted tokens from ``[B, k+1, V]`` target logits."""

    # Optional capabilities: TreeSampler, LookaheadSafe, SessionBound (below).


@runtime_checkable
class LogitsProcessor(Protocol):
    """mtpflow's processor form: ``processor(logits [B, L, V], rows) -> logits``.

    A factory may instead return an **mlx-lm logits processor**,
    ``processor(tokens, logits) -> logits`` (``tokens``: the row's prompt and
    generated ids so far, ``logits``: ``[1, V]``), recognised by its second
    parameter's name, ``logits`` (or ``fn.mlx_lm = True``); mtpflow calls it
    once per row and verified position, with the tokens up to that position,
    on the speculative path too.
    """

    def __call__(self, logits: Any, rows: list[RowState]) -> Any: ...


@runtime_checkable
class Drafter(Protocol):
    """A drafter kind (``mtpflow_register_drafters``): a class.

    ``model_types``: the checkpoint ``model_type`` values it loads (may be
    empty for model-free kinds).  ``needs``: what it reads from the target, a
    subset of ``{"hidden", "shared_kv"}`` plus ``"layer:N"`` items (the
    residual stream entering target layer ``N``; an instance may narrow or
    extend its class's set once it knows its checkpoint); the stages compute
    only what some drafter needs.

    Optional capabilities (the protocols below): :class:`TreeDrafter`,
    :class:`PrefillingDrafter`, :class:`CommittingDrafter`,
    :class:`CheckedDrafter`, :class:`RecognisingDrafter`,
    :class:`BlockSizeHint`, :class:`BlockDrafter`, :class:`BudgetDrafter`,
    :class:`HeadedDrafter`, :class:`InTargetDrafter`,
    :class:`TargetCheckedDrafter`, :class:`TrainableDrafter`; and ``settings`` (see the module docstring).
    """

    model_types: tuple[str, ...]
    needs: frozenset[str]

    @classmethod
    def load(cls, path: Any, target: Any, options: Any) -> "Drafter": ...

    def propose(self, session: Any, state: BatchState, shared: SharedKV, n_draft: int) -> DraftBlock: ...


@runtime_checkable
class BlockPolicy(Protocol):
    """A block-size policy, what a ``mtpflow_register_block_policies`` factory returns."""

    def block_size(self, stats: Any) -> int:
        """Tokens to verify per row this round (drafts + 1)."""

    def observe(self, record: RoundRecord) -> None:
        """Called after every round with its record (plain numbers)."""

    # Optional capability: PeekingBlockPolicy (below).


@runtime_checkable
class BatchPolicy(Protocol):
    """A batch policy, what a ``mtpflow_register_batch_policies`` factory returns.

    ``joins_between_rounds``: whether requests may join a running batch
    (``False``: the next batch starts only when this one is done).
    """

    joins_between_rounds: bool

    def admit(self, waiting: list[Request], live: int, started: bool) -> list[Request]:
        """The prefix of ``waiting`` to prefill now (``live`` rows decode; ``started``:
        a batch is running)."""


@runtime_checkable
class Target(Protocol):
    """A target adapter (``mtpflow_register_targets``, by ``model_type``): a class.

    :class:`mtpflow.targets.base.TargetAdapter` is the base class to subclass;
    it implements everything but :meth:`forward`, :meth:`logits` and
    :meth:`embed` from a handful of attributes.
    """

    @classmethod
    def from_path(cls, path: Any, config: dict | None = None, dtype: str | None = "float32") -> "Target": ...

    def forward(self, tokens: Any, cache: list) -> Any: ...

    def logits(self, hidden: Any) -> Any: ...

    def embed(self, tokens: Any) -> Any: ...

    def make_cache(self, extra: int = 16) -> list: ...

    def set_offsets(self, cache: list, offsets: Any) -> None: ...

    def shared_kv(self, cache: list) -> dict: ...

    def compact(self, cache: list, n_valid_max: int, min_positions: list[int]) -> None: ...


# --------------------------------------------------------------------------------------
# optional capabilities: an object has one when it has the capability's members;
# the host asks ``isinstance(obj, Capability)`` and nothing else (docs/plugins.md)
# --------------------------------------------------------------------------------------
@runtime_checkable
class TreeDrafter(Protocol):
    """A drafter that drafts token trees (a drafter without it drafts chains).

    :class:`mtpflow.drafters.base.TreeBuilder` grows a tree level by level
    from per-node draft logits.  Trees are verified only when the sampler is
    a :class:`TreeSampler` too.
    """

    def propose_tree(self, session: Any, state: BatchState, shared: SharedKV, shape: Any) -> DraftBlock:
        """A tree :class:`DraftBlock` for a :class:`~mtpflow.state.TreeShape`."""


@runtime_checkable
class PrefillingDrafter(Protocol):
    """A drafter with state of its own that takes in new rows' prompts (the
    prefix cache is off for it: it must see every prompt)."""

    def prefilled(self, session: Any, state: BatchState) -> None:
        """New rows were prefilled; ``state`` carries the prompt's target layers."""


@runtime_checkable
class CommittingDrafter(Protocol):
    """A drafter with state of its own (a KV cache to roll back)."""

    def commit(self, session: Any, state: BatchState, accepted: AcceptResult) -> None:
        """Called once per round after acceptance, with the host-side result."""


@runtime_checkable
class CheckedDrafter(Protocol):
    """A drafter kind that checks a drafter/target pair before any weight is read."""

    @classmethod
    def check(cls, target_config: dict, drafter_config: dict) -> Any:
        """Raise :class:`~mtpflow.errors.IncompatibleDrafter` on a mismatch
        (may take ``drafter_path=`` as well)."""


@runtime_checkable
class RecognisingDrafter(Protocol):
    """A drafter kind that recognises checkpoints whose ``model_type`` is not its own."""

    @classmethod
    def matches(cls, config: dict) -> bool: ...


@runtime_checkable
class BlockSizeHint(Protocol):
    """A drafter kind that recommends a block size for a checkpoint."""

    @classmethod
    def recommended_block_size(cls, config: dict, path: Any = None) -> int | None: ...


@runtime_checkable
class BlockDrafter(Protocol):
    """A block drafter trained for blocks up to a size: that is the ceiling."""

    @classmethod
    def max_block_size(cls, config: dict) -> int | None: ...


@runtime_checkable
class BudgetDrafter(Protocol):
    """``drafts_to_budget = True``: draft up to the remaining token budget
    rather than leaving room for the bonus token."""

    drafts_to_budget: bool


@runtime_checkable
class HeadedDrafter(Protocol):
    """A drafter kind whose LM head is a registered head (``[draft] head``
    selects another; on other kinds it is an error)."""

    @classmethod
    def head_of(cls, config: dict) -> str:
        """The registered name of the head the checkpoint was trained with."""


@runtime_checkable
class InTargetDrafter(Protocol):
    """A drafter kind whose drafter ships inside the target checkpoint (a
    native MTP head): run when no drafter checkpoint is given and the kind is
    asked for by name or by one of its ``aliases``, or, with nothing asked
    for, when it sets ``auto_detect = True``."""

    #: other names ``--draft-kind`` may give it (e.g. ``("mtp",)``)
    aliases: tuple[str, ...]
    #: run it whenever the target carries one and no drafter is asked for
    auto_detect: bool

    @classmethod
    def in_target(cls, target_config: dict, target_path: Any) -> bool:
        """Whether this target checkpoint carries a drafter of this kind."""


@runtime_checkable
class LabelledDrafter(Protocol):
    """A drafter that names itself in the stats line and ``--json``
    (``stats.drafter``) better than its kind does, e.g. ``native MTP head
    (depth 1, glm_moe_dsa)``."""

    label: str


@runtime_checkable
class TargetCheckedDrafter(Protocol):
    """An in-target drafter kind that checks the target checkpoint before any weight is read."""

    @classmethod
    def check_target(cls, target_config: dict, target_path: Any) -> None:
        """Raise :class:`~mtpflow.errors.IncompatibleDrafter` on a mismatch."""


@runtime_checkable
class TrainableDrafter(Protocol):
    """A drafter kind that ``mtpflow train --kind NAME`` trains, NAME being its
    ``train_kind`` (the registered name may differ: the native MTP kind trains
    as ``mtp``).  ``trainer``: the kind's trainer, a
    :class:`mtpflow.train.kind.KindTrainer` subclass or its ``"module:Class"``
    path, imported only when training starts."""

    #: the ``mtpflow train --kind`` name
    train_kind: str
    #: the trainer class, or ``"module:Class"``
    trainer: Any


@runtime_checkable
class TreeSampler(Protocol):
    """A sampler that can verify trees (a sampler without it never sees one)."""

    def supports_trees(self, state: BatchState) -> bool:
        """Whether this round's rows may verify a tree (false when processing
        reads the drafts' history)."""


@runtime_checkable
class LookaheadSafe(Protocol):
    """A sampler, a drafter, or a plugin implementing a verify/accept/advance
    stage, that copes with the next round's draft, verify and accept arriving
    before this round's advance and emit, on this round's lazy outcome (the
    lookahead; absent: never)."""

    def lookahead_safe(self, state: BatchState) -> bool: ...


@runtime_checkable
class SessionBound(Protocol):
    """A sampler that reads the session (bound once, after loading)."""

    def bind_session(self, session: Any) -> None: ...


@runtime_checkable
class LimitedTarget(Protocol):
    """A target that declares what its caches can do (every
    :class:`~mtpflow.targets.base.TargetAdapter` does; a target without the
    declaration can do both).  A recurrent layer (Gated DeltaNet, Mamba)
    cannot verify a tree of drafts in one forward, nor be stored in and
    reused from the prefix cache: such a target drafts chains and runs with
    the prefix cache off, each said once with a warning."""

    #: the target can verify a tree of drafts in one forward
    supports_trees: bool
    #: the prefix cache may store and reuse this target's cache
    supports_prefix_cache: bool


def target_supports(target: Any, what: str) -> bool:
    """Whether ``target`` supports ``what`` (``"trees"``, ``"prefix_cache"``):
    what it declares as a :class:`LimitedTarget`, else yes."""
    if not has(target, LimitedTarget):
        return True
    return bool(target.supports_trees if what == "trees" else target.supports_prefix_cache)


@runtime_checkable
class PeekingBlockPolicy(Protocol):
    """A block policy that can say what its next ``block_size`` will most
    likely be, with no side effects (``None``: no guess).  When it says 1, a
    round that drafts nothing builds the next one before its sync; a wrong
    guess costs one verify, never a token."""

    def peek(self, stats: Any) -> int | None: ...


#: kind -> the optional capabilities the host looks for on what it registers or builds
CAPABILITIES: dict[str, tuple[type, ...]] = {
    "drafters": (TreeDrafter, PrefillingDrafter, CommittingDrafter, CheckedDrafter, RecognisingDrafter,
                 BlockSizeHint, BlockDrafter, BudgetDrafter, HeadedDrafter, InTargetDrafter, TargetCheckedDrafter,
                 LabelledDrafter, TrainableDrafter),
    "samplers": (TreeSampler, LookaheadSafe, SessionBound),
    "block_policies": (PeekingBlockPolicy,),
    "targets": (LimitedTarget,),
}


_MEMBERS: dict = {}


def has(obj: Any, capability: type) -> bool:
    """Whether ``obj`` has the ``capability`` (one of the protocols above):
    ``isinstance(obj, capability)``, at the cost of one ``getattr`` per
    member, so the round loop may ask every round."""
    members = _MEMBERS.get(capability)
    if members is None:
        members = _MEMBERS[capability] = tuple(protocol_members(capability))
    return all(getattr(obj, m, None) is not None for m in members)


def capabilities(obj: Any) -> list[str]:
    """The names of the optional capabilities ``obj`` has."""
    return sorted({p.__name__ for ps in CAPABILITIES.values() for p in ps if has(obj, p)})


class KindSpec:
    """How one registry checks what it is given (derived from the protocols).

    ``registered``: the protocol the registered object itself satisfies (a
    class kind), or ``None`` for factories, which must be callable;
    ``built``: the protocol of what the host builds from it.
    """

    def __init__(self, name: str, registered: type | None, built: type | None, calls: str, singular: str):
        self.name, self.registered, self.built, self.calls, self.singular = name, registered, built, calls, singular

    def missing(self, obj: Any, proto: type | None = None) -> list[str]:
        """Members of ``proto`` (default: the registered protocol) that ``obj`` lacks."""
        proto = proto if proto is not None else self.registered
        if proto is None:
            return [] if callable(obj) else ["__call__"]
        return [m for m in protocol_members(proto) if not hasattr(obj, m)]


def protocol_members(proto: type) -> list[str]:
    """The members a protocol requires, in definition order."""
    out = []
    for klass in reversed(proto.__mro__):
        if klass in (object, Protocol) or not getattr(klass, "_is_protocol", False):
            continue
        names = list(getattr(klass, "__annotations__", {})) + [
            n for n, v in vars(klass).items() if callable(v) or isinstance(v, (classmethod, staticmethod))
        ]
        for n in names:
            if (not n.startswith("_") or n == "__call__") and n not in out:
                out.append(n)
    return out


#: registry name -> its :class:`KindSpec` (the hook is ``mtpflow_register_<name>``)
KINDS: dict[str, KindSpec] = {
    "lm_heads": KindSpec("lm_heads", LMHead, LMHead, "cls.from_config(config, vocab_size, hidden_size, **context)", "lm head"),
    "samplers": KindSpec("samplers", None, Sampler, "factory(config, processors)", "sampler"),
    "logits_processors": KindSpec("logits_processors", None, None, "factory(config)", "logits processor"),
    "drafters": KindSpec("drafters", Drafter, Drafter, "cls.load(path, target, options)", "drafter"),
    "block_policies": KindSpec("block_policies", None, BlockPolicy, "factory(config)", "block policy"),
    "batch_policies": KindSpec("batch_policies", None, BatchPolicy, "factory(config)", "batch policy"),
    "targets": KindSpec("targets", Target, Target, "cls.from_path(path, config, dtype=dtype)", "target"),
}

#: what ``needs`` may hold besides ``"layer:N"`` items
NEEDS = frozenset({"hidden", "shared_kv"})


def check_needs(needs: Any) -> str | None:
    """Why ``needs`` is not a valid set of needs, or ``None``."""
    if not isinstance(needs, (set, frozenset)):
        return f"needs must be a frozenset, got {type(needs).__name__}"
    for n in needs:
        if n in NEEDS:
            continue
        if isinstance(n, str) and n.startswith("layer:") and n[6:].isdigit():
            continue
        return f"needs holds {n!r}; allowed: {', '.join(sorted(NEEDS))} or 'layer:N'"
    return None


def needed_layers(needs) -> tuple[int, ...]:
    """The target layers (``"layer:N"`` items) of ``needs``, sorted."""
    return tuple(sorted(int(n[6:]) for n in needs if n.startswith("layer:")))


# --------------------------------------------------------------------------------------
# base classes and helpers meant for plugin authors (imported on first use:
# some of them import mlx)
# --------------------------------------------------------------------------------------
_LAZY = {
    "TargetAdapter": "mtpflow.targets.base",
    "SlotKVCache": "mtpflow.targets.cache",
    "GreedySampler": "mtpflow.builtins.samplers",
    "RejectionSampler": "mtpflow.builtins.samplers",
    "FixedBlockPolicy": "mtpflow.builtins.policies",
    "AdaptiveBlockPolicy": "mtpflow.builtins.policies",
    "StaticBatchPolicy": "mtpflow.builtins.policies",
    "ContinuousBatchPolicy": "mtpflow.builtins.policies",
    "TiedDenseHead": "mtpflow.drafters.gemma4_assistant.heads",
    "CentroidHead": "mtpflow.drafters.gemma4_assistant.heads",
    "IncompatibleDrafter": "mtpflow.errors",
    "TargetError": "mtpflow.errors",
    "process_logits": "mtpflow.sampling",
    "ProcessParams": "mtpflow.sampling",
    "greedy_accept": "mtpflow.sampling",
    "rejection_accept": "mtpflow.sampling",
    "sample": "mtpflow.sampling",
}


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'mtpflow.api' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(mod), name)


__all__ = [
    "hookimpl", "KINDS", "KindSpec", "NEEDS", "check_needs", "needed_layers", "protocol_members",
    "LMHead", "Sampler", "LogitsProcessor", "Drafter", "BlockPolicy", "BatchPolicy", "Target",
    "CAPABILITIES", "capabilities", "has", "TreeDrafter", "PrefillingDrafter", "CommittingDrafter", "CheckedDrafter",
    "RecognisingDrafter", "BlockSizeHint", "BlockDrafter", "BudgetDrafter", "HeadedDrafter", "InTargetDrafter",
    "TargetCheckedDrafter", "LabelledDrafter", "TrainableDrafter", "LimitedTarget", "target_supports", "TreeSampler",
    "LookaheadSafe", "SessionBound", "PeekingBlockPolicy",
    "AcceptResult", "BatchState", "DraftBlock", "KVView", "Request", "RoundRecord", "RowState", "SamplingParams",
    "SharedKV", "VerifyResult", *sorted(_LAZY),
]
