"""The scheduler thread of ``mtpflow serve``: it owns the session and an
:class:`~mtpflow.serve.batcher.IsolatingBatcher`, and sends each request's text back to its
handler (see :mod:`mtpflow.serve`)."""

from __future__ import annotations

import atexit
import gc
import math
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable

from mtpflow import hookimpl
from mtpflow.logs import SERVER, round_logger, stdlib_logger
from mtpflow.metrics import tau

from .protocol import DEFAULT_MAX_QUEUED, APIError


# --------------------------------------------------------------------------------------
# engine-side helpers
# --------------------------------------------------------------------------------------
class _Submission:
    """The rows of one HTTP request on their way to the scheduler."""

    def __init__(self, group: str, requests: list, loop, queue, stops: list[str], *, deadline: float | None = None,
                 logprobs: int | None = None, t_arrival: float | None = None):
        self.group, self.requests, self.loop, self.queue, self.stops = group, requests, loop, queue, stops
        self.deadline, self.logprobs = deadline, logprobs
        self.t_arrival = time.perf_counter() if t_arrival is None else t_arrival


class _Job:
    """Host-side bookkeeping of one row (one choice of an HTTP request; owned by the scheduler thread)."""

    def __init__(self, request, sub: _Submission, index: int, log):
        self.request = request
        self.rid = request.id
        self.group = sub.group
        self.index = index
        self.loop, self.queue, self.stops = sub.loop, sub.queue, sub.stops
        self.deadline, self.logprobs = sub.deadline, sub.logprobs
        self.log = log
        self.tokens: list[int] = []
        self.sent = 0  # characters of text already delivered
        self.text_len = 0  # characters of the decoded tokens
        self.rounds = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.round_produced = 0
        self.t_arrival = sub.t_arrival
        self.t_submit = time.perf_counter()
        self.t_admit: float | None = None
        self.t_first: float | None = None
        self.queued = True  # counted in the scheduler's queue until it joins the batch
        self.lp: list = []  # per token: (logprob, [(id, logprob)]) or None
        self.offsets: list[int] = []  # per token: where its text starts
        self.lp_sent = 0

    def queue_time(self) -> float:
        return (self.t_admit if self.t_admit is not None else time.perf_counter()) - self.t_submit

    def usage(self) -> dict:
        p, c = len(self.request.prompt), len(self.tokens)
        return {
            "prompt_tokens": p,
            "completion_tokens": c,
            "total_tokens": p + c,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "rounds": self.rounds,
            "tau": None if not self.rounds else round(tau(self.round_produced, self.rounds), 4),
            "queue_time_s": round(self.queue_time(), 6),
        }


def _aggregate_usage(parts: list[tuple[dict, int]]) -> dict:
    """One usage for ``n`` choices: ``(usage, produced tokens)`` each."""
    if len(parts) == 1:
        return parts[0][0]
    us = [u for u, _ in parts]
    p = us[0]["prompt_tokens"]
    c = sum(u["completion_tokens"] for u in us)
    rounds = sum(u["rounds"] for u in us)
    produced = sum(n for _, n in parts)
    return {
        "prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
        "draft_tokens": sum(u["draft_tokens"] for u in us),
        "accepted_tokens": sum(u["accepted_tokens"] for u in us),
        "rounds": rounds,
        "tau": None if not rounds else round(tau(produced, rounds), 4),
        "queue_time_s": max(u["queue_time_s"] for u in us),
    }


class RoundObserver:
    """Session plugin: per-request counters and the spec-decode metrics (it logs
    nothing: the engine's round events already go to ``mtpflow.rounds``)."""

    def __init__(self, jobs: dict[str, _Job], metrics=None):
        self.jobs = jobs
        self.metrics = metrics

    @hookimpl
    def mtpflow_emit(self, session, record, emitted):
        spec = []
        for i, rid in enumerate(emitted):  # record lists are in the order of emitted's keys
            job = self.jobs.get(rid)
            spec.append(job is not None and job.request.speculative)
            if job is None:
                continue
            drafted = record.drafted if job.request.speculative else 0
            acc = record.accepted[i] if i < len(record.accepted) else 0
            produced = record.produced_tokens
            n = produced[i] if i < len(produced) else len(emitted[rid])
            job.rounds += 1
            job.draft_tokens += drafted
            job.accepted_tokens += acc
            job.round_produced += n
        if self.metrics is not None and any(rid in self.jobs for rid in emitted):
            self.metrics.observe_round(record, spec)

    @hookimpl(wrapper=True)
    def mtpflow_prefill(self, session, requests):
        state = yield
        if self.metrics is not None:
            from .batcher import PROBE_SUFFIX

            unique = {tuple(r.prompt) for r in requests if not r.id.endswith(PROBE_SUFFIX)}
            self.metrics.prefill_tokens.inc(sum(len(p) for p in unique))
        return state


# --------------------------------------------------------------------------------------
# the scheduler thread
# --------------------------------------------------------------------------------------
class Scheduler:
    """Owns the session and the batcher in one thread.

    ``source`` is a :class:`~mtpflow.config.Config` (loaded in the scheduler
    thread -- recommended), a zero-argument callable returning a
    :class:`~mtpflow.engine.Session` (called in the scheduler thread), or a
    ready :class:`~mtpflow.engine.Session` (MLX arrays are bound to the thread
    that created them, so such a session only works when that is safe).
    ``plugins``: extra plugin objects for the session.  ``max_queued``: rows
    that may wait for a place in the batch beyond its free rows (then
    :meth:`submit` raises a 503).
    """

    def __init__(self, source: Any, *, log=None, max_batch_size: int | None = None,
                 max_queued: int = DEFAULT_MAX_QUEUED, metrics=None, plugins=()):
        from .logprobs import LogprobRecorder

        self.source = source
        self.log = log if log is not None else stdlib_logger(SERVER)
        self.max_batch_size = max_batch_size
        self.max_queued = int(max_queued)
        self.metrics = metrics
        self.plugins = list(plugins)
        self.recorder = LogprobRecorder()
        self.session = None
        self.batcher = None
        self._jobs: dict[str, _Job] = {}
        self._groups: dict[str, list[str]] = {}
        self._cmds: deque = deque()
        self._cond = threading.Condition()
        self._stop = False
        self._queued = 0  # rows submitted, not yet in the batch (guarded by _cond)
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="mtpflow-scheduler", daemon=True)
        self._finished_at: deque = deque()
        self.retry_after = 1
        self.max_rows = 0  # the batch's size limit, once loaded
        self.counters = {"requests_total": 0, "finished_total": 0, "cancelled_total": 0, "errors_total": 0,
                         "timeouts_total": 0}
        self.snapshot: dict = {"active_rows": 0, "waiting": 0, "open_requests": 0, "queued": 0}
        self.vocab_size = 0
        self.tokenizer = None
        self.max_token_chars = 0
        self.config = None
        self.eos_ids: frozenset = frozenset()

    # ---- lifecycle -------------------------------------------------------------------
    def start(self, timeout: float = 600.0) -> "Scheduler":
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError("the model did not load in time")
        if self._load_error is not None:
            raise self._load_error
        atexit.register(self.close)
        return self

    def close(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop

    # ---- API for other threads -------------------------------------------------------
    def _push(self, cmd) -> None:
        with self._cond:
            if self._stop:
                raise APIError("the server is shutting down", status=503, type="server_error", code="shutting_down")
            self._cmds.append(cmd)
            self._cond.notify()

    def _capacity(self) -> int:
        """Rows that may be submitted and not yet in the batch: the queue bound plus the batch's free rows."""
        free = max(0, self.max_rows - self.snapshot.get("active_rows", 0))
        return self.max_queued + free

    def queue_full(self, n: int = 1) -> bool:
        return self._queued + n > self._capacity()

    def _queue_full_error(self) -> APIError:
        return APIError(f"the server is busy: {self._queued} requests are waiting (--max-queued {self.max_queued}); "
                        f"retry after {self.retry_after} s", status=503, type="server_error", code="queue_full",
                        headers={"Retry-After": str(self.retry_after)})

    def submit(self, sub: _Submission) -> None:
        """Queue a submission's rows (503 when the queue is full)."""
        n = len(sub.requests)
        with self._cond:
            if self._stop:
                raise APIError("the server is shutting down", status=503, type="server_error", code="shutting_down")
            if self._queued + n > self._capacity():
                raise self._queue_full_error()
            self._queued += n
            self._cmds.append(("submit", sub))
            self._cond.notify()

    def cancel(self, group: str) -> None:
        """Cancel every row of the HTTP request ``group`` (its rows leave at the next round)."""
        try:
            self._push(("cancel", group))
        except APIError:
            pass

    def call(self, fn: Callable[[Any], Any], timeout: float | None = 120.0) -> Any:
        """Run ``fn(session)`` in the scheduler thread between rounds; return its result."""
        fut: Future = Future()
        self._push(("call", fn, fut))
        return fut.result(timeout)

    # ---- the thread ------------------------------------------------------------------
    def _load(self):
        from ..config import Config
        from ..session import Session, load_session

        observer = RoundObserver(self._jobs, self.metrics)
        extra = [observer, self.recorder, *self.plugins]
        if isinstance(self.source, Config):
            session = load_session(self.source, extra_plugins=extra, log=round_logger())
        else:
            session = self.source() if callable(self.source) and not isinstance(self.source, Session) else self.source
            for p in extra:
                session.plugins.pm.register(p, name=f"mtpflow-server-{type(p).__name__}-{id(p)}")
        cfg = session.config
        if cfg.batch.policy == "static" or self.max_batch_size is not None:
            bc = _evolve(cfg.batch, policy="continuous" if cfg.batch.policy == "static" else cfg.batch.policy,
                         max_batch_size=self.max_batch_size or cfg.batch.max_batch_size)
            cfg = _evolve(cfg, batch=bc)
            session.config = cfg
            session.batch_policy = session.plugins.batch_policies.get(bc.policy)(cfg)
        return session

    def _main(self) -> None:
        try:
            try:
                from .batcher import IsolatingBatcher

                self.session = self._load()
                self.batcher = IsolatingBatcher(self.session)
                self.config = self.session.config
                self.max_rows = int(self.config.batch.max_batch_size)
                self.vocab_size = int(self.session.target.vocab_size)
                self.tokenizer = self.session.tokenizer
                self.max_token_chars = _max_token_chars(self.tokenizer)
                self.eos_ids = frozenset(self.session.target.eos_ids)
                if self.metrics is not None:
                    self.metrics.declare(max(self.session.max_block_size - 1, 0))
                self._publish()
            except BaseException as exc:  # reported by start()
                self._load_error = exc
                return
            finally:
                self._ready.set()
            self._loop()
        except BaseException as exc:  # pragma: no cover - defensive
            self.log.exception("scheduler.crashed", error=str(exc))
        finally:
            with self._cond:
                self._stop = True
            for job in list(self._jobs.values()):
                self._send(job, ("error", job.index, "the server stopped before the request finished"))
            self._jobs.clear()
            self.session = self.batcher = None
            try:
                import mlx.core as mx

                gc.collect()
                mx.synchronize()
                # MLX keeps per-thread streams; destroying them here avoids an
                # abort ("terminate called without an active exception") at exit
                mx.clear_streams()
            except Exception:  # pragma: no cover
                pass

    def _loop(self) -> None:
        released = True
        while True:
            if not released and not self._cmds and self.batcher.idle:
                _release_buffers()  # the batch went idle: hand MLX's freed buffers back to the system
                self.snapshot = {**self.snapshot, "mlx_memory": _mlx_memory()}
                released = True
            with self._cond:
                while not self._cmds and self.batcher.idle and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                cmds = list(self._cmds)
                self._cmds.clear()
            for cmd in cmds:
                self._handle(cmd)
            self._expire()
            if not self.batcher.idle:
                released = False
                t_step = time.perf_counter()
                recoveries = self.batcher.recoveries
                try:
                    # admitted requests' first tokens go out before the batch's round runs
                    for events in self.batcher.step_parts():
                        self._deliver(events, t_step)
                except Exception as exc:  # the isolation itself failed: a bug; end every row
                    self.log.exception("round.failed", error=str(exc))
                    for job in list(self._jobs.values()):
                        self._finish_error(job, f"generation failed: {type(exc).__name__}: {exc}")
                    from .batcher import IsolatingBatcher

                    self.batcher = IsolatingBatcher(self.session)
                if self.metrics is not None and self.batcher.recoveries != recoveries:
                    self.metrics.recoveries.inc(self.batcher.recoveries - recoveries)
            self._publish()

    def _deliver(self, events, t_step: float) -> None:
        for ev in events:
            job = self._jobs.get(ev.request_id)
            if job is None:
                self.batcher.errors.pop(ev.request_id, None)  # a row whose client already left
                continue
            try:
                self._event(job, ev, t_step)
            except Exception as exc:  # this row's text handling failed: end it alone
                self._finish_error(job, f"generation failed: {type(exc).__name__}: {exc}")

    def _publish(self) -> None:
        b = self.batcher
        now = time.perf_counter()
        while self._finished_at and self._finished_at[0] < now - 60.0:
            self._finished_at.popleft()
        if self._finished_at:
            span = max(now - self._finished_at[0], 1.0)
            rate = len(self._finished_at) / span
            self.retry_after = int(min(60, max(1, math.ceil((self._queued + 1) / rate))))
        else:
            self.retry_after = 1
        self.snapshot = {
            "active_rows": b.live,
            "waiting": len(b.waiting),
            "queued": self._queued,
            "max_queued": self.max_queued,
            "open_requests": len(self._jobs),
            "recoveries": b.recoveries,
            **self.counters,
            "session": self.session.stats.as_dict(),
            "prefix_cache": None if self.session.prefix_cache is None else self.session.prefix_cache.describe(),
            "mlx_memory": _mlx_memory(),
        }
        if self.metrics is not None:
            self.metrics.running.set(b.live)
            self.metrics.waiting.set(self._queued)

    def _handle(self, cmd) -> None:
        kind = cmd[0]
        if kind == "submit":
            sub = cmd[1]
            for i, request in enumerate(sub.requests):
                log = self.log.bind(request_id=request.id)
                job = _Job(request, sub, i, log)
                self._jobs[request.id] = job
                self._groups.setdefault(sub.group, []).append(request.id)
                if sub.logprobs is not None:
                    self.recorder.wanted[request.id] = sub.logprobs
                self.counters["requests_total"] += 1
            self.batcher.add(sub.requests)
        elif kind == "cancel":
            for rid in self._groups.get(cmd[1], []):
                job = self._jobs.get(rid)
                if job is None:
                    continue
                self._end(job)
                self.batcher.cancel(rid)
                self.counters["cancelled_total"] += 1
                if self.metrics is not None:
                    self.metrics.outcomes.inc(outcome="cancelled")
                job.log.info("request.cancelled", completion_tokens=len(job.tokens),
                             elapsed_s=round(time.perf_counter() - job.t_arrival, 4))
        elif kind == "call":
            _, fn, fut = cmd
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.session))
                except BaseException as exc:
                    fut.set_exception(exc)

    def _dequeue(self, job: _Job) -> None:
        if job.queued:
            job.queued = False
            with self._cond:
                self._queued -= 1

    def _end(self, job: _Job) -> None:
        """Forget a row that ended (for any reason)."""
        self._jobs.pop(job.rid, None)
        rids = self._groups.get(job.group)
        if rids is not None and not any(r in self._jobs for r in rids):
            del self._groups[job.group]
        self._dequeue(job)
        self.recorder.discard(job.rid)
        if self.metrics is not None:
            self.metrics.generation_tokens.inc(len(job.tokens))

    def _expire(self) -> None:
        now = time.perf_counter()
        for job in [j for j in self._jobs.values() if j.deadline is not None and now >= j.deadline]:
            self.batcher.cancel(job.rid)
            self.counters["timeouts_total"] += 1
            self._finish(job, self._decode(job.tokens), "length", detail="timeout")

    # ---- per-request text ------------------------------------------------------------
    def _decode(self, tokens: list[int]) -> str:
        tok = self.tokenizer
        return tok.decode(tokens) if tok is not None else ""

    def _event(self, job: _Job, ev, t_step: float) -> None:
        if job.t_admit is None:  # its first event: it joined the batch at this step
            job.t_admit = t_step
            self._dequeue(job)
            if self.metrics is not None:
                self.metrics.queue_time.observe(job.t_admit - job.t_submit)
        if ev.finish_reason == "error":
            self._finish_error(job, self.batcher.errors.pop(job.rid, "generation failed"))
            return
        if ev.tokens and job.t_first is None:
            job.t_first = time.perf_counter()
            if self.metrics is not None:
                self.metrics.ttft.observe(job.t_first - job.t_arrival)
        self._advance(job, ev.tokens, ev.finished, ev.finish_reason)

    def _advance(self, job: _Job, tokens: list[int], finished: bool, reason: str | None) -> None:
        if (job.stops or job.logprobs is not None) and tokens:
            entries = (self.recorder.take(job.rid, len(tokens)) if job.logprobs is not None
                       else [None] * len(tokens))
            start = max(0, job.sent - max((len(s) for s in job.stops), default=0))
            for t, e in zip(tokens, entries):  # token by token: a stop ends at the token that completes it
                job.offsets.append(job.text_len)
                job.tokens.append(t)
                job.lp.append(e)
                text = self._decode(job.tokens)
                job.text_len = len(text)
                cut = _find_stop(text, job.stops, start) if job.stops else None
                if cut is not None:
                    self.batcher.cancel(job.rid)
                    self._finish(job, text[:cut], "stop", lp_end=cut)
                    return
        else:
            job.tokens.extend(tokens)
        text = self._decode(job.tokens)
        job.text_len = len(text)
        if finished:
            self._finish(job, text, "length" if reason == "length" else "stop")
            return
        safe = len(text)
        while safe > job.sent and text[safe - 1] == "\ufffd":  # incomplete UTF-8 sequence
            safe -= 1
        if job.stops:
            safe = min(safe, len(text) - _stop_holdback(text, job.stops))
        if safe > job.sent:
            self._send(job, ("delta", job.index, text[job.sent:safe], self._logprobs_upto(job, safe)))
            job.sent = safe

    def _logprobs_upto(self, job: _Job, end: int):
        """``(tokens, entries, offsets)`` not yet sent whose text starts before ``end``; None without logprobs."""
        if job.logprobs is None:
            return None
        i = job.lp_sent
        j = i
        while j < len(job.tokens) and job.offsets[j] < end:
            j += 1
        job.lp_sent = j
        return job.tokens[i:j], job.lp[i:j], job.offsets[i:j]

    def _finish(self, job: _Job, text: str, reason: str, detail: str | None = None,
                lp_end: int | None = None) -> None:
        """End a row that completed (``lp_end``: log-probabilities only of tokens starting before it; default all)."""
        self._end(job)
        self.counters["finished_total"] += 1
        self._finished_at.append(time.perf_counter())
        delta = text[job.sent:]
        lps = self._logprobs_upto(job, math.inf if lp_end is None else lp_end)
        job.sent = len(text)
        usage = job.usage()
        elapsed = time.perf_counter() - job.t_arrival
        extra = {"finish_detail": detail} if detail else {}
        if self.metrics is not None:
            m = self.metrics
            m.success.inc(finished_reason=reason)
            m.outcomes.inc(outcome=detail or "ok")
            m.prompt_tokens.inc(usage["prompt_tokens"])
            m.e2e.observe(elapsed)
        job.log.info("request.done", finish_reason=reason, elapsed_s=round(elapsed, 4), **extra, **usage)
        self._send(job, ("done", job.index, delta, reason, usage, job.round_produced, lps, detail))

    def _finish_error(self, job: _Job, message: str) -> None:
        self._end(job)
        self.batcher.cancel(job.rid)
        self.counters["errors_total"] += 1
        if self.metrics is not None:
            self.metrics.outcomes.inc(outcome="error")
        job.log.info("request.failed", error=message, completion_tokens=len(job.tokens))
        self._send(job, ("error", job.index, message))

    @staticmethod
    def _send(job: _Job, msg) -> None:
        try:
            job.loop.call_soon_threadsafe(job.queue.put_nowait, msg)
        except RuntimeError:  # the event loop is gone
            pass


def _release_buffers() -> None:
    """Free MLX's buffer cache (buffers of finished requests kept for reuse): an idle server does
    not keep the memory of its last burst (``GET /v1/stats``' ``mlx_memory.cache`` reads 0)."""
    import mlx.core as mx

    mx.clear_cache()


def _mlx_memory() -> dict:
    """MLX's allocator counters in bytes: arrays alive, freed buffers kept for reuse, the peak."""
    import mlx.core as mx

    return {"active": mx.get_active_memory(), "cache": mx.get_cache_memory(), "peak": mx.get_peak_memory()}


def _evolve(inst, **changes):
    import attrs

    return attrs.evolve(inst, **changes)


def _max_token_chars(tokenizer) -> int:
    """The longest token's text, in characters (an upper bound on characters per token)."""
    if tokenizer is None:
        return 0
    try:
        return max(len(t) for t in tokenizer.get_vocab())
    except Exception:  # a tokenizer without a vocabulary listing: no pre-check
        return 0


def _find_stop(text: str, stops: list[str], start: int) -> int | None:
    best = None
    for s in stops:
        i = text.find(s, start)
        if i >= 0 and (best is None or i < best):
            best = i
    return best


def _stop_holdback(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    n = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), n, -1):
            if text.endswith(s[:k]):
                n = k
                break
    return n
