"""An OpenAI-compatible HTTP server (``mtpflow serve``).

Architecture
------------
* One **scheduler thread** owns the :class:`~mtpflow.engine.Session` and an
  :class:`~mtpflow.serve_batcher.IsolatingBatcher` with the ``continuous``
  batch policy: concurrent requests decode together, rows leave when they
  finish and new requests join between rounds.  MLX streams are per thread,
  so the session is *loaded inside* that thread; everything that touches MLX
  runs there (:meth:`Scheduler.call` runs any function there, e.g. a
  reference decode).  When idle the scheduler sleeps on a condition variable.
* HTTP handlers (Starlette, run by uvicorn) read the body (at most
  ``max_body_size`` bytes, else **413**), then parse, validate and tokenize it
  **in a small thread pool** -- never on the event loop, so a big body cannot
  stall ``/health`` -- and submit the request through a thread-safe command
  queue; the scheduler sends text deltas back through a per-request
  :class:`asyncio.Queue` (``loop.call_soon_threadsafe``).

Isolation
---------
Every request is validated completely before it reaches the scheduler: the
JSON (valid UTF-8, nesting at most ``MAX_JSON_DEPTH`` levels, no lone UTF-16
surrogates in any string), every field's type and range (``seed`` in
``[0, 2**63)``, ``temperature`` in ``[0, 100]``, ``top_p`` in ``(0, 1]``,
``top_k >= 0``, ``min_p`` in ``[0, 1]``, ``n`` in ``[1, MAX_N]``,
``max_time`` in ``(0, 86400]``, at most ``MAX_STOP_STRINGS`` stop strings of
at most ``MAX_STOP_LENGTH`` characters, token ids inside the vocabulary),
the tokenization and the context limit.  Each bad input gets one clear line
in an OpenAI-style error body (``{"error": {"message", "type", "param",
"code"}}``) with status 400, 413 (body too large) or 503 (queue full).  An
error raised while decoding ends the row that raised it alone (the
:mod:`~mtpflow.serve_batcher` finds it by running the rows of the failing
step alone); the other rows continue and complete.  That request gets a 500
(a stream: an error event) whose message names the exception.

Backpressure, cancellation, deadlines
-------------------------------------
* At most ``max_queued`` rows (``--max-queued``, default
  ``DEFAULT_MAX_QUEUED``) wait for a place in the batch, beyond the rows it
  has free; past that a request is answered **503** with ``Retry-After``
  (seconds, from the recent rate of finished requests; the official
  ``openai`` client retries by itself).  The time a request waited is
  ``usage.queue_time_s`` and the histogram ``vllm:request_queue_time_seconds``.
* A client that disconnects -- streaming or not -- cancels its rows at the
  next round.
* ``max_time`` (request field, seconds since the request arrived) and
  ``--request-timeout`` (the server's default and ceiling) set a
  **deadline**: at the first round boundary past it the row stops and the
  response returns what it has, with ``finish_reason: "length"`` (the output
  was cut by a limit, the one value every OpenAI client knows; strictly
  typed clients reject unknown finish reasons) and the extension
  ``"finish_detail": "timeout"`` on the choice.  A request still queued at
  its deadline ends the same way with empty text.

Hardening
---------
* **Media**: images come as ``data:`` URLs.  Local paths (absolute, relative,
  ``file://``) are refused with one message whatever the file system holds,
  unless they resolve (symlinks included) to a file under
  ``--allowed-local-media-path DIR``.  Each image's width and height are read
  from its header (nothing is decoded) and refused past
  ``--max-image-pixels`` (default 4096 x 4096) or, summed over a request,
  ``--max-request-pixels`` (default four such images).  Error messages carry
  no server path (model folders, the home directory).
* **Memory**: the prefix cache (``--prefix-cache-mb``) copies each stored row
  into buffers of its own, so its cap bounds the memory it really holds;
  ``GET /v1/stats`` reports its bytes and MLX's allocator counters.
* **Connections** (:mod:`mtpflow.serve_http`): a connection whose request
  head is not complete ``--header-timeout`` seconds after it opened (or after
  the head's first byte) is closed; idle keep-alive connections close after
  ``--timeout-keep-alive``; a head past ``--max-header-size`` is a 400; past
  ``--limit-concurrency`` connections + requests new requests get 503.
* **Startup**: ``--host`` / ``--port`` are checked and the socket bound before
  the model loads (a one-line error); "serving on ..." is printed once the
  server listens.

Endpoints: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (``stream: true`` = server-sent events in the
OpenAI chunk format, ending with ``data: [DONE]``), ``GET /v1/stats`` (JSON)
and ``GET /metrics`` (Prometheus text format, :mod:`mtpflow.serve_metrics`:
vLLM's names -- ``vllm:spec_decode_num_drafts``, ``..._draft_tokens``,
``..._accepted_tokens``, ``..._accepted_tokens_per_pos{position}``, queue,
first-token and end-to-end latency histograms, request counters).

Request fields: ``model``, ``prompt`` (string, list of ids, or a one-element
list of either) / ``messages``, ``max_tokens`` (chat: also
``max_completion_tokens``), ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``seed``, ``stop`` (string or list of strings: the text is cut before the
first stop string and the row is cancelled), ``stream``, ``n`` (choices of
one prompt, prefilled once when they join the batch together; with a
``seed``, choice ``i`` uses ``seed + i``), ``logprobs`` (completions: the
number of alternatives, 0-5; chat: a boolean, with ``top_logprobs`` 0-20 --
OpenAI's shapes, from the target's processed distribution, the same with and
without speculation: :mod:`mtpflow.serve_logprobs`), ``max_time`` and the
extension ``speculative`` (``false`` decodes that request with the target
alone inside the shared batch), ``logit_bias`` (token ids inside the
vocabulary -> values in ``[-100, 100]``), ``frequency_penalty`` and
``presence_penalty`` (``[-2, 2]``, OpenAI's definition over the completion's
tokens; on the speculative path each verified position counts the drafts
before it, so the output equals target-only decoding), ``response_format``
(a 400 at validation when the tokenizer cannot be constrained).  Completions'
``echo``, ``best_of`` (other than 1) and ``suffix`` are a 400 naming the
field.  Other fields are ignored.  Sampling
defaults come from the config's ``[sampling]`` table (temperature 0 = greedy
unless configured otherwise).  A request with ``temperature > 0`` and no
``seed`` gets a random seed.

Chat prompts use the tokenizer's chat template.  **Fallback** when the
tokenizer has none: every message is rendered as ``"{role}: {content}\\n"``
and ``"assistant:"`` is appended as the generation prompt, then encoded.

``usage``: ``prompt_tokens``, ``completion_tokens``, ``total_tokens`` plus
``draft_tokens`` (drafts proposed for this request), ``accepted_tokens``,
``rounds`` (decoding rounds the request took part in), ``tau`` (tokens per
target forward for this request, bonus included, as
:func:`mtpflow.metrics.tau`; the first token, sampled at prefill, is not part
of a round; ``null`` before any round) and ``queue_time_s`` (seconds from
submission to joining the batch; with ``n > 1`` the longest).  With ``n > 1``
the counts are summed over the choices (the prompt counts once).

The log (stdlib logger ``mtpflow.server``, see :mod:`mtpflow.logs`) holds
**one line per request** (per choice with ``n > 1``) when it ends:
``request.done`` (with its usage, ``elapsed_s``, and ``finish_detail`` after
a deadline), ``request.cancelled``, ``request.failed`` or, for a request
refused before decoding, ``request.rejected`` (status, code, param).  The
engine's round events are DEBUG records of ``mtpflow.rounds``
(``mtpflow serve --log-level debug``).  The library never calls
``structlog.configure()``.

Load tests: ``python -m mtpflow.loadtest`` (:mod:`mtpflow.loadtest`; with
``--faults`` it loads :mod:`mtpflow.serve_faults`, whose requests fail while
decoding, next to the good ones).

Nothing here imports mlx or starlette at module level.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import gc
import json
import math
import os
import secrets
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from mtpflow import hookimpl
from mtpflow.logs import SERVER, round_logger, stdlib_logger
from mtpflow.metrics import tau

DEFAULT_MAX_CONTEXT = 8192
#: ``--prefix-cache-mb``: MiB of finished requests' K/V kept for reuse
DEFAULT_PREFIX_CACHE_MB = 256
#: rows that may wait for a place in the batch before requests get 503
DEFAULT_MAX_QUEUED = 128
#: the largest request body, in bytes (``--max-body-size``)
DEFAULT_MAX_BODY_SIZE = 8 * 1024 * 1024
MAX_JSON_DEPTH = 64
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_N = 16
MAX_TIME = 86400.0
SEED_LIMIT = 2**63
#: entries of one request's ``logit_bias`` (values in [-100, 100], as OpenAI)
MAX_LOGIT_BIAS = 1024
#: OpenAI fields this server refuses rather than ignore: completions' ``echo``, ``best_of``, ``suffix``
UNSUPPORTED_FIELDS = {"echo": False, "best_of": 1, "suffix": None}
#: bytes of an oversized body read (and dropped) so the client sees the 413
_DRAIN_LIMIT = 64 * 1024 * 1024


# --------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------
class APIError(Exception):
    """An error answered with an OpenAI-style body."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 status: int = 400, type: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


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
            from .serve_batcher import PROBE_SUFFIX

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
        from .serve_logprobs import LogprobRecorder

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
        from .config import Config
        from .engine import Session, load_session

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
                from .serve_batcher import IsolatingBatcher

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
        while True:
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
                    from .serve_batcher import IsolatingBatcher

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


# --------------------------------------------------------------------------------------
# request validation (runs in the handlers' thread pool)
# --------------------------------------------------------------------------------------
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _show(v) -> str:
    try:
        return json.dumps(v)[:80]
    except (TypeError, ValueError):  # pragma: no cover
        return type(v).__name__


def _opt(body: dict, name: str, check, what: str, default=None):
    v = body.get(name)
    if v is None:
        return default
    if not check(v):
        raise APIError(f"'{name}' must be {what} (got {_show(v)})", param=name, code="invalid_type")
    return v


def _path(parts) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "body"


def parse_body(raw: bytes) -> dict:
    """The JSON object of a request body, or an :class:`APIError`: not UTF-8,
    not JSON, nested deeper than :data:`MAX_JSON_DEPTH`, or a string holding
    a lone UTF-16 surrogate (which no tokenizer can encode)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(f"the body is not valid UTF-8 (byte {exc.start}: {raw[exc.start:exc.start + 1]!r})",
                       code="invalid_json") from None
    try:
        body = json.loads(text)
    except RecursionError:
        raise APIError(f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels", code="invalid_json") from None
    except ValueError as exc:  # JSONDecodeError, and integers with too many digits
        raise APIError(f"could not parse the JSON body: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError("the JSON body must be an object", code="invalid_json")
    # one walk: depth and strings (an explicit stack: deep bodies cannot recurse here)
    stack = [(body, 1, ())]
    while stack:
        v, depth, where = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as exc:
                p = _path(where)
                raise APIError(f"'{p}' holds a lone UTF-16 surrogate (\\u{ord(v[exc.start]):04x} at character "
                               f"{exc.start}); text must be valid Unicode", param=p, code="invalid_value") from None
            continue
        if isinstance(v, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise APIError(f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
            items = v.items() if isinstance(v, dict) else enumerate(v)
            for k, x in items:
                if isinstance(k, str):
                    stack.append((k, depth, where))
                if isinstance(x, (str, dict, list)):
                    stack.append((x, depth + 1, where + (k,)))
    return body


class _Params:
    pass


def _response_format(body: dict, structured_error: Callable[[], str | None] = lambda: None) -> str | None:
    """The llguidance grammar of ``response_format`` (``json_object``,
    ``json_schema``, and the extensions ``regex`` / ``grammar`` (Lark)), or None.
    ``structured_error()``: why this server's tokenizer cannot constrain output
    (None when it can), asked only when a grammar is requested."""
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise APIError("'response_format' must be an object with a string 'type'", param="response_format", code="invalid_type")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind not in ("json_object", "json_schema", "regex", "grammar"):
        raise APIError(f"response_format type {kind!r} is not supported (text, json_object, json_schema, regex, "
                       "grammar)", param="response_format", code="invalid_value")
    from ._extras import MissingExtra
    from .structured import grammar

    if kind == "json_schema":
        spec = rf.get("json_schema")
        spec = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(spec, dict):
            raise APIError("'response_format.json_schema.schema' must be an object", param="response_format",
                           code="invalid_type")
    elif kind in ("regex", "grammar"):
        spec = rf.get(kind)
        if not isinstance(spec, str) or not spec:
            raise APIError(f"'response_format.{kind}' must be a non-empty string", param="response_format",
                           code="invalid_type")
    try:
        g = grammar({"json_object": "json", "grammar": "lark"}.get(kind, kind), None if kind == "json_object" else spec)
    except MissingExtra as exc:
        raise APIError(f"response_format needs structured output on this server: {exc}", param="response_format",
                       code="unsupported") from None
    except ValueError as exc:
        one_line = " ".join(str(exc).split())
        raise APIError(f"response_format: {one_line}", param="response_format", code="invalid_value") from None
    why = structured_error()
    if why is not None:
        raise APIError(f"response_format is not available with this model: {why}", param="response_format",
                       code="unsupported")
    return g


def _parse_common(body: dict, app_cfg: dict, chat: bool) -> _Params:
    p = _Params()
    p.grammar = _response_format(body, app_cfg.get("structured_error", lambda: None))
    model = _opt(body, "model", lambda v: isinstance(v, str), "a string")
    if model is not None and model != app_cfg["served_model_name"]:
        raise APIError(f"the model '{model}' does not exist; this server serves '{app_cfg['served_model_name']}'",
                       param="model", code="model_not_found")
    mt = _opt(body, "max_tokens", _is_int, "an integer")
    if chat and mt is None:
        mt = _opt(body, "max_completion_tokens", _is_int, "an integer")
    if mt is not None and mt < 1:
        raise APIError(f"'max_tokens' must be at least 1 (got {mt})", param="max_tokens", code="invalid_value")
    p.max_tokens = mt
    sc = app_cfg["sampling"]
    p.temperature = float(_opt(body, "temperature", _is_num, "a number", sc.temperature))
    if not 0.0 <= p.temperature <= 100.0:
        raise APIError("'temperature' must be in [0, 100]", param="temperature", code="invalid_value")
    p.top_p = float(_opt(body, "top_p", _is_num, "a number", sc.top_p))
    if not 0.0 < p.top_p <= 1.0:
        raise APIError("'top_p' must be in (0, 1]", param="top_p", code="invalid_value")
    p.top_k = _opt(body, "top_k", _is_int, "an integer", sc.top_k)
    if p.top_k < 0:
        raise APIError("'top_k' must be >= 0", param="top_k", code="invalid_value")
    p.min_p = float(_opt(body, "min_p", _is_num, "a number", sc.min_p))
    if not 0.0 <= p.min_p <= 1.0:
        raise APIError("'min_p' must be in [0, 1]", param="min_p", code="invalid_value")
    p.seed = _opt(body, "seed", _is_int, "an integer", sc.seed)
    if p.seed is not None and not 0 <= p.seed < SEED_LIMIT:
        raise APIError(f"'seed' must be in [0, 2**63) (got {_show(p.seed)})", param="seed", code="invalid_value")
    stop = body.get("stop")
    if stop is None:
        p.stops = []
    elif isinstance(stop, str):
        p.stops = [stop] if stop else []
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        p.stops = [s for s in stop if s]
    else:
        raise APIError("'stop' must be a string or a list of strings", param="stop", code="invalid_type")
    if len(p.stops) > MAX_STOP_STRINGS:
        raise APIError(f"at most {MAX_STOP_STRINGS} stop strings", param="stop", code="invalid_value")
    if any(len(s) > MAX_STOP_LENGTH for s in p.stops):
        raise APIError(f"a stop string has at most {MAX_STOP_LENGTH} characters", param="stop", code="invalid_value")
    p.stream = _opt(body, "stream", lambda v: isinstance(v, bool), "a boolean", False)
    _opt(body, "stream_options", lambda v: isinstance(v, dict), "an object")
    p.speculative = _opt(body, "speculative", lambda v: isinstance(v, bool), "a boolean", True)
    p.n = _opt(body, "n", _is_int, "an integer", 1)
    if not 1 <= p.n <= MAX_N:
        raise APIError(f"'n' must be in [1, {MAX_N}] (got {p.n})", param="n", code="invalid_value")
    p.max_time = _opt(body, "max_time", _is_num, "a number of seconds")
    if p.max_time is not None and not 0.0 < p.max_time <= MAX_TIME:
        raise APIError(f"'max_time' must be in (0, {MAX_TIME:.0f}] seconds", param="max_time", code="invalid_value")
    p.logprobs = _parse_logprobs(body, chat)
    for name in ("frequency_penalty", "presence_penalty"):
        v = float(_opt(body, name, _is_num, "a number", 0.0))
        if not -2.0 <= v <= 2.0:
            raise APIError(f"'{name}' must be in [-2, 2] (got {_show(body[name])})", param=name, code="invalid_value")
        setattr(p, name, v)
    p.logit_bias = _parse_logit_bias(body, app_cfg.get("vocab_size", 0))
    if not chat:
        for name, neutral in UNSUPPORTED_FIELDS.items():
            if body.get(name) is not None and body[name] != neutral:
                raise APIError(f"'{name}' is not supported by this server; leave it out", param=name,
                               code="unsupported")
    return p


def _parse_logit_bias(body: dict, vocab: int) -> dict[int, float]:
    """``logit_bias``: token ids (JSON object keys) inside the vocabulary, values in [-100, 100]."""
    lb = _opt(body, "logit_bias", lambda v: isinstance(v, dict), "an object of token id -> bias")
    if not lb:
        return {}
    if len(lb) > MAX_LOGIT_BIAS:
        raise APIError(f"'logit_bias' has {len(lb)} entries; at most {MAX_LOGIT_BIAS}", param="logit_bias",
                       code="invalid_value")
    out = {}
    for key, val in lb.items():
        if not (key.isascii() and key.isdigit()):
            raise APIError(f"'logit_bias' keys must be token ids (got {_show(key)})", param="logit_bias",
                           code="invalid_value")
        tok = int(key)
        if not 0 <= tok < vocab:
            raise APIError(f"'logit_bias' token id {tok} is outside the vocabulary (0..{vocab - 1})",
                           param="logit_bias", code="invalid_value")
        if not _is_num(val) or not -100.0 <= val <= 100.0:
            raise APIError(f"'logit_bias' values must be numbers in [-100, 100] (got {_show(val)} for {tok})",
                           param="logit_bias", code="invalid_value")
        out[tok] = float(val)
    return out


def _parse_logprobs(body: dict, chat: bool) -> int | None:
    """The number of alternatives per token, or None (no logprobs)."""
    from .serve_logprobs import MAX_COMPLETION_LOGPROBS, MAX_TOP_LOGPROBS

    if chat:
        on = _opt(body, "logprobs", lambda v: isinstance(v, bool), "a boolean", False)
        top = _opt(body, "top_logprobs", _is_int, "an integer")
        if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
            raise APIError(f"'top_logprobs' must be in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs",
                           code="invalid_value")
        if top is not None and not on:
            raise APIError("'top_logprobs' needs 'logprobs': true", param="top_logprobs", code="invalid_value")
        return (top or 0) if on else None
    n = _opt(body, "logprobs", _is_int, "an integer")
    if n is not None and not 0 <= n <= MAX_COMPLETION_LOGPROBS:
        raise APIError(f"'logprobs' must be in [0, {MAX_COMPLETION_LOGPROBS}]", param="logprobs", code="invalid_value")
    return n


def _too_long(chars: int, limit: int, max_token_chars: int, param: str) -> None:
    """Refuse, without tokenizing, text that cannot fit the context whatever its tokens."""
    if max_token_chars and chars > 2 * limit * max_token_chars:
        raise APIError(f"the prompt has {chars} characters, more than the {limit}-token context limit can hold",
                       param=param, code="context_length_exceeded")


def _encode(tokenizer, text: str, param: str) -> list[int]:
    try:
        return list(tokenizer.encode(text))
    except Exception as exc:
        raise APIError(f"could not tokenize the {param}: {type(exc).__name__}: {exc}", param=param,
                       code="invalid_value") from None


def _prompt_ids(body: dict, tokenizer, vocab: int, limit: int = 0, max_token_chars: int = 0) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if tokenizer is None:
            raise APIError("this model has no tokenizer; send the prompt as a list of token ids", param="prompt")
        _too_long(len(prompt), limit, max_token_chars, "prompt")
        ids = _encode(tokenizer, prompt, "prompt")
    elif isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})",
                           param="prompt", code="invalid_value")
    elif prompt is None:
        raise APIError("'prompt' is required", param="prompt", code="missing_required_parameter")
    elif isinstance(prompt, list):
        raise APIError("'prompt' must be a string or a list of token ids (batched prompts are not supported; "
                       "send one prompt per request)", param="prompt", code="invalid_type")
    else:
        raise APIError("'prompt' must be a string or a list of token ids", param="prompt", code="invalid_type")
    if not ids:
        raise APIError("the prompt is empty", param="prompt", code="invalid_value")
    return ids


def _content_text(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise APIError(f"messages[{i}].content: only text parts are supported",
                               param=f"messages[{i}].content", code="invalid_type")
            parts.append(part["text"])
        return "".join(parts)
    raise APIError(f"messages[{i}].content must be a string or a list of text parts",
                   param=f"messages[{i}].content", code="invalid_type")


def _has_media(msgs) -> bool:
    return isinstance(msgs, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") in ("image_url", "input_audio") for p in m["content"])
        for m in msgs
    )


def _chat_media(body: dict, session, policy=None):
    """``(prompt ids, media)`` of chat messages with image / audio parts (data URLs, and
    local files under ``policy.local_root`` only: a remote URL is a 400, never fetched;
    images over ``policy``'s pixel limits are a 400 before they are decoded)."""
    from ._extras import MissingExtra
    from .media import MediaError, MediaPolicy, encode_prompt_with_media, split_content_parts

    try:
        msgs, images, audio = split_content_parts(body["messages"], policy)
        return encode_prompt_with_media(session, msgs, images, audio, policy=policy or MediaPolicy())
    except (MediaError, MissingExtra) as exc:
        raise APIError(str(exc), param="messages", code="invalid_value") from None


def render_chat_fallback(messages: list[dict]) -> str:
    """The prompt used when the tokenizer has no chat template."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def _chat_ids(body: dict, tokenizer, limit: int = 0, max_token_chars: int = 0) -> list[int]:
    msgs = body.get("messages")
    if msgs is None:
        raise APIError("'messages' is required", param="messages", code="missing_required_parameter")
    if not isinstance(msgs, list) or not msgs:
        raise APIError("'messages' must be a non-empty list", param="messages", code="invalid_type")
    norm = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(f"messages[{i}] must be an object with a string 'role'", param=f"messages[{i}]",
                           code="invalid_type")
        norm.append({"role": m["role"], "content": _content_text(m.get("content"), i)})
    if tokenizer is None:
        raise APIError("this model has no tokenizer; use /v1/completions with token ids", param="messages")
    _too_long(sum(len(m["content"]) + len(m["role"]) for m in norm), limit, max_token_chars, "messages")
    if getattr(tokenizer, "chat_template", None):
        try:
            out = tokenizer.apply_chat_template(norm, add_generation_prompt=True)
        except Exception as exc:
            raise APIError(f"the chat template rejected the messages: {exc}", param="messages") from None
        if isinstance(out, dict):
            out = out["input_ids"]
        ids = list(out)
    else:
        ids = _encode(tokenizer, render_chat_fallback(norm), "messages")
    if not ids:
        raise APIError("the messages encode to no tokens", param="messages", code="invalid_value")
    return ids


# --------------------------------------------------------------------------------------
# the ASGI app
# --------------------------------------------------------------------------------------
def _served_name(cfg) -> str:
    name = cfg.model.model
    if name is None:
        from .engine import DEFAULT_TARGET

        return DEFAULT_TARGET
    p = Path(name).expanduser()
    return p.resolve().name if p.is_dir() else name


def _structured_probe(sched: Scheduler) -> Callable[[], str | None]:
    """``probe()``: why this model's tokenizer cannot constrain output (llguidance
    needs to map its tokens to bytes), or None; found out once, at the first
    request with a ``response_format``, and remembered."""
    lock, seen = threading.Lock(), []

    def probe() -> str | None:
        with lock:
            if not seen:
                why = None
                if sched.tokenizer is None:
                    why = "it has no tokenizer"
                else:
                    from .structured import GrammarMasks

                    try:
                        GrammarMasks(sched.tokenizer, sched.vocab_size, sched.eos_ids)
                    except Exception as exc:  # e.g. a tokenizer without a byte decoder
                        why = f"llguidance cannot read its tokenizer ({type(exc).__name__}: {exc})"
                seen.append(why)
            return seen[0]

    return probe


def _scrubber(cfg, session) -> Callable[[str], str]:
    """A function that replaces the server's own paths (the model folders, resolved or
    not, and the home directory) in an error message: a client learns no server path."""
    found = set()
    for p in (cfg.model.model, cfg.model.draft_model, getattr(session.target, "path", None),
              getattr(session.drafter, "path", None)):
        if p is None:
            continue
        for form in (str(p), str(Path(p).expanduser()), os.path.realpath(Path(p).expanduser())):
            if os.path.isabs(form) and len(form) > 1:
                found.add(form)
    home = os.path.expanduser("~")
    pairs = [(f, "<model>") for f in sorted(found, key=len, reverse=True)]
    if len(home) > 1:
        pairs.append((home, "~"))

    def scrub(message: str) -> str:
        for path, repl in pairs:
            message = message.replace(path, repl)
        return message

    return scrub


def create_app(session_or_config: Any, *, served_model_name: str | None = None,
               max_context: int | None = None, max_batch_size: int | None = None, log=None,
               max_queued: int | None = None, max_body_size: int | None = None,
               request_timeout: float | None = None, plugins=(), media=None):
    """Build the Starlette app and start its scheduler thread (the model loads now).

    ``session_or_config``: a :class:`~mtpflow.config.Config` (recommended), a
    zero-argument session factory, or a :class:`~mtpflow.engine.Session` (see
    :class:`Scheduler`).  ``max_queued``: rows that may wait for the batch
    (default :data:`DEFAULT_MAX_QUEUED`); ``max_body_size``: bytes (default
    :data:`DEFAULT_MAX_BODY_SIZE`); ``request_timeout``: the default and
    largest ``max_time`` in seconds (default: none); ``plugins``: extra plugin
    objects for the session; ``media``: a :class:`~mtpflow.media.MediaPolicy`
    (default: no local files, the default pixel limits).  The scheduler is reachable as
    ``app.state.scheduler``, the metrics as ``app.state.metrics``; both stop
    at the app's lifespan shutdown (or at process exit).
    """
    from contextlib import asynccontextmanager

    from ._extras import require

    require("serve", "starlette")
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect
    from starlette.requests import Request as HTTPRequest
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    from .serve_logprobs import TokenText, chat_content, completion_logprobs
    from .serve_metrics import CONTENT_TYPE, ServerMetrics

    # the served name is known only once the config is: metrics are labelled after loading
    metrics = ServerMetrics("")
    sched = Scheduler(session_or_config, log=log, max_batch_size=max_batch_size,
                      max_queued=DEFAULT_MAX_QUEUED if max_queued is None else max_queued,
                      metrics=metrics, plugins=plugins).start()
    cfg = sched.config
    name = served_model_name or _served_name(cfg)
    metrics.registry.base = (("model_name", name),)
    app_cfg = {
        "served_model_name": name,
        "max_context": int(max_context or DEFAULT_MAX_CONTEXT),
        "sampling": cfg.sampling,
        "default_max_tokens": cfg.generation.max_tokens,
        "created": int(time.time()),
        "max_body_size": int(max_body_size or DEFAULT_MAX_BODY_SIZE),
        "request_timeout": request_timeout,
        "media": media,
        "vocab_size": sched.vocab_size,
        # the configured acceptance sampler processes logits per request (the "greedy" one takes the argmax)
        "per_request_processing": hasattr(sched.session.sampler, "sampling_of"),
    }
    scrub = _scrubber(cfg, sched.session)
    app_cfg["structured_error"] = _structured_probe(sched)
    pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="mtpflow-http")
    token_text = TokenText(sched.tokenizer)

    class SSEResponse(StreamingResponse):
        def __init__(self, content, on_close):
            super().__init__(content, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            self.on_close = on_close

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                self.on_close()

    async def read_body(request: HTTPRequest) -> bytes:
        limit = app_cfg["max_body_size"]
        declared = request.headers.get("content-length")
        try:
            over = declared is not None and int(declared) > limit
        except ValueError:
            raise APIError("the Content-Length header is not a number", code="invalid_header") from None
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if over or size > limit:
                    # keep reading (and dropping) what the client sends, so it sees the 413
                    over = True
                    if size > _DRAIN_LIMIT:
                        break
                    continue
                chunks.append(chunk)
        except ClientDisconnect:
            raise APIError("the client went away", status=499, code="client_closed") from None
        if over:
            raise APIError(f"the request body is larger than this server's limit of {limit} bytes (--max-body-size)",
                           status=413, code="request_too_large")
        return b"".join(chunks)

    def build_requests(ids: list[int], p: _Params, rid: str, param: str, media=None) -> list:
        from .state import Request, SamplingParams

        limit = app_cfg["max_context"]
        mt = p.max_tokens
        if mt is None:
            mt = min(app_cfg["default_max_tokens"], limit - len(ids))
            if mt < 1:
                raise APIError(f"the prompt has {len(ids)} tokens; this server's context limit is {limit}",
                               param=param, code="context_length_exceeded")
        if len(ids) + mt > limit:
            raise APIError(f"prompt ({len(ids)} tokens) + max_tokens ({mt}) exceeds the context limit of {limit} tokens",
                           param=param, code="context_length_exceeded")
        out = []
        for i in range(p.n):
            seed = p.seed
            if seed is not None:
                seed = (seed + i) % SEED_LIMIT
            elif p.temperature > 0:
                seed = secrets.randbits(31)  # unseeded rows would otherwise all share key(0)
            sp = SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
                                repetition_penalty=cfg.sampling.repetition_penalty, seed=seed, grammar=p.grammar,
                                logit_bias=p.logit_bias, frequency_penalty=p.frequency_penalty,
                                presence_penalty=p.presence_penalty)
            # what engine.make_request builds, without touching the session from this thread
            out.append(Request(id=rid if p.n == 1 else f"{rid}-{i}", prompt=list(ids), max_tokens=mt, sampling=sp,
                               stop_ids=sched.eos_ids, speculative=p.speculative, media=media))
        return out

    def prepare(raw: bytes, chat: bool, rid: str):
        """Parse, validate and tokenize (in the pool, off the event loop)."""
        body = parse_body(raw)
        p = _parse_common(body, app_cfg, chat)
        if not app_cfg["per_request_processing"]:
            for name in ("logit_bias", "frequency_penalty", "presence_penalty"):
                if getattr(p, name):
                    raise APIError(f"'{name}' needs the rejection sampler; this server is configured with "
                                   f"[sampling] sampler = {cfg.sampling.sampler!r}", param=name, code="unsupported")
        limit, mtc = app_cfg["max_context"], sched.max_token_chars
        media = None
        if chat and _has_media(body.get("messages")):
            ids, media = _chat_media(body, sched.session, app_cfg["media"])
        elif chat:
            ids = _chat_ids(body, sched.tokenizer, limit, mtc)
        else:
            ids = _prompt_ids(body, sched.tokenizer, sched.vocab_size, limit, mtc)
        return p, build_requests(ids, p, rid, "messages" if chat else "prompt", media)

    def deadline_of(p: _Params, t_arrival: float) -> float | None:
        limits = [t for t in (p.max_time, app_cfg["request_timeout"]) if t is not None]
        return t_arrival + min(limits) if limits else None

    def format_logprobs(lps, chat: bool, want_top: bool):
        if lps is None:
            return None
        toks, entries, offsets = lps
        if chat:
            return {"content": chat_content(toks, entries, token_text), "refusal": None}
        return completion_logprobs(toks, entries, offsets, token_text, want_top)

    async def watch_disconnect(request: HTTPRequest, queue: asyncio.Queue) -> None:
        # the body has been read: the next ASGI message is the client going away
        try:
            while True:
                msg = await request.receive()
                if msg["type"] == "http.disconnect":
                    queue.put_nowait(("disconnect",))
                    return
        except Exception:  # pragma: no cover - the connection is gone either way
            return

    async def run(request: HTTPRequest, chat: bool):
        t_arrival = time.perf_counter()
        if sched.queue_full():  # cheap refusal before reading and tokenizing
            raise sched._queue_full_error()
        raw = await read_body(request)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        loop = asyncio.get_running_loop()
        p, reqs = await loop.run_in_executor(pool, prepare, raw, chat, rid)
        queue: asyncio.Queue = asyncio.Queue()
        sched.submit(_Submission(rid, reqs, loop, queue, p.stops, deadline=deadline_of(p, t_arrival),
                                 logprobs=p.logprobs, t_arrival=t_arrival))
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        n = len(reqs)
        want_top = bool(p.logprobs)

        def choice_of(i: int, text: str | None, finish: str | None, lps=None, first: bool = False,
                      detail: str | None = None, stream: bool = True) -> dict:
            lp = format_logprobs(lps, chat, want_top)
            if chat:
                if stream:
                    delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
                    c = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
                else:
                    c = {"index": i, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                         "finish_reason": finish}
            else:
                c = {"index": i, "text": text or "", "logprobs": lp, "finish_reason": finish}
            if detail:
                c["finish_detail"] = detail
            return c

        def chunk(choice: dict, usage: dict | None = None) -> str:
            d = {"id": rid, "object": obj + (".chunk" if chat else ""), "created": created, "model": name,
                 "choices": [choice]}
            if usage is not None:
                d["usage"] = usage
            return f"data: {json.dumps(d)}\n\n"

        if p.stream:
            state = {"done": False}

            async def events():
                try:
                    if chat:
                        for i in range(n):
                            yield chunk(choice_of(i, None, None, first=True))
                    pending, usages = n, []
                    while pending:
                        msg = await queue.get()
                        kind = msg[0]
                        if kind == "delta":
                            _, i, text, lps = msg
                            yield chunk(choice_of(i, text, None, lps))
                        elif kind == "done":
                            _, i, text, reason, usage, produced, lps, detail = msg
                            pending -= 1
                            usages.append((usage, produced))
                            if text or (lps is not None and lps[0]):
                                yield chunk(choice_of(i, text, None, lps))
                            yield chunk(choice_of(i, None, reason, detail=detail),
                                        _aggregate_usage(usages) if not pending else None)
                        elif kind == "error":
                            state["done"] = True
                            sched.cancel(rid)
                            err = APIError(scrub(msg[2]), type="server_error", code="generation_failed", status=500)
                            yield f"data: {json.dumps(err.body())}\n\n"
                            yield "data: [DONE]\n\n"
                            return
                    state["done"] = True
                    yield "data: [DONE]\n\n"
                finally:
                    if not state["done"]:
                        state["done"] = True
                        sched.cancel(rid)

            def on_close():
                if not state["done"]:
                    state["done"] = True
                    sched.cancel(rid)  # the client went away: drop its rows at the next round

            return SSEResponse(events(), on_close)

        # non-streaming: collect, cancelling the rows as soon as the client disconnects
        parts: list[list[str]] = [[] for _ in range(n)]
        lp_parts: list[list] = [[[], [], []] for _ in range(n)]
        finals: list = [None] * n
        usages: list = []
        watcher = asyncio.ensure_future(watch_disconnect(request, queue))
        try:
            pending = n
            while pending:
                msg = await queue.get()
                kind = msg[0]
                if kind == "disconnect":
                    sched.cancel(rid)
                    return Response(status_code=499)
                if kind in ("delta", "done"):
                    i, lps = msg[1], msg[3] if kind == "delta" else msg[6]
                    parts[i].append(msg[2])
                    if lps is not None:
                        for acc, xs in zip(lp_parts[i], lps):
                            acc.extend(xs)
                    if kind == "done":
                        pending -= 1
                        finals[i] = (msg[3], msg[7])
                        usages.append((msg[4], msg[5]))
                else:
                    sched.cancel(rid)
                    raise APIError(scrub(msg[2]), type="server_error", code="generation_failed", status=500)
        except asyncio.CancelledError:
            sched.cancel(rid)
            raise
        finally:
            watcher.cancel()
        choices = [choice_of(i, "".join(parts[i]), finals[i][0], lp_parts[i] if p.logprobs is not None else None,
                             detail=finals[i][1], stream=False) for i in range(n)]
        return JSONResponse({"id": rid, "object": obj, "created": created, "model": name,
                             "choices": choices, "usage": _aggregate_usage(usages)})

    async def completions(request: HTTPRequest):
        return await run(request, chat=False)

    async def chat_completions(request: HTTPRequest):
        return await run(request, chat=True)

    async def health(request: HTTPRequest):
        ok = sched.alive
        return JSONResponse({"status": "ok" if ok else "stopped"}, status_code=200 if ok else 503)

    async def models(request: HTTPRequest):
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": app_cfg["created"], "owned_by": "mtpflow",
             "max_context": app_cfg["max_context"]}]})

    async def stats(request: HTTPRequest):
        return JSONResponse({"model": name, "max_context": app_cfg["max_context"],
                             "max_batch_size": cfg.batch.max_batch_size, **sched.snapshot})

    async def prometheus(request: HTTPRequest):
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    async def on_api_error(request, exc: APIError):
        if exc.status != 499 and exc.code != "generation_failed":
            metrics.rejected.inc(status=exc.status)
            sched.log.info("request.rejected", status=exc.status, code=exc.code, param=exc.param,
                           path=request.url.path, error=exc.message[:200])
        exc.message = scrub(exc.message)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers or None)

    async def on_http_error(request, exc: HTTPException):
        err = APIError(str(exc.detail), status=exc.status_code,
                       code="not_found" if exc.status_code == 404 else None)
        return JSONResponse(err.body(), status_code=exc.status_code)

    async def on_error(request, exc: Exception):
        sched.log.exception("request.failed", error=str(exc))
        err = APIError(f"internal error: {type(exc).__name__}", status=500, type="server_error")
        return JSONResponse(err.body(), status_code=500)

    @asynccontextmanager
    async def lifespan(app):
        try:
            yield
        finally:
            await asyncio.to_thread(sched.close)
            pool.shutdown(wait=False, cancel_futures=True)

    app = Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/metrics", prometheus, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/stats", stats, methods=["GET"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        ],
        exception_handlers={APIError: on_api_error, HTTPException: on_http_error, Exception: on_error},
        lifespan=lifespan,
    )
    app.state.scheduler = sched
    app.state.metrics = metrics
    app.state.served_model_name = name
    app.state.max_context = app_cfg["max_context"]
    app.state.max_body_size = app_cfg["max_body_size"]
    return app


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------
def parse_size(text: str) -> int:
    """Bytes from ``"8388608"``, ``"512K"``, ``"8M"`` or ``"1G"`` (binary units)."""
    s = str(text).strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(s[-1:], 1)
    try:
        n = float(s[:-1] if mult != 1 else s) * mult
    except ValueError:
        raise ValueError(f"not a size: {text!r} (e.g. 8M, 512K, 1048576)") from None
    if not n >= 1:
        raise ValueError(f"a size must be at least 1 byte (got {text!r})")
    return int(n)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``mtpflow serve``."""
    parser.add_argument("--model", help="target: local folder or Hugging Face repo id (default: the built-in pair, smollm2-135m + smollm2-135m-mtp); also a packaged name: smollm2-135m, gemma3-270m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b")
    parser.add_argument("--draft-model", help="drafter folder or repo id (default: $MTPFLOW_DRAFT_MODEL)")
    parser.add_argument("--draft-kind", help="drafter kind (default: $MTPFLOW_DRAFT_KIND, else detected)")
    parser.add_argument("--draft-block-size", type=int, help="tokens verified per round (default: $MTPFLOW_DRAFT_BLOCK_SIZE)")
    parser.add_argument("--config", help="TOML config file or a shipped config's name; flags override it (default: none)")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="weights dtype (default float32)")
    parser.add_argument("--set", dest="sets", action="append", metavar="KEY=VALUE", default=[],
                        help="set any config key, e.g. plugins.NAME.key=0.7 (a TOML value); repeatable (default: none)")
    parser.add_argument("--prefix-cache-mb", type=int, default=DEFAULT_PREFIX_CACHE_MB,
                        help="keep the target's K/V of finished requests (an LRU of this many MiB, the memory really "
                             f"held) so a multi-turn chat prefills only its new turn; 0 = off (default "
                             f"{DEFAULT_PREFIX_CACHE_MB})")
    parser.add_argument("--log-level", choices=["warning", "info", "debug"], default="info",
                        help="info: one line per request; debug: also every round (default info)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    parser.add_argument("--max-batch-size", type=int, help="rows decoded together (default: config, 8)")
    parser.add_argument("--served-model-name", help="model name clients must send (default: the target folder name)")
    parser.add_argument("--max-context", type=int, default=None,
                        help=f"limit on prompt + max_tokens per request (default {DEFAULT_MAX_CONTEXT})")
    parser.add_argument("--max-queued", type=int, default=None,
                        help=f"rows that may wait for a place in the batch; past it requests get 503 with "
                             f"Retry-After (default {DEFAULT_MAX_QUEUED})")
    parser.add_argument("--max-body-size", default=None,
                        help=f"largest request body, e.g. 8M or 512K; past it 413 (default "
                             f"{DEFAULT_MAX_BODY_SIZE // 2**20}M)")
    parser.add_argument("--request-timeout", type=float, default=None,
                        help="seconds a request may take from arrival, queue included: the default and the ceiling "
                             "of the request field max_time (default: none)")
    from .media import DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_REQUEST_PIXELS

    parser.add_argument("--allowed-local-media-path", metavar="DIR", default=None,
                        help="let requests name local image files under DIR (absolute, relative to DIR, or file://; "
                             "symlinks are resolved and must stay inside); default: none, images come as data: URLs")
    parser.add_argument("--max-image-pixels", type=int, default=DEFAULT_MAX_IMAGE_PIXELS,
                        help=f"width x height of one image, read from its header; past it 400 before decoding "
                             f"(default {DEFAULT_MAX_IMAGE_PIXELS}, 4096 x 4096)")
    parser.add_argument("--max-request-pixels", type=int, default=DEFAULT_MAX_REQUEST_PIXELS,
                        help=f"pixels of all the images of one request (default {DEFAULT_MAX_REQUEST_PIXELS})")
    from .serve_http import (DEFAULT_HEADER_TIMEOUT, DEFAULT_KEEP_ALIVE, DEFAULT_LIMIT_CONCURRENCY,
                             DEFAULT_MAX_HEADER_SIZE)

    parser.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT,
                        help=f"seconds a connection may take to send its request line and headers; then it is closed "
                             f"(default {DEFAULT_HEADER_TIMEOUT:g})")
    parser.add_argument("--timeout-keep-alive", type=int, default=DEFAULT_KEEP_ALIVE,
                        help=f"seconds an idle keep-alive connection stays open (default {DEFAULT_KEEP_ALIVE})")
    parser.add_argument("--max-header-size", default=None,
                        help=f"largest request line + headers, e.g. 16K; past it 400 (default "
                             f"{DEFAULT_MAX_HEADER_SIZE // 1024}K)")
    parser.add_argument("--limit-concurrency", type=int, default=DEFAULT_LIMIT_CONCURRENCY,
                        help=f"open connections + requests in progress past which new requests get 503; 0 = no limit "
                             f"(default {DEFAULT_LIMIT_CONCURRENCY})")


def serve_config_from_args(args):
    """The :class:`~mtpflow.config.Config` for ``args`` (flags, then env vars, then the file)."""
    from .config import ConfigError, load_config

    block = args.draft_block_size
    if block is None and os.environ.get("MTPFLOW_DRAFT_BLOCK_SIZE"):
        raw = os.environ["MTPFLOW_DRAFT_BLOCK_SIZE"]
        try:
            block = int(raw)
        except ValueError:
            raise ConfigError(f"MTPFLOW_DRAFT_BLOCK_SIZE must be an integer (got {raw!r})") from None
    if args.max_batch_size is not None and args.max_batch_size < 1:
        raise ConfigError("--max-batch-size must be >= 1")
    if args.max_context is not None and args.max_context < 2:
        raise ConfigError("--max-context must be >= 2")
    if getattr(args, "max_queued", None) is not None and args.max_queued < 0:
        raise ConfigError("--max-queued must be >= 0")
    if getattr(args, "max_body_size", None) is not None:
        try:
            parse_size(args.max_body_size)
        except ValueError as exc:
            raise ConfigError(f"--max-body-size: {exc}") from None
    rt = getattr(args, "request_timeout", None)
    if rt is not None and not 0 < rt <= MAX_TIME:
        raise ConfigError(f"--request-timeout must be in (0, {MAX_TIME:.0f}] seconds")
    overrides = {
        "model": {
            "model": args.model,
            "draft_model": args.draft_model or os.environ.get("MTPFLOW_DRAFT_MODEL") or None,
            "draft_kind": args.draft_kind or os.environ.get("MTPFLOW_DRAFT_KIND") or None,
            "dtype": getattr(args, "dtype", None),
        },
        "draft": {"block_size": block},
        "batch": {"max_batch_size": args.max_batch_size, "prefix_cache_mb": getattr(args, "prefix_cache_mb", None)},
    }
    cfg = load_config(args.config, overrides, sets=getattr(args, "sets", None))
    if cfg.batch.policy == "static":
        cfg = _evolve(cfg, batch=_evolve(cfg.batch, policy="continuous"))
    return cfg


def media_limits_from_args(args):
    """The :class:`~mtpflow.media.MediaPolicy` of the flags, checked."""
    from .config import ConfigError
    from .media import DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_REQUEST_PIXELS, MediaPolicy

    root = getattr(args, "allowed_local_media_path", None)
    if root is not None and not Path(root).expanduser().is_dir():
        raise ConfigError(f"--allowed-local-media-path {root!r} is not a directory")
    per_image = getattr(args, "max_image_pixels", DEFAULT_MAX_IMAGE_PIXELS)
    per_request = getattr(args, "max_request_pixels", DEFAULT_MAX_REQUEST_PIXELS)
    if per_image < 1 or per_request < 1:
        raise ConfigError("--max-image-pixels and --max-request-pixels must be >= 1")
    return MediaPolicy(local_root=root, max_image_pixels=per_image, max_request_pixels=per_request)


def _http_limits(args) -> dict:
    """uvicorn's limits from the flags (:func:`mtpflow.serve_http.uvicorn_config`), checked."""
    from .config import ConfigError
    from .serve_http import DEFAULT_HEADER_TIMEOUT, DEFAULT_KEEP_ALIVE, DEFAULT_LIMIT_CONCURRENCY, DEFAULT_MAX_HEADER_SIZE

    ht = getattr(args, "header_timeout", DEFAULT_HEADER_TIMEOUT)
    if not 0 < ht <= MAX_TIME:
        raise ConfigError(f"--header-timeout must be in (0, {MAX_TIME:.0f}] seconds")
    ka = getattr(args, "timeout_keep_alive", DEFAULT_KEEP_ALIVE)
    if ka < 1:
        raise ConfigError("--timeout-keep-alive must be >= 1 second")
    lc = getattr(args, "limit_concurrency", DEFAULT_LIMIT_CONCURRENCY)
    if lc < 0:
        raise ConfigError("--limit-concurrency must be >= 0 (0 = no limit)")
    size = DEFAULT_MAX_HEADER_SIZE
    if getattr(args, "max_header_size", None):
        try:
            size = parse_size(args.max_header_size)
        except ValueError as exc:
            raise ConfigError(f"--max-header-size: {exc}") from None
    return {"header_timeout": ht, "timeout_keep_alive": ka, "limit_concurrency": lc or None,
            "max_header_size": size}


def run_serve(args) -> int:
    """``mtpflow serve``: check the flags, bind the address, load the model and serve until interrupted."""
    from ._extras import require

    require("serve", "starlette", "uvicorn")
    import logging

    from .logs import enable_console
    from .serve_http import bind, serve, uvicorn_config

    enable_console(getattr(logging, args.log_level.upper()))
    cfg = serve_config_from_args(args)
    limits = _http_limits(args)
    media = media_limits_from_args(args)
    sock = bind(args.host, args.port)  # a bad or busy address fails now, not after the model loaded
    try:
        app = create_app(cfg, served_model_name=args.served_model_name, max_context=args.max_context,
                         max_queued=getattr(args, "max_queued", None),
                         max_body_size=parse_size(args.max_body_size) if getattr(args, "max_body_size", None) else None,
                         request_timeout=getattr(args, "request_timeout", None), media=media)
    except BaseException:
        sock.close()
        raise
    host = f"[{args.host}]" if ":" in args.host else args.host
    name = app.state.served_model_name

    def listening(port: int) -> None:
        print(f"mtpflow: serving {name!r} on http://{host}:{port}/v1", flush=True)

    serve(uvicorn_config(app, log_level="info" if args.log_level != "warning" else "warning", **limits), sock,
          listening)
    return 0


__all__ = [
    "APIError", "DEFAULT_MAX_BODY_SIZE", "DEFAULT_MAX_CONTEXT", "DEFAULT_MAX_QUEUED", "RoundObserver", "Scheduler",
    "add_serve_arguments", "create_app", "parse_body", "parse_size", "render_chat_fallback", "run_serve",
    "serve_config_from_args",
]
