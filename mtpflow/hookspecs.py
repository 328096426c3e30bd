"""Every hook mtpflow calls, grouped by lifecycle.

A plugin is any module or object with functions named like these specs and
decorated with :data:`mtpflow.hookimpl`.  Specs only ever grow by new keyword
arguments; an implementation may accept fewer arguments than the spec offers.

Two families of hooks exist:

* **Registries** (``mtpflow_register_*``) are ``historic``: each plugin's
  implementation is called once, when the plugin is added to the manager --
  also a plugin added after the manager was built
  (:meth:`mtpflow.plugins.Plugins.register`).  Each receives a ``register``
  callback; the host owns the names, rejects duplicates and checks the
  registered object's interface at registration time.
* **Round stages** (``mtpflow_prefill`` … ``mtpflow_emit``) make up one
  speculative round, see :func:`mtpflow_round_protocol`.  Stage hooks are
  ``firstresult``: the built-in implementations live in
  ``mtpflow.builtins.stages`` and a plugin overrides one by implementing the
  same hook with ``tryfirst=True`` and returning a non-``None`` result.
  Stage hooks run at most once per round (never per token or per row) and
  never call ``mx.eval``, ``.item()`` or ``.tolist()``: the engine performs
  the single host synchronisation of a round between ``mtpflow_accept`` and
  ``mtpflow_advance``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import pluggy

if TYPE_CHECKING:  # pragma: no cover
    from .session import Session
    from .state import AcceptResult, BatchState, DraftBlock, Request, RoundRecord, SharedKV, TreeShape, VerifyResult

#: the ``register(name, obj)`` callback a registry hook receives
Register = Callable[[str, Any], None]

hookspec = pluggy.HookspecMarker("mtpflow")


# --------------------------------------------------------------------------------------
# The round protocol
# --------------------------------------------------------------------------------------
@hookspec(firstresult=True)
def mtpflow_round_protocol(session: Session, state: BatchState) -> RoundRecord:
    """Run one speculative round for every live row of ``state``.

    The default implementation (``mtpflow.builtins.stages``) performs, in order:

    1. ``mtpflow_prefill`` -- only for rows that just joined: run the target
       over the prompt, fill its KV cache, take the first token.  (Called by the
       engine before the first round, not by this hook.)
    2. ``mtpflow_bind_shared_kv`` -- hand the target's store-layer K/V, the last
       hidden state and the bonus position over to the drafter.
    3. ``mtpflow_draft_block`` -- the drafter proposes up to ``block_size - 1``
       tokens per row.
    4. ``mtpflow_verify`` -- one target forward over ``[last, drafts...]``.
    5. ``mtpflow_accept`` -- the sampler decides, per row, how many drafts are
       accepted and which recovered/bonus token follows (lazy arrays).
       *The engine then performs the round's single host synchronisation.*
    6. ``mtpflow_advance`` -- roll the target cache back past rejected drafts
       (a drafter with state of its own follows through its ``commit``),
       move last token / hidden state / positions forward, retire finished rows.
    7. ``mtpflow_emit`` -- observers receive the emitted tokens and the round
       record (plain Python numbers): streaming, tracing, metrics.

    :param session: the :class:`mtpflow.engine.Session` (resolved plugins, config).
    :param state: the :class:`mtpflow.state.BatchState` of the live rows.
    :return: the :class:`mtpflow.state.RoundRecord` of the round.

    ``firstresult``: yes.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def mtpflow_prefill(session: Session, requests: list[Request]) -> BatchState:
    """Prefill the target for newly admitted requests.

    :param session: the generation session.
    :param requests: list of :class:`mtpflow.state.Request`.
    :return: a :class:`mtpflow.state.BatchState` holding the target cache, the
        first sampled token of every row, the hidden state that precedes it and
        the row positions.

    ``firstresult``: yes.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def mtpflow_bind_shared_kv(session: Session, state: BatchState) -> SharedKV:
    """Build what the drafter reads from the target for this round.

    :param session: the generation session.
    :param state: the live :class:`mtpflow.state.BatchState`.
    :return: a :class:`mtpflow.state.SharedKV` (store-layer K/V per attention
        type with per-slot positions, the bonus position and the last hidden).

    ``firstresult``: yes.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def mtpflow_draft_block(
    session: Session, state: BatchState, shared: SharedKV, block_size: int, tree: TreeShape | None
) -> DraftBlock:
    """Propose ``block_size - 1`` draft tokens per row, or a tree of them.

    :param session: the generation session.
    :param state: the live :class:`mtpflow.state.BatchState`.
    :param shared: the :class:`mtpflow.state.SharedKV` of this round.
    :param block_size: tokens verified per row this round (drafts + 1; for a
        tree: its nodes + 1).
    :param tree: the :class:`mtpflow.state.TreeShape` the block policy asked
        for, or ``None`` for a chain; a drafter that cannot draft trees
        proposes a chain of ``block_size - 1``.
    :return: a :class:`mtpflow.state.DraftBlock` (lazy arrays; ``parents``
        set for a tree).

    .. versionchanged:: 0.2 the ``tree`` keyword.

    ``firstresult``: yes.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def mtpflow_verify(session: Session, state: BatchState, draft: DraftBlock) -> VerifyResult:
    """Run the target once over ``[last token, drafts...]`` for every row.

    :param session: the generation session.
    :param state: the live :class:`mtpflow.state.BatchState`.
    :param draft: the :class:`mtpflow.state.DraftBlock`.
    :return: a :class:`mtpflow.state.VerifyResult` (processed target logits and
        post-norm hidden states, lazy).

    ``firstresult``: yes.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def mtpflow_accept(session: Session, state: BatchState, draft: DraftBlock, verify: VerifyResult) -> AcceptResult:
    """Decide acceptance with the session's sampler.

    :param session: the generation session.
    :param state: the live :class:`mtpflow.state.BatchState`.
    :param draft: the :class:`mtpflow.state.DraftBlock`.
    :param verify: the :class:`mtpflow.state.VerifyResult`.
    :return: an :class:`mtpflow.state.AcceptResult` with, per row, the number
        of accepted drafts and the ``accepted + 1`` tokens to emit (lazy).

    ``firstresult``: yes.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def mtpflow_advance(
    session: Session, state: BatchState, draft: DraftBlock, verify: VerifyResult, accepted: AcceptResult
) -> list[list[int]]:
    """Advance the batch after the round's host synchronisation.

    Rolls the target cache back past the rejected drafts, sets each row's next
    last token, hidden state and position, truncates at EOS / ``max_tokens``
    and marks finished rows.

    When ``state.lookahead`` is set (the round built the next one before its
    sync, see :class:`mtpflow.state.Lookahead`), the cache already holds the
    next verify's slots (after a drafting round, rolled back lazily): an
    implementation leaves the cache alone (no rollback, no compaction) and the
    round protocol settles it if a row finished.

    :param session: the generation session.
    :param state: the live :class:`mtpflow.state.BatchState` (mutated).
    :param draft: the :class:`mtpflow.state.DraftBlock`.
    :param verify: the :class:`mtpflow.state.VerifyResult`.
    :param accepted: the synchronised :class:`mtpflow.state.AcceptResult`
        (its ``counts`` and ``tokens`` are host lists).
    :return: the list of per-row emitted token lists.

    ``firstresult``: yes.

    .. versionadded:: 0.1
    """


@hookspec
def mtpflow_emit(session: Session, record: RoundRecord, emitted: dict[str, list[int]]) -> None:
    """Observe a finished round (all implementations are called).

    :param session: the generation session.
    :param record: the :class:`mtpflow.state.RoundRecord` (plain numbers).
    :param emitted: ``{request_id: [token ids emitted this round]}``.
    :return: ignored.

    .. versionadded:: 0.1
    """


# --------------------------------------------------------------------------------------
# Registries
# --------------------------------------------------------------------------------------
@hookspec(historic=True)
def mtpflow_register_lm_heads(register: Register) -> None:
    """Register drafter LM heads (selected by ``[draft] head``, default: the checkpoint's).

    :param register: ``register(name, head_cls)``; ``head_cls`` satisfies
        :class:`mtpflow.api.LMHead`: ``from_config(config, vocab_size,
        hidden_size, **context)`` (``context``: ``target``, ``settings``)
        builds an instance with ``__call__(x, E=None)`` (dense logits over
        the target vocabulary), ``argmax(x, E=None)`` (token ids) and
        ``support(x, E=None)`` (``(ids, logits)`` of the draftable tokens);
        ``E`` is the drafter's tied embedding, when it has one.
    :return: ignored.

    .. versionadded:: 0.1
    """


@hookspec(historic=True)
def mtpflow_register_samplers(register: Register) -> None:
    """Register acceptance samplers (``[sampling] sampler``).

    :param register: ``register(name, factory)``; ``factory(config,
        processors)`` (``processors``: the configured logits processors, to
        apply first; plus ``settings=`` when the factory declares
        ``settings``) returns a :class:`mtpflow.api.Sampler`: ``prepare(rows,
        vocab_size)``, ``first(logits, state)`` (the prefill token) and
        ``accept(logits, draft, state)`` (an :class:`mtpflow.state.AcceptResult`).
    :return: ignored.

    .. versionadded:: 0.1
    """


@hookspec(historic=True)
def mtpflow_register_logits_processors(register: Register) -> None:
    """Register logits processors (``[sampling] processors = [...]`` in a config).

    :param register: ``register(name, factory)``; ``factory(config)`` (plus
        ``settings=`` when it declares ``settings``) returns a
        :class:`mtpflow.api.LogitsProcessor`, ``processor(logits, rows)`` on
        ``[B, L, V]`` target logits (optionally with a keyword ``drafts``),
        or an mlx-lm logits processor ``processor(tokens, logits)``, called
        per row and verified position with the tokens up to it.  Configured
        processors run, in order, before the built-in temperature / top-k /
        top-p / min-p / penalty processing, identically on the speculative and
        the target-only path.  They must not synchronise.
    :return: ignored.

    .. versionadded:: 0.1
    """


@hookspec(historic=True)
def mtpflow_register_drafters(register: Register) -> None:
    """Register drafter kinds (``--draft-kind``).

    :param register: ``register(name, drafter_cls)``; ``drafter_cls``
        satisfies :class:`mtpflow.api.Drafter`: ``model_types`` (config
        ``model_type`` values it loads, may be empty), ``needs`` (a frozenset
        of ``"hidden"``, ``"shared_kv"`` and ``"layer:N"`` items; the stages
        compute only what is needed), ``load(path, target, options)`` and
        instances ``propose(session, state, shared, n_draft)``; optionally
        ``check(target_config, drafter_config[, drafter_path])``,
        ``matches(config)``, ``recommended_block_size(config, path)``,
        ``max_block_size(config)``, ``drafts_to_budget``, ``settings``,
        ``in_target(target_config, target_path)`` (the drafter ships inside the
        target checkpoint: with no drafter checkpoint given, a request for the
        kind, for one of its ``aliases``, or with ``auto_detect`` for no kind
        at all, runs it) with ``check_target(target_config, target_path)``
        (raise before any weight is read), ``label`` (what the stats line
        calls the drafter), and
        instance methods ``prefilled(session, state)`` (after prefill, with
        the new rows' prompt features) and ``commit(session, state,
        accepted)`` (after every acceptance) for drafters with state of their own.
    :return: ignored.

    .. versionadded:: 0.1
    """


@hookspec(historic=True)
def mtpflow_register_batch_policies(register: Register) -> None:
    """Register batch policies (``[batch] policy``: which requests decode together).

    :param register: ``register(name, factory)``; ``factory(config)`` returns
        a :class:`mtpflow.api.BatchPolicy`: ``admit(waiting, live, started)``
        (the prefix of ``waiting`` to prefill now; ``live`` rows are decoding,
        ``started``: a batch is running) and ``joins_between_rounds`` (whether
        requests may join a running batch).
    :return: ignored.

    .. versionadded:: 0.1
    """


@hookspec(historic=True)
def mtpflow_register_block_policies(register: Register) -> None:
    """Register block-size policies (``[draft] policy``).

    :param register: ``register(name, factory)``; ``factory(config)`` returns
        a :class:`mtpflow.api.BlockPolicy`: ``block_size(stats)`` (tokens to
        verify this round) and ``observe(record)`` (after every round).
    :return: ignored.

    .. versionadded:: 0.1
    """


@hookspec(historic=True)
def mtpflow_register_targets(register: Register) -> None:
    """Register target adapters by HF ``model_type``.

    :param register: ``register(model_type, adapter_cls)``; ``adapter_cls``
        satisfies :class:`mtpflow.api.Target`: ``from_path(path, config,
        dtype)`` builds an adapter with ``forward``, ``logits``, ``embed``,
        ``make_cache``, ``set_offsets``, ``shared_kv`` and ``compact``
        (subclass :class:`mtpflow.targets.base.TargetAdapter`).
    :return: ignored.

    .. versionadded:: 0.1
    """
