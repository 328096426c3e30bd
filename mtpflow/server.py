"""An OpenAI-compatible HTTP server (``mtpflow serve``).

Architecture
------------
* One **scheduler thread** owns the :class:`~mtpflow.engine.Session` and a
  :class:`~mtpflow.engine.Batcher` with the ``continuous`` batch policy:
  concurrent requests decode together, rows leave when they finish and new
  requests join between rounds.  MLX streams are per thread, so the session
  is *loaded inside* that thread; everything that touches MLX runs there
  (:meth:`Scheduler.call` runs any function there, e.g. a reference decode).
* HTTP handlers (Starlette, run by uvicorn) validate and tokenize, then
  submit the request through a thread-safe command queue; the scheduler
  sends text deltas back through a per-request :class:`asyncio.Queue`
  (``loop.call_soon_threadsafe``).  When idle the scheduler sleeps on a
  condition variable.
* Per-request usage (``draft_tokens``, ``accepted_tokens``, ``tau``) comes
  from an ``mtpflow_emit`` observer.  The log (stdlib logger
  ``mtpflow.server``, see :mod:`mtpflow.logs`) holds **one line per
  request** when it ends (``request.done``, ``request.cancelled`` or
  ``request.failed``, with its usage); the engine's round events are DEBUG
  records of ``mtpflow.rounds`` (``mtpflow serve --log-level debug``).  The
  library never calls ``structlog.configure()``.

Endpoints: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (``stream: true`` = server-sent events in the
OpenAI chunk format, ending with ``data: [DONE]``) and ``GET /v1/stats``.

Request fields: ``model``, ``prompt`` (string, list of ids, or a one-element
list of either) / ``messages``, ``max_tokens`` (chat: also
``max_completion_tokens``), ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``seed``, ``stop`` (string or list of strings: the text is cut before the
first stop string and the row is cancelled), ``stream`` and the extension
``speculative`` (``false`` decodes that request with the target alone inside
the shared batch).  Sampling defaults come from the config's ``[sampling]``
table (temperature 0 = greedy unless configured otherwise).  A request with
``temperature > 0`` and no ``seed`` gets a random seed.

Chat prompts use the tokenizer's chat template.  **Fallback** when the
tokenizer has none: every message is rendered as ``"{role}: {content}\\n"``
and ``"assistant:"`` is appended as the generation prompt, then encoded.

``usage``: ``prompt_tokens``, ``completion_tokens``, ``total_tokens`` plus
``draft_tokens`` (drafts proposed for this request), ``accepted_tokens``,
``rounds`` (decoding rounds the request took part in) and ``tau`` (tokens
per target forward for this request, bonus included, as
:func:`mtpflow.metrics.tau`; the first token, sampled at prefill, is not part
of a round; ``null`` before any round).

Nothing here imports mlx or starlette at module level.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import gc
import json
import os
import secrets
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

from mtpflow import hookimpl
from mtpflow.logs import SERVER, round_logger, stdlib_logger
from mtpflow.metrics import tau

DEFAULT_MAX_CONTEXT = 8192
MAX_STOP_STRINGS = 16


# --------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------
class APIError(Exception):
    """An error answered with an OpenAI-style body."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 status: int = 400, type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# --------------------------------------------------------------------------------------
# engine-side helpers
# --------------------------------------------------------------------------------------
class _Job:
    """Host-side bookkeeping of one HTTP request (owned by the scheduler thread)."""

    def __init__(self, request, loop, queue, stops: list[str], log):
        self.request = request
        self.rid = request.id
        self.loop = loop
        self.queue = queue
        self.stops = stops
        self.log = log
        self.tokens: list[int] = []
        self.sent = 0  # characters of text already delivered
        self.rounds = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.round_produced = 0
        self.t0 = time.perf_counter()

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
        }


class RoundObserver:
    """``mtpflow_emit`` plugin: per-request counters (it logs nothing: the
    engine's round events already go to ``mtpflow.rounds``)."""

    def __init__(self, jobs: dict[str, _Job]):
        self.jobs = jobs

    @hookimpl
    def mtpflow_emit(self, session, record, emitted):
        for i, rid in enumerate(emitted):  # record lists are in the order of emitted's keys
            job = self.jobs.get(rid)
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
    """

    def __init__(self, source: Any, *, log=None, max_batch_size: int | None = None):
        self.source = source
        self.log = log if log is not None else stdlib_logger(SERVER)
        self.max_batch_size = max_batch_size
        self.session = None
        self.batcher = None
        self._jobs: dict[str, _Job] = {}
        self._cmds: deque = deque()
        self._cond = threading.Condition()
        self._stop = False
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="mtpflow-scheduler", daemon=True)
        self.counters = {"requests_total": 0, "finished_total": 0, "cancelled_total": 0, "errors_total": 0}
        self.snapshot: dict = {"active_rows": 0, "waiting": 0, "open_requests": 0}
        self.vocab_size = 0
        self.tokenizer = None
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

    def submit(self, request, loop, queue, stops: list[str]) -> None:
        self._push(("submit", request, loop, queue, stops))

    def cancel(self, request_id: str) -> None:
        try:
            self._push(("cancel", request_id))
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

        observer = RoundObserver(self._jobs)
        if isinstance(self.source, Config):
            session = load_session(self.source, extra_plugins=[observer], log=round_logger())
        else:
            session = self.source() if callable(self.source) and not isinstance(self.source, Session) else self.source
            session.plugins.pm.register(observer, name=f"mtpflow-server-observer-{id(observer)}")
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
                from .engine import Batcher

                self.session = self._load()
                self.batcher = Batcher(self.session)
                self.config = self.session.config
                self.vocab_size = int(self.session.target.vocab_size)
                self.tokenizer = self.session.tokenizer
                self.eos_ids = frozenset(self.session.target.eos_ids)
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
                self._send(job, ("error", "the server stopped before the request finished"))
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
            if not self.batcher.idle:
                try:
                    events = self.batcher.step()
                except Exception as exc:
                    self.log.exception("round.failed", error=str(exc))
                    self.counters["errors_total"] += 1
                    for job in list(self._jobs.values()):
                        self._finish_error(job, f"generation failed: {type(exc).__name__}: {exc}")
                    from .engine import Batcher

                    self.batcher = Batcher(self.session)
                    events = []
                for ev in events:
                    job = self._jobs.get(ev.request_id)
                    if job is not None:
                        self._advance(job, ev.tokens, ev.finished, ev.finish_reason)
            self._publish()

    def _publish(self) -> None:
        b = self.batcher
        self.snapshot = {
            "active_rows": b.live,
            "waiting": len(b.waiting),
            "open_requests": len(self._jobs),
            **self.counters,
            "session": self.session.stats.as_dict(),
        }

    def _handle(self, cmd) -> None:
        kind = cmd[0]
        if kind == "submit":
            _, request, loop, queue, stops = cmd
            job = _Job(request, loop, queue, stops, self.log.bind(request_id=request.id))
            self._jobs[request.id] = job
            self.counters["requests_total"] += 1
            self.batcher.add([request])
        elif kind == "cancel":
            job = self._jobs.pop(cmd[1], None)
            if job is not None:
                self.batcher.cancel(job.rid)
                self.counters["cancelled_total"] += 1
                job.log.info("request.cancelled", completion_tokens=len(job.tokens))
        elif kind == "call":
            _, fn, fut = cmd
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.session))
                except BaseException as exc:
                    fut.set_exception(exc)

    # ---- per-request text ------------------------------------------------------------
    def _decode(self, tokens: list[int]) -> str:
        tok = self.tokenizer
        return tok.decode(tokens) if tok is not None else ""

    def _advance(self, job: _Job, tokens: list[int], finished: bool, reason: str | None) -> None:
        if job.stops and tokens:
            start = max(0, job.sent - max(len(s) for s in job.stops))
            for t in tokens:  # token by token: the stop ends at the token that completes it
                job.tokens.append(t)
                text = self._decode(job.tokens)
                cut = _find_stop(text, job.stops, start)
                if cut is not None:
                    self.batcher.cancel(job.rid)
                    self._finish(job, text[:cut], "stop")
                    return
        else:
            job.tokens.extend(tokens)
        text = self._decode(job.tokens)
        if finished:
            self._finish(job, text, "length" if reason == "length" else "stop")
            return
        safe = len(text)
        while safe > job.sent and text[safe - 1] == "\ufffd":  # incomplete UTF-8 sequence
            safe -= 1
        if job.stops:
            safe = min(safe, len(text) - _stop_holdback(text, job.stops))
        if safe > job.sent:
            self._send(job, ("delta", text[job.sent:safe]))
            job.sent = safe

    def _finish(self, job: _Job, text: str, reason: str) -> None:
        self._jobs.pop(job.rid, None)
        self.counters["finished_total"] += 1
        delta = text[job.sent:]
        job.sent = len(text)
        usage = job.usage()
        job.log.info("request.done", finish_reason=reason, elapsed_s=round(time.perf_counter() - job.t0, 4), **usage)
        self._send(job, ("done", delta, reason, usage))

    def _finish_error(self, job: _Job, message: str) -> None:
        self._jobs.pop(job.rid, None)
        self.batcher.cancel(job.rid)
        self._send(job, ("error", message))

    @staticmethod
    def _send(job: _Job, msg) -> None:
        try:
            job.loop.call_soon_threadsafe(job.queue.put_nowait, msg)
        except RuntimeError:  # the event loop is gone
            pass


def _evolve(inst, **changes):
    import attrs

    return attrs.evolve(inst, **changes)


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
# request validation
# --------------------------------------------------------------------------------------
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _opt(body: dict, name: str, check, what: str, default=None):
    v = body.get(name)
    if v is None:
        return default
    if not check(v):
        raise APIError(f"'{name}' must be {what} (got {json.dumps(v)[:80]})", param=name, code="invalid_type")
    return v


class _Params:
    pass


def _parse_common(body: dict, app_cfg: dict, chat: bool) -> _Params:
    p = _Params()
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
    p.stream = _opt(body, "stream", lambda v: isinstance(v, bool), "a boolean", False)
    p.speculative = _opt(body, "speculative", lambda v: isinstance(v, bool), "a boolean", True)
    n = _opt(body, "n", _is_int, "an integer", 1)
    if n != 1:
        raise APIError("only n=1 is supported", param="n", code="invalid_value")
    return p


def _prompt_ids(body: dict, tokenizer, vocab: int) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if tokenizer is None:
            raise APIError("this model has no tokenizer; send the prompt as a list of token ids", param="prompt")
        ids = list(tokenizer.encode(prompt))
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


def render_chat_fallback(messages: list[dict]) -> str:
    """The prompt used when the tokenizer has no chat template."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def _chat_ids(body: dict, tokenizer) -> list[int]:
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
    if getattr(tokenizer, "chat_template", None):
        try:
            out = tokenizer.apply_chat_template(norm, add_generation_prompt=True)
        except Exception as exc:
            raise APIError(f"the chat template rejected the messages: {exc}", param="messages") from None
        if isinstance(out, dict):
            out = out["input_ids"]
        ids = list(out)
    else:
        ids = list(tokenizer.encode(render_chat_fallback(norm)))
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


def create_app(session_or_config: Any, *, served_model_name: str | None = None,
               max_context: int | None = None, max_batch_size: int | None = None, log=None):
    """Build the Starlette app and start its scheduler thread (the model loads now).

    ``session_or_config``: a :class:`~mtpflow.config.Config` (recommended), a
    zero-argument session factory, or a :class:`~mtpflow.engine.Session` (see
    :class:`Scheduler`).  The scheduler is reachable as ``app.state.scheduler``
    and stops at the app's lifespan shutdown (or at process exit).
    """
    from contextlib import asynccontextmanager

    from ._extras import require

    require("serve", "starlette")
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request as HTTPRequest
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    sched = Scheduler(session_or_config, log=log, max_batch_size=max_batch_size).start()
    cfg = sched.config
    name = served_model_name or _served_name(cfg)
    app_cfg = {
        "served_model_name": name,
        "max_context": int(max_context or DEFAULT_MAX_CONTEXT),
        "sampling": cfg.sampling,
        "default_max_tokens": cfg.generation.max_tokens,
        "created": int(time.time()),
    }

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

    async def read_json(request: HTTPRequest) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(f"could not parse the JSON body: {exc}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError("the JSON body must be an object", code="invalid_json")
        return body

    def build_request(ids: list[int], p: _Params, rid: str, param: str):
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
        seed = p.seed
        if seed is None and p.temperature > 0:
            seed = secrets.randbits(31)  # unseeded rows would otherwise all share key(0)
        sp = SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
                            repetition_penalty=cfg.sampling.repetition_penalty, seed=seed)
        # what engine.make_request builds, without touching the session from this thread
        return Request(id=rid, prompt=list(ids), max_tokens=mt, sampling=sp, stop_ids=sched.eos_ids,
                       speculative=p.speculative)

    async def run(request: HTTPRequest, chat: bool):
        body = await read_json(request)
        p = _parse_common(body, app_cfg, chat)
        if chat:
            ids = _chat_ids(body, sched.tokenizer)
        else:
            ids = _prompt_ids(body, sched.tokenizer, sched.vocab_size)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        req = build_request(ids, p, rid, "messages" if chat else "prompt")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        sched.submit(req, loop, queue, p.stops)
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"

        def chunk(text: str | None, finish: str | None, usage: dict | None = None, first: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
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
                        yield chunk(None, None, first=True)
                    while True:
                        msg = await queue.get()
                        if msg[0] == "delta":
                            yield chunk(msg[1], None)
                        elif msg[0] == "done":
                            state["done"] = True
                            if msg[1]:
                                yield chunk(msg[1], None)
                            yield chunk(None, msg[2], msg[3])
                            yield "data: [DONE]\n\n"
                            return
                        else:
                            state["done"] = True
                            err = APIError(msg[1], type="server_error", code="generation_failed", status=500)
                            yield f"data: {json.dumps(err.body())}\n\n"
                            yield "data: [DONE]\n\n"
                            return
                finally:
                    if not state["done"]:
                        state["done"] = True
                        sched.cancel(rid)

            def on_close():
                if not state["done"]:
                    state["done"] = True
                    sched.cancel(rid)  # the client went away: drop its row at the next round

            return SSEResponse(events(), on_close)

        # non-streaming: collect, cancelling the row if the client disconnects
        parts: list[str] = []
        try:
            while True:
                try:
                    msg = await asyncio.wait_for(queue.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        sched.cancel(rid)
                        return JSONResponse({}, status_code=499)
                    continue
                if msg[0] == "delta":
                    parts.append(msg[1])
                elif msg[0] == "done":
                    parts.append(msg[1])
                    text, reason, usage = "".join(parts), msg[2], msg[3]
                    break
                else:
                    raise APIError(msg[1], type="server_error", code="generation_failed", status=500)
        except asyncio.CancelledError:
            sched.cancel(rid)
            raise
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        return JSONResponse({"id": rid, "object": obj, "created": created, "model": name,
                             "choices": [choice], "usage": usage})

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

    async def on_api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

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

    app = Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/stats", stats, methods=["GET"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        ],
        exception_handlers={APIError: on_api_error, HTTPException: on_http_error, Exception: on_error},
        lifespan=lifespan,
    )
    app.state.scheduler = sched
    app.state.served_model_name = name
    app.state.max_context = app_cfg["max_context"]
    return app


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------
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
    parser.add_argument("--log-level", choices=["warning", "info", "debug"], default="info",
                        help="info: one line per request; debug: also every round (default info)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    parser.add_argument("--max-batch-size", type=int, help="rows decoded together (default: config, 8)")
    parser.add_argument("--served-model-name", help="model name clients must send (default: the target folder name)")
    parser.add_argument("--max-context", type=int, default=None,
                        help=f"limit on prompt + max_tokens per request (default {DEFAULT_MAX_CONTEXT})")


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
    overrides = {
        "model": {
            "model": args.model,
            "draft_model": args.draft_model or os.environ.get("MTPFLOW_DRAFT_MODEL") or None,
            "draft_kind": args.draft_kind or os.environ.get("MTPFLOW_DRAFT_KIND") or None,
            "dtype": getattr(args, "dtype", None),
        },
        "draft": {"block_size": block},
        "batch": {"max_batch_size": args.max_batch_size},
    }
    cfg = load_config(args.config, overrides, sets=getattr(args, "sets", None))
    if cfg.batch.policy == "static":
        cfg = _evolve(cfg, batch=_evolve(cfg.batch, policy="continuous"))
    return cfg


def run_serve(args) -> int:
    """``mtpflow serve``: load the model and serve until interrupted."""
    from ._extras import require

    require("serve", "starlette", "uvicorn")
    import uvicorn

    import logging

    from .logs import enable_console

    enable_console(getattr(logging, args.log_level.upper()))
    cfg = serve_config_from_args(args)
    app = create_app(cfg, served_model_name=args.served_model_name, max_context=args.max_context)
    print(f"mtpflow: serving {app.state.served_model_name!r} on http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0


__all__ = [
    "APIError", "DEFAULT_MAX_CONTEXT", "RoundObserver", "Scheduler",
    "add_serve_arguments", "create_app", "render_chat_fallback", "run_serve", "serve_config_from_args",
]
