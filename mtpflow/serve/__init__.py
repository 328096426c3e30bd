"""An OpenAI-compatible HTTP server (``mtpflow serve``).

Architecture
------------
* One **scheduler thread** owns the :class:`~mtpflow.engine.Session` and an
  :class:`~mtpflow.serve.batcher.IsolatingBatcher` with the ``continuous``
  batch policy: concurrent requests decode together, rows leave when they
  finish and new requests join between rounds.  MLX streams are per thread,
  so the session is *loaded inside* that thread; everything that touches MLX
  runs there (:meth:`~mtpflow.serve.scheduler.Scheduler.call` runs any function there, e.g. a
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
:mod:`~mtpflow.serve.batcher` finds it by running the rows of the failing
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
* **Connections** (:mod:`mtpflow.serve.http`): a connection whose request
  head is not complete ``--header-timeout`` seconds after it opened (or after
  the head's first byte) is closed, and so is one whose request body goes
  ``--body-timeout`` seconds (default 30) without a byte; idle keep-alive connections close after
  ``--timeout-keep-alive``; a head past ``--max-header-size`` is a 400; past
  ``--limit-concurrency`` connections + requests new requests get 503.
* **Startup**: ``--host`` / ``--port`` are checked and the socket bound before
  the model loads (a one-line error); "serving on ..." is printed once the
  server listens.

Endpoints: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (``stream: true`` = server-sent events in the
OpenAI chunk format, ending with ``data: [DONE]``), ``GET /v1/stats`` (JSON)
and ``GET /metrics`` (Prometheus text format, :mod:`mtpflow.serve.metrics`:
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
without speculation: :mod:`mtpflow.serve.logprobs`), ``max_time`` and the
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

Load tests: ``python -m mtpflow.loadtest`` (:mod:`mtpflow.serve.loadtest`; with
``--faults`` it loads :mod:`mtpflow.serve.faults`, whose requests fail while
decoding, next to the good ones).

Modules: :mod:`~mtpflow.serve.scheduler` (the scheduler thread),
:mod:`~mtpflow.serve.protocol` (errors, parsing and validation),
:mod:`~mtpflow.serve.app` (the ASGI app and its handlers), :mod:`~mtpflow.serve.cli`
(``mtpflow serve``'s flags and start), :mod:`~mtpflow.serve.http` (address, socket and
uvicorn's limits), :mod:`~mtpflow.serve.batcher`, :mod:`~mtpflow.serve.logprobs`,
:mod:`~mtpflow.serve.metrics`, :mod:`~mtpflow.serve.faults`,
:mod:`~mtpflow.serve.prefix_cache` and :mod:`~mtpflow.serve.loadtest`.
``mtpflow.server``, ``mtpflow.prefix_cache`` and ``mtpflow.loadtest`` re-export them.

Nothing here imports mlx or starlette at module level.
"""
