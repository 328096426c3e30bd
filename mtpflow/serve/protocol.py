"""Requests of ``mtpflow serve``: OpenAI-style errors, and the parsing and validation of
request bodies (run in the handlers' thread pool; see :mod:`mtpflow.serve`)."""

from __future__ import annotations

import json
from typing import Callable

DEFAULT_MAX_CONTEXT = 8192
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
    from .._extras import MissingExtra
    from ..structured import grammar

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
    from .logprobs import MAX_COMPLETION_LOGPROBS, MAX_TOP_LOGPROBS

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
    from .._extras import MissingExtra
    from ..media import MediaError, MediaPolicy, encode_prompt_with_media, split_content_parts

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
