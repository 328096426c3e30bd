"""The generation loop: a :class:`Batcher` drives a batch round by round, the
round hook running once per round; :func:`generate_stream` and
:func:`generate` decode requests and prompts with it.

A :class:`~mtpflow.session.Session` (:func:`~mtpflow.session.load_session`)
holds every plugin resolved once; models and drafter kinds are resolved in
:mod:`mtpflow.resolve`, prompts encoded in :mod:`mtpflow.prompts`.  Their
public names are importable from here too.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from attrs import frozen

from .errors import LoadError
from .prompts import encode_prompt, make_request, prompt_ids
from .resolve import (
    DEFAULT_DRAFTER, DEFAULT_TARGET, PACKAGED_DRAFTERS, check_moe_dtype, default_model_paths, detect_draft_kind,
    in_target_kind, is_moe, packaged_drafter_path, resolve_draft_config, resolve_model,
)
from .session import DrafterOptions, Session, build_processors, fusable_modules, load_session, on_for_device
from .state import Request, SamplingParams


@frozen(kw_only=True)
class Event:
    """Tokens emitted for one request in one round."""

    request_id: str
    tokens: list[int]
    finished: bool = False
    finish_reason: str | None = None


@frozen(kw_only=True)
class GenerationResult:
    tokens: list[int]
    text: str | None
    finish_reason: str | None
    stats: dict



class Batcher:
    """Drives a batch incrementally: :meth:`add` requests at any time,
    :meth:`step` admits waiting requests (per the batch policy), runs one
    round and returns the events.  Rows leave when they finish (EOS, their own
    ``max_tokens``, or :meth:`cancel`); compute shrinks with them."""

    def __init__(self, session: Session):
        self.session = session
        self.waiting: list[Request] = []
        self.state = None
        self.started = False

    def add(self, requests: Iterable[Request]) -> None:
        self.waiting.extend(requests)

    @property
    def live(self) -> int:
        return 0 if self.state is None else sum(not r.finished for r in self.state.rows)

    @property
    def idle(self) -> bool:
        return not self.waiting and self.live == 0

    def cancel(self, request_id: str) -> bool:
        """Drop a request (a client went away); its row leaves at the next step."""
        before = len(self.waiting)
        self.waiting = [r for r in self.waiting if r.id != request_id]
        if len(self.waiting) != before:
            return True
        for row in self.state.rows if self.state is not None else []:
            if row.request.id == request_id and not row.finished:
                row.finished, row.finish_reason = True, "cancelled"
                return True
        return False

    def _drop_finished(self) -> None:
        st = self.state
        if st is None:
            return
        keep = [i for i, r in enumerate(st.rows) if not r.finished]
        if len(keep) != st.size:
            st.settle()  # the cache holds exactly the accepted positions again
        pc = self.session.prefix_cache
        if pc is not None and len(keep) != st.size:
            for i, r in enumerate(st.rows):
                if r.finished and r.request.media is None:  # what the target computed for this row stays reusable
                    # (rows with images / audio are not: their placeholder ids do not say which image)
                    seq = list(r.request.prompt) + list(r.generated)
                    pc.store(seq[: r.position], st.cache, i)
        if not keep:
            self.state = None
            if not self.session.batch_policy.joins_between_rounds:
                self.started = False  # a static batch is done: the next one may start
        elif len(keep) != st.size:
            st.select(keep)

    def step(self) -> list[Event]:
        """Admit what the batch policy lets in, then run one round; their events."""
        return [ev for part in self.step_parts() for ev in part]

    def step_parts(self) -> Iterator[list[Event]]:
        """:meth:`step` in its two parts, each yielded as soon as it is computed:
        the first tokens of the requests admitted now (right after their
        prefill, so a stream's first token does not wait for the batch's
        round), then the round's events."""
        session = self.session
        self._drop_finished()
        admit = session.batch_policy.admit(self.waiting, self.live, self.started)
        if admit:
            self.waiting = self.waiting[len(admit) :]
            yield self._admit(admit)
        if self.state is not None:
            yield self._run_round()

    def _admit(self, requests) -> list[Event]:
        """Prefill ``requests`` and join them to the live batch (their first tokens)."""
        return self._join(self.session.hook.mtpflow_prefill(session=self.session, requests=requests))

    def _join(self, new) -> list[Event]:
        """Merge freshly prefilled rows into the batch; their first tokens' events."""
        session = self.session
        events = []
        for row in new.rows:
            row.slot = len(row.generated)
            events.append(
                Event(request_id=row.request.id, tokens=list(row.generated), finished=row.finished, finish_reason=row.finish_reason)
            )
        if self.state is None:
            self.state = new
        else:
            self.state.merge(new)
            session.sampler.prepare(self.state.rows, session.target.vocab_size)
        self.started = True
        self._drop_finished()
        return events

    def _run_round(self) -> list[Event]:
        """One round of the live batch; its events."""
        session = self.session
        session.hook.mtpflow_round_protocol(session=session, state=self.state)
        events = list(_round_events(self.state))
        if session.prefix_cache is not None:
            self._drop_finished()  # finished rows leave now: their K/V go to the prefix cache
        return events


def generate_stream(session: Session, requests: Iterable[Request]) -> Iterator[Event]:
    """Decode a batch of requests; yields :class:`Event` per row per round.

    Rows leave the batch when they finish (EOS or their own ``max_tokens``);
    with the ``continuous`` batch policy, waiting requests join between rounds.
    """
    batcher = Batcher(session)
    batcher.add(requests)
    while not batcher.idle:
        for part in batcher.step_parts():
            yield from part


def _round_events(state) -> Iterator[Event]:
    for row in state.rows:
        new = row.generated[row.slot :]
        row.slot = len(row.generated)
        if new or row.finished:
            yield Event(request_id=row.request.id, tokens=list(new), finished=row.finished, finish_reason=row.finish_reason)


def generate(
    session: Session,
    prompt,
    max_tokens: int | None = None,
    sampling: SamplingParams | None = None,
    *,
    chat_template: bool | None = None,
    system_prompt: str | None = None,
) -> GenerationResult:
    """Complete one prompt: text or chat messages (``[{"role": "user",
    "content": ...}]``) through the tokenizer's chat template when it has one,
    as the CLI and ``mlx_lm.generate`` do (``chat_template=False``: text
    encoded plainly, as ``--ignore-chat-template``), or token ids as they
    are (see :func:`prompt_ids`)."""
    prompt = prompt_ids(session.tokenizer, prompt, chat_template, system_prompt)
    req = make_request(session, prompt, max_tokens, sampling)
    session.reset_stats()
    tokens: list[int] = []
    reason = None
    for ev in generate_stream(session, [req]):
        tokens.extend(ev.tokens)
        reason = ev.finish_reason or reason
    text = session.tokenizer.decode(tokens) if session.tokenizer is not None else None
    return GenerationResult(tokens=tokens, text=text, finish_reason=reason, stats=session.stats.as_dict())


def target_only_greedy(target, prompt: list[int], max_tokens: int, stop_ids=()) -> list[int]:
    """Reference decoding with the target alone, one token per forward, through
    the same adapter (used by tests and benchmarks): the engine's prefill (as
    mlx-lm's generate loop, the prompt's last token alone), then one-token
    forwards on the same cache, with the masks mlx-lm passes (none for one
    query), each token the argmax of the logits' log-probabilities, as mlx-lm picks it."""
    import mlx.core as mx

    from .sampling import greedy_tokens

    cache, h = target.prefill([list(prompt)])
    h = h[:, None]
    out: list[int] = []
    while True:
        tok = int(greedy_tokens(target.logits(h[:, -1]))[0].item())
        if tok in stop_ids:
            break
        out.append(tok)
        if len(out) >= max_tokens:
            break
        h = target.forward(mx.array([[tok]], dtype=mx.int32), cache)
    return out


__all__ = [
    "Session", "Event", "GenerationResult", "LoadError", "load_session", "generate",
    "generate_stream", "make_request", "prompt_ids", "target_only_greedy", "Batcher",
    # re-exported from mtpflow.session, mtpflow.resolve and mtpflow.prompts
    "DrafterOptions", "build_processors", "fusable_modules", "on_for_device", "encode_prompt",
    "DEFAULT_DRAFTER", "DEFAULT_TARGET", "PACKAGED_DRAFTERS", "check_moe_dtype", "default_model_paths",
    "detect_draft_kind", "in_target_kind", "is_moe", "packaged_drafter_path", "resolve_draft_config", "resolve_model",
]
