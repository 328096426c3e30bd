"""The ASGI app of ``mtpflow serve``: route handlers as plain functions over one
:class:`ServerState` (``app.state.server``), built by :func:`create_app` (see
:mod:`mtpflow.serve`).  Nothing here imports starlette at module level."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import secrets
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from .protocol import (
    DEFAULT_MAX_BODY_SIZE, DEFAULT_MAX_CONTEXT, DEFAULT_MAX_QUEUED, SEED_LIMIT, APIError, _chat_ids, _chat_media,
    _has_media, _Params, _parse_common, _prompt_ids, parse_body,
)
from .scheduler import Scheduler, _aggregate_usage, _Submission

#: bytes of an oversized body read (and dropped) so the client sees the 413
_DRAIN_LIMIT = 64 * 1024 * 1024


def _served_name(cfg) -> str:
    name = cfg.model.model
    if name is None:
        from ..resolve import DEFAULT_TARGET

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
                    from ..structured import GrammarMasks

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


class ServerState:
    """What the handlers share: the scheduler, the metrics, the limits (``app_cfg``),
    the validation pool and the text of tokens (for log-probabilities)."""

    def __init__(self, sched: Scheduler, metrics, app_cfg: dict, scrub: Callable[[str], str]):
        from .logprobs import TokenText

        self.sched, self.metrics, self.app_cfg, self.scrub = sched, metrics, app_cfg, scrub
        self.config = sched.config
        self.name = app_cfg["served_model_name"]
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="mtpflow-http")
        self.token_text = TokenText(sched.tokenizer)


# --------------------------------------------------------------------------------------
# reading and preparing a request
# --------------------------------------------------------------------------------------
async def read_body(srv: ServerState, request) -> bytes:
    """The body, at most ``max_body_size`` bytes (else 413, after draining what the client sends)."""
    from starlette.requests import ClientDisconnect

    limit = srv.app_cfg["max_body_size"]
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


def build_requests(srv: ServerState, ids: list[int], p: _Params, rid: str, param: str, media=None) -> list:
    """The rows (one per choice) of a validated request."""
    from ..state import Request, SamplingParams

    app_cfg = srv.app_cfg
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
                            repetition_penalty=srv.config.sampling.repetition_penalty, seed=seed, grammar=p.grammar,
                            logit_bias=p.logit_bias, frequency_penalty=p.frequency_penalty,
                            presence_penalty=p.presence_penalty)
        # what engine.make_request builds, without touching the session from this thread
        out.append(Request(id=rid if p.n == 1 else f"{rid}-{i}", prompt=list(ids), max_tokens=mt, sampling=sp,
                           stop_ids=srv.sched.eos_ids, speculative=p.speculative, media=media))
    return out


def prepare(srv: ServerState, raw: bytes, chat: bool, rid: str):
    """Parse, validate and tokenize (in the pool, off the event loop): ``(params, rows)``."""
    sched, app_cfg = srv.sched, srv.app_cfg
    body = parse_body(raw)
    p = _parse_common(body, app_cfg, chat)
    if not app_cfg["per_request_processing"]:
        for name in ("logit_bias", "frequency_penalty", "presence_penalty"):
            if getattr(p, name):
                raise APIError(f"'{name}' needs the rejection sampler; this server is configured with "
                               f"[sampling] sampler = {srv.config.sampling.sampler!r}", param=name, code="unsupported")
    limit, mtc = app_cfg["max_context"], sched.max_token_chars
    media = None
    if chat and _has_media(body.get("messages")):
        ids, media = _chat_media(body, sched.session, app_cfg["media"])
    elif chat:
        ids = _chat_ids(body, sched.tokenizer, limit, mtc)
    else:
        ids = _prompt_ids(body, sched.tokenizer, sched.vocab_size, limit, mtc)
    return p, build_requests(srv, ids, p, rid, "messages" if chat else "prompt", media)


def deadline_of(srv: ServerState, p: _Params, t_arrival: float) -> float | None:
    limits = [t for t in (p.max_time, srv.app_cfg["request_timeout"]) if t is not None]
    return t_arrival + min(limits) if limits else None


async def watch_disconnect(request, queue: asyncio.Queue) -> None:
    # the body has been read: the next ASGI message is the client going away
    try:
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                queue.put_nowait(("disconnect",))
                return
    except Exception:  # pragma: no cover - the connection is gone either way
        return


# --------------------------------------------------------------------------------------
# answering: one request's choices, streamed or collected
# --------------------------------------------------------------------------------------
class Reply:
    """The response of one request: its id, and its choices and chunks in OpenAI's shapes."""

    def __init__(self, srv: ServerState, rid: str, chat: bool, n: int, logprobs: int | None):
        self.srv, self.rid, self.chat, self.n, self.logprobs = srv, rid, chat, n, logprobs
        self.created = int(time.time())
        self.obj = "chat.completion" if chat else "text_completion"

    def format_logprobs(self, lps):
        from .logprobs import chat_content, completion_logprobs

        if lps is None:
            return None
        toks, entries, offsets = lps
        if self.chat:
            return {"content": chat_content(toks, entries, self.srv.token_text), "refusal": None}
        return completion_logprobs(toks, entries, offsets, self.srv.token_text, bool(self.logprobs))

    def choice(self, i: int, text: str | None, finish: str | None, lps=None, first: bool = False,
               detail: str | None = None, stream: bool = True) -> dict:
        lp = self.format_logprobs(lps)
        if self.chat:
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

    def chunk(self, choice: dict, usage: dict | None = None) -> str:
        d = {"id": self.rid, "object": self.obj + (".chunk" if self.chat else ""), "created": self.created,
             "model": self.srv.name, "choices": [choice]}
        if usage is not None:
            d["usage"] = usage
        return f"data: {json.dumps(d)}\n\n"

    def generation_error(self, message: str) -> APIError:
        return APIError(self.srv.scrub(message), type="server_error", code="generation_failed", status=500)


@functools.cache
def _sse_class():
    from starlette.responses import StreamingResponse

    class SSEResponse(StreamingResponse):
        """Server-sent events; ``on_close()`` runs when the response ends (sent or abandoned)."""

        def __init__(self, content, on_close):
            super().__init__(content, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            self.on_close = on_close

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                self.on_close()

    return SSEResponse


def stream_reply(reply: Reply, queue: asyncio.Queue):
    """The SSE response of a streamed request; its rows are cancelled if the client goes away."""
    sched, state = reply.srv.sched, {"done": False}

    def close():
        if not state["done"]:
            state["done"] = True
            sched.cancel(reply.rid)  # the client went away: drop its rows at the next round

    async def events():
        try:
            if reply.chat:
                for i in range(reply.n):
                    yield reply.chunk(reply.choice(i, None, None, first=True))
            pending, usages = reply.n, []
            while pending:
                msg = await queue.get()
                kind = msg[0]
                if kind == "delta":
                    _, i, text, lps = msg
                    yield reply.chunk(reply.choice(i, text, None, lps))
                elif kind == "done":
                    _, i, text, reason, usage, produced, lps, detail = msg
                    pending -= 1
                    usages.append((usage, produced))
                    if text or (lps is not None and lps[0]):
                        yield reply.chunk(reply.choice(i, text, None, lps))
                    yield reply.chunk(reply.choice(i, None, reason, detail=detail),
                                      _aggregate_usage(usages) if not pending else None)
                elif kind == "error":
                    state["done"] = True
                    sched.cancel(reply.rid)
                    yield f"data: {json.dumps(reply.generation_error(msg[2]).body())}\n\n"
                    yield "data: [DONE]\n\n"
                    return
            state["done"] = True
            yield "data: [DONE]\n\n"
        finally:
            close()

    return _sse_class()(events(), close)


async def collect_reply(reply: Reply, request, queue: asyncio.Queue):
    """The JSON response of a non-streamed request, cancelling its rows as soon as the client disconnects."""
    from starlette.responses import JSONResponse, Response

    sched, n = reply.srv.sched, reply.n
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
                sched.cancel(reply.rid)
                return Response(status_code=499)
            if kind not in ("delta", "done"):
                sched.cancel(reply.rid)
                raise reply.generation_error(msg[2])
            i, lps = msg[1], msg[3] if kind == "delta" else msg[6]
            parts[i].append(msg[2])
            if lps is not None:
                for acc, xs in zip(lp_parts[i], lps):
                    acc.extend(xs)
            if kind == "done":
                pending -= 1
                finals[i] = (msg[3], msg[7])
                usages.append((msg[4], msg[5]))
    except asyncio.CancelledError:
        sched.cancel(reply.rid)
        raise
    finally:
        watcher.cancel()
    choices = [reply.choice(i, "".join(parts[i]), finals[i][0], lp_parts[i] if reply.logprobs is not None else None,
                            detail=finals[i][1], stream=False) for i in range(n)]
    return JSONResponse({"id": reply.rid, "object": reply.obj, "created": reply.created, "model": reply.srv.name,
                         "choices": choices, "usage": _aggregate_usage(usages)})


async def run(srv: ServerState, request, chat: bool):
    """Read, validate and submit one completion request; its response."""
    sched = srv.sched
    t_arrival = time.perf_counter()
    if sched.queue_full():  # cheap refusal before reading and tokenizing
        raise sched._queue_full_error()
    raw = await read_body(srv, request)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    loop = asyncio.get_running_loop()
    p, reqs = await loop.run_in_executor(srv.pool, prepare, srv, raw, chat, rid)
    queue: asyncio.Queue = asyncio.Queue()
    sched.submit(_Submission(rid, reqs, loop, queue, p.stops, deadline=deadline_of(srv, p, t_arrival),
                             logprobs=p.logprobs, t_arrival=t_arrival))
    reply = Reply(srv, rid, chat, len(reqs), p.logprobs)
    if p.stream:
        return stream_reply(reply, queue)
    return await collect_reply(reply, request, queue)


# --------------------------------------------------------------------------------------
# routes and error handlers
# --------------------------------------------------------------------------------------
async def completions(request):
    return await run(request.app.state.server, request, chat=False)


async def chat_completions(request):
    return await run(request.app.state.server, request, chat=True)


async def health(request):
    from starlette.responses import JSONResponse

    ok = request.app.state.server.sched.alive
    return JSONResponse({"status": "ok" if ok else "stopped"}, status_code=200 if ok else 503)


async def models(request):
    from starlette.responses import JSONResponse

    srv = request.app.state.server
    return JSONResponse({"object": "list", "data": [
        {"id": srv.name, "object": "model", "created": srv.app_cfg["created"], "owned_by": "mtpflow",
         "max_context": srv.app_cfg["max_context"]}]})


async def stats(request):
    from starlette.responses import JSONResponse

    srv = request.app.state.server
    return JSONResponse({"model": srv.name, "max_context": srv.app_cfg["max_context"],
                         "max_batch_size": srv.config.batch.max_batch_size, **srv.sched.snapshot})


async def prometheus(request):
    from starlette.responses import Response

    from .metrics import CONTENT_TYPE

    return Response(request.app.state.server.metrics.render(), media_type=CONTENT_TYPE)


async def on_api_error(request, exc: APIError):
    from starlette.responses import JSONResponse

    srv = request.app.state.server
    if exc.status != 499 and exc.code != "generation_failed":
        srv.metrics.rejected.inc(status=exc.status)
        srv.sched.log.info("request.rejected", status=exc.status, code=exc.code, param=exc.param,
                           path=request.url.path, error=exc.message[:200])
    exc.message = srv.scrub(exc.message)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers or None)


async def on_http_error(request, exc):
    from starlette.responses import JSONResponse

    err = APIError(str(exc.detail), status=exc.status_code, code="not_found" if exc.status_code == 404 else None)
    return JSONResponse(err.body(), status_code=exc.status_code)


async def on_error(request, exc: Exception):
    from starlette.responses import JSONResponse

    request.app.state.server.sched.log.exception("request.failed", error=str(exc))
    err = APIError(f"internal error: {type(exc).__name__}", status=500, type="server_error")
    return JSONResponse(err.body(), status_code=500)


def _lifespan(app):
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        try:
            yield
        finally:
            srv = app.state.server
            await asyncio.to_thread(srv.sched.close)
            srv.pool.shutdown(wait=False, cancel_futures=True)

    return lifespan


def create_app(session_or_config: Any, *, served_model_name: str | None = None,
               max_context: int | None = None, max_batch_size: int | None = None, log=None,
               max_queued: int | None = None, max_body_size: int | None = None,
               request_timeout: float | None = None, plugins=(), media=None):
    """Build the Starlette app and start its scheduler thread (the model loads now).

    ``session_or_config``: a :class:`~mtpflow.config.Config` (recommended), a
    zero-argument session factory, or a :class:`~mtpflow.engine.Session` (see
    :class:`~mtpflow.serve.scheduler.Scheduler`).  ``max_queued``: rows that may wait for the batch
    (default :data:`DEFAULT_MAX_QUEUED`); ``max_body_size``: bytes (default
    :data:`DEFAULT_MAX_BODY_SIZE`); ``request_timeout``: the default and
    largest ``max_time`` in seconds (default: none); ``plugins``: extra plugin
    objects for the session; ``media``: a :class:`~mtpflow.media.MediaPolicy`
    (default: no local files, the default pixel limits).  The scheduler is reachable as
    ``app.state.scheduler``, the metrics as ``app.state.metrics``; both stop
    at the app's lifespan shutdown (or at process exit).
    """
    from .._extras import require

    require("serve", "starlette")
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.routing import Route

    from .metrics import ServerMetrics

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
        "structured_error": _structured_probe(sched),
    }
    srv = ServerState(sched, metrics, app_cfg, _scrubber(cfg, sched.session))
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
        lifespan=_lifespan(None),
    )
    app.state.server = srv
    app.state.scheduler = sched
    app.state.metrics = metrics
    app.state.served_model_name = name
    app.state.max_context = app_cfg["max_context"]
    app.state.max_body_size = app_cfg["max_body_size"]
    return app


__all__ = ["ServerState", "create_app"]
