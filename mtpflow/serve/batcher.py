"""A :class:`~mtpflow.engine.Batcher` whose failures end one row, not the batch.

The server validates every request before it reaches the batch, so a row
that makes a round raise is a bug or a plugin's doing; it must still end that
row alone.  :class:`IsolatingBatcher` does what :class:`~mtpflow.engine.Batcher`
does and, when a step raises:

* **a prefill raised** (requests joining the batch): the live rows are
  untouched (prefill builds a new batch; it joins the live one last).  Each
  joining request is prefilled again *alone*; those that raise alone end with
  an error event, the others go back to the front of the queue.
* **a round raised**: the batch's state may be half-updated, so it is
  dropped and rebuilt.  Every live row becomes a *resumed* request -- its
  prompt plus the tokens it has emitted, the rest of its budget, the same id
  -- and is run alone for a prefill and one round (a *probe*, whose output is
  thrown away).  Rows whose probe raises end with an error event; the others
  go back to the front of the queue and decode on from where they were.
  Greedy rows continue exactly (the prefill of prompt + emitted tokens gives
  the target's next-token distribution), and so do seeded sampled rows under
  the built-in sampler, whose draws are keyed by (seed, absolute position):
  the resumed request keeps its seed and its next token keeps its position.
  (A sampler whose keys advance per round -- rejection sampling of drafts
  that carry probabilities -- restarts them from the seed.)

A failure that no row reproduces alone is counted against every row of the
failing step; a row in ``max_strikes`` such steps in a row ends with an
error (the batch as a whole cannot be served, and retrying forever would
hang its requests).  An error event is an :class:`~mtpflow.engine.Event` with
``finish_reason == "error"``; its message is in :attr:`IsolatingBatcher.errors`.

Probes run under a request id with :data:`PROBE_SUFFIX` appended (plugins
keyed by request id ignore them) and their rounds are not counted in
``session.stats``.
"""

from __future__ import annotations

import copy

import attrs

from ..engine import Batcher, Event

#: appended to the request id of a probe (a row run alone to find a failing one)
PROBE_SUFFIX = "#probe"


def resume_request(request, emitted: list[int]):
    """The request that continues ``request`` after it emitted ``emitted`` (same id and sampling;
    the penalties still count ``emitted`` as its completion)."""
    return attrs.evolve(request, prompt=list(request.prompt) + list(emitted),
                        max_tokens=request.max_tokens - len(emitted),
                        generated_before=request.generated_before + len(emitted))


class IsolatingBatcher(Batcher):
    """:class:`~mtpflow.engine.Batcher` with row-level fault isolation (see the module docstring)."""

    def __init__(self, session, max_strikes: int = 3):
        super().__init__(session)
        self.max_strikes = max_strikes
        #: request id -> error message of rows that ended with an error event
        self.errors: dict[str, str] = {}
        self.strikes: dict[str, int] = {}
        #: failing steps handled so far
        self.recoveries = 0

    def cancel(self, request_id: str) -> bool:
        self.strikes.pop(request_id, None)
        return super().cancel(request_id)

    # ---- the step ----------------------------------------------------------------------
    def step_parts(self):
        for events in super().step_parts():
            for ev in events:
                if ev.finished:
                    self.strikes.pop(ev.request_id, None)
            yield events

    def _admit(self, requests) -> list[Event]:
        """:meth:`Batcher._admit`; a failing prefill is isolated to the requests that fail."""
        try:
            new = self.session.hook.mtpflow_prefill(session=self.session, requests=requests)
        except Exception as exc:
            return self._isolate_prefill(requests, exc)
        return self._join(new)

    def _run_round(self) -> list[Event]:
        """:meth:`Batcher._run_round`; a failing round ends only the rows that fail."""
        try:
            return super()._run_round()
        except Exception as exc:
            return self._recover(exc)

    def _join(self, new) -> list[Event]:
        """:meth:`Batcher._join`; a merge that fails rebuilds the live batch."""
        events = [Event(request_id=row.request.id, tokens=list(row.generated), finished=row.finished,
                        finish_reason=row.finish_reason) for row in new.rows]
        try:
            return super()._join(new)
        except Exception as exc:  # the live batch may be half-merged: rebuild it
            return events + self._recover(exc, extra=new.rows)

    # ---- isolation ---------------------------------------------------------------------
    def _probe(self, request, with_round: bool) -> Exception | None:
        """Run ``request`` alone (prefill, and one round if ``with_round``); its exception or None."""
        session = self.session
        probe = attrs.evolve(request, id=request.id + PROBE_SUFFIX)
        saved = session.stats
        session.stats = copy.deepcopy(saved)
        try:
            st = session.hook.mtpflow_prefill(session=session, requests=[probe])
            if with_round and not st.rows[0].finished:
                session.hook.mtpflow_round_protocol(session=session, state=st)
        except Exception as exc:
            return exc
        finally:
            session.stats = saved
        return None

    def _sort(self, requests, with_round: bool, exc: Exception) -> tuple[list, list[Event]]:
        """Probe each request: (those to retry, error events)."""
        self.recoveries += 1
        ok, events, culprit = [], [], False
        for req in requests:
            err = self._probe(req, with_round)
            if err is None:
                ok.append(req)
            else:
                culprit = True
                events.append(self._error(req.id, err))
        if not culprit:  # nobody fails alone: a strike for everyone in the failing step
            retry = []
            for req in ok:
                self.strikes[req.id] = self.strikes.get(req.id, 0) + 1
                if self.strikes[req.id] >= self.max_strikes:
                    events.append(self._error(req.id, exc, alone=False))
                else:
                    retry.append(req)
            ok = retry
        return ok, events

    def _error(self, rid: str, exc: Exception, alone: bool = True) -> Event:
        where = "" if alone else f" (the batch failed {self.max_strikes} times with this request in it)"
        self.errors[rid] = f"generation failed{where}: {type(exc).__name__}: {exc}"
        self.strikes.pop(rid, None)
        return Event(request_id=rid, tokens=[], finished=True, finish_reason="error")

    def _isolate_prefill(self, admit, exc) -> list[Event]:
        # each alone, without a round: a probe round would re-sync the drafter's
        # own per-row state to the probe and lose the live batch's
        retry, events = self._sort(admit, with_round=False, exc=exc)
        self.waiting = retry + self.waiting
        return events

    def _recover(self, exc, extra=()) -> list[Event]:
        rows, seen = [], set()
        for row in list(self.state.rows if self.state is not None else []) + list(extra):
            if row.request.id in seen or row.finish_reason == "cancelled":
                continue
            seen.add(row.request.id)
            rows.append(row)
        self.state = None
        if not self.session.batch_policy.joins_between_rounds:
            self.started = False
        events, resumed = [], []
        for row in rows:
            done = row.generated[: row.slot]  # what the row's client has received
            if len(done) >= row.request.max_tokens:
                events.append(Event(request_id=row.request.id, tokens=[], finished=True, finish_reason="length"))
            else:
                resumed.append(resume_request(row.request, done))
        retry, errs = self._sort(resumed, with_round=True, exc=exc)
        self.waiting = retry + self.waiting
        return events + errs


__all__ = ["IsolatingBatcher", "PROBE_SUFFIX", "resume_request"]
