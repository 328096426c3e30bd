"""The OpenAI-compatible server, driven with the official ``openai`` client.

One server (session-scoped) on 127.0.0.1, a free port, in a background
thread; every loop is bounded by a timeout.
"""

from __future__ import annotations

import json
import math
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from conftest import FIXTURES  # noqa: E402


PAIR = FIXTURES / "pair_e"
MODEL = "target"  # the served name: the target folder's basename
PROMPT = "beca daka doli bugi base dana gane bate dozi behe"
WORDS = "beca daka doli bugi base dana gane bate dozi behe gebu fine firo gifa".split()


# prompts (token ids) that the fault-injecting plugin acts on; no text prompt starts with them
from mtpflow.serve.faults import FAULT_PREFILL as POISON_PREFILL  # noqa: E402
from mtpflow.serve.faults import FAULT_ROUND as POISON_ROUND  # noqa: E402
from mtpflow.serve.faults import SLOW, Faults  # noqa: E402

MAX_BODY = 1 << 20


@pytest.fixture(scope="session")
def server():
    import structlog
    from structlog.testing import CapturingLogger

    from mtpflow.config import load_config
    from mtpflow.server import create_app

    cfg = load_config(overrides={
        "model": {"model": str(PAIR / "target"), "draft_model": str(PAIR / "drafter")},
        "draft": {"block_size": 4},
        "batch": {"policy": "continuous", "max_batch_size": 8},
    })
    cap = CapturingLogger()
    faults = Faults()
    app = create_app(cfg, max_context=512, log=structlog.wrap_logger(cap, processors=[]), max_body_size=MAX_BODY,
                     plugins=[faults])
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    t = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline and t.is_alive(), "server did not start"
        time.sleep(0.02)
    base = f"http://127.0.0.1:{port}"
    yield {"base": base, "app": app, "sched": app.state.scheduler, "logs": cap, "faults": faults}
    srv.should_exit = True
    t.join(20)
    sock.close()
    app.state.scheduler.close()
    assert not app.state.scheduler._thread.is_alive()


@pytest.fixture(scope="session")
def client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key="x", max_retries=0, timeout=60)


def _stats(server) -> dict:
    return httpx.get(server["base"] + "/v1/stats", timeout=10).json()


def _wait_idle(server, timeout=20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = _stats(server)
        if st["active_rows"] == 0 and st["open_requests"] == 0 and st["waiting"] == 0:
            return st
        assert time.monotonic() < deadline, f"rows still active: {st}"
        time.sleep(0.05)


def _prompt(i: int) -> str:
    return " ".join(WORDS[(i * 3 + k) % len(WORDS)] for k in range(2 + i % 5))


def _stream_text(client, **kw) -> tuple[str, str | None]:
    parts, reason = [], None
    for ch in client.completions.create(model=MODEL, stream=True, **kw):
        if ch.choices:
            parts.append(ch.choices[0].text)
            reason = ch.choices[0].finish_reason or reason
    return "".join(parts), reason


# --------------------------------------------------------------------------------------
def test_health_models_stats(server, client):
    assert httpx.get(server["base"] + "/health", timeout=10).json()["status"] == "ok"
    assert [m.id for m in client.models.list().data] == [MODEL]
    st = _stats(server)
    assert st["active_rows"] == 0 and st["max_context"] == 512 and "session" in st


def test_an_idle_server_keeps_no_freed_buffers(server, client):
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    deadline = time.monotonic() + 20
    while (mem := _wait_idle(server)["mlx_memory"])["cache"] != 0:
        assert time.monotonic() < deadline, mem  # MLX's buffer cache was not released when the batch went idle
        time.sleep(0.05)
    assert mem["peak"] > mem["active"] > 0


def test_completion_matches_target_greedy(server, client):
    from mtpflow.engine import target_only_greedy

    sched = server["sched"]
    ids = sched.call(lambda s: list(s.tokenizer.encode(PROMPT)))
    ref = sched.call(lambda s: target_only_greedy(s.target, ids, 24, s.target.eos_ids))
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0)
    text = sched.call(lambda s: s.tokenizer.decode(ref))
    assert r.choices[0].text == text
    assert r.choices[0].finish_reason == ("length" if len(ref) == 24 else "stop")
    u = r.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (len(ids), len(ref), len(ids) + len(ref))
    extra = u.model_extra
    assert extra["draft_tokens"] > 0 and 0 <= extra["accepted_tokens"] <= extra["draft_tokens"]
    assert extra["tau"] > 1.0  # speculation pays off on the fixture pair
    assert r.id.startswith("cmpl-")
    # the text prompt gives the same output; the request is logged once, with its id and usage
    r2 = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    assert r2.choices[0].text == text
    lines = [c.kwargs for c in server["logs"].calls if c.kwargs.get("request_id") == r2.id]
    assert [e["event"] for e in lines] == ["request.done"]
    assert lines[0]["rounds"] == r2.usage.model_extra["rounds"] > 0
    assert lines[0]["completion_tokens"] == r2.usage.completion_tokens
    assert not [c for c in server["logs"].calls if c.kwargs.get("event") == "round"]  # rounds: DEBUG, engine's logger


def test_streaming_equals_non_streaming(server, client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0)
    text, reason = _stream_text(client, prompt=PROMPT, max_tokens=20, temperature=0)
    assert text == full.choices[0].text and reason == full.choices[0].finish_reason
    # raw SSE: OpenAI chunks, usage on the last chunk, then [DONE]
    with httpx.stream("POST", server["base"] + "/v1/completions", timeout=30,
                      json={"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "stream": True}) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in resp.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][len("data: "):])
    assert last["object"] == "text_completion" and last["usage"]["completion_tokens"] == 5


def test_chat(server, client):
    msgs = [{"role": "system", "content": "beca"}, {"role": "user", "content": "daka doli"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    # the fixture tokenizer has no chat template: the documented fallback rendering
    from mtpflow.server import render_chat_fallback

    prompt = render_chat_fallback(msgs)
    assert prompt == "system: beca\nuser: daka doli\nassistant:"
    ref = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == ref.choices[0].text
    assert r.usage.prompt_tokens == ref.usage.prompt_tokens
    parts, reason = [], None
    for ch in client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0, stream=True):
        assert ch.object == "chat.completion.chunk"
        if ch.choices:
            parts.append(ch.choices[0].delta.content or "")
            reason = ch.choices[0].finish_reason or reason
    assert "".join(parts) == r.choices[0].message.content and reason == r.choices[0].finish_reason


def test_speculative_false(server, client):
    a = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    b = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                  extra_body={"speculative": False})
    assert a.choices[0].text == b.choices[0].text  # greedy is lossless either way
    eb = b.usage.model_extra
    assert eb["draft_tokens"] == 0 and eb["accepted_tokens"] == 0 and eb["tau"] == 1.0
    assert eb["rounds"] == b.usage.completion_tokens - 1  # one token per round after the prefill token


def test_seed_reproducible(server, client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0.9)
    a = client.completions.create(seed=7, **kw).choices[0].text
    b = client.completions.create(seed=7, **kw).choices[0].text
    c = client.completions.create(seed=8, **kw).choices[0].text
    g = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0).choices[0].text
    assert a == b
    assert len({a, c, g}) > 1  # sampling is not greedy, and the seed matters


def test_stop_strings(server, client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    words = full.split()
    stop = " " + words[3]
    cut = full[: full.index(stop)]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop, "zzzz"])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 24
    text, reason = _stream_text(client, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop)
    assert text == cut and reason == "stop"
    _wait_idle(server)


@pytest.mark.parametrize(
    "body,param",
    [
        ("{not json", None),
        ([1, 2], None),
        ({"model": "nope", "prompt": "beca"}, "model"),
        ({"model": MODEL, "prompt": "beca", "max_tokens": 0}, "max_tokens"),
        ({"model": MODEL, "prompt": "beca", "max_tokens": -3}, "max_tokens"),
        ({"model": MODEL, "prompt": "beca", "max_tokens": "5"}, "max_tokens"),
        ({"model": MODEL, "prompt": "beca", "max_tokens": 600}, "prompt"),
        ({"model": MODEL, "prompt": ["beca", "daka"]}, "prompt"),
        ({"model": MODEL, "prompt": [1, 99999]}, "prompt"),
        ({"model": MODEL, "prompt": ""}, "prompt"),
        ({"model": MODEL, "prompt": 5}, "prompt"),
        ({"model": MODEL}, "prompt"),
        ({"model": MODEL, "prompt": "beca", "temperature": "hot"}, "temperature"),
        ({"model": MODEL, "prompt": "beca", "top_p": 0}, "top_p"),
        ({"model": MODEL, "prompt": "beca", "stop": 3}, "stop"),
        ({"model": MODEL, "prompt": "beca", "stream": "yes"}, "stream"),
        ({"model": MODEL, "prompt": "beca", "speculative": 1}, "speculative"),
        ({"model": MODEL, "prompt": "beca", "seed": 1.5}, "seed"),
    ],
)
def test_errors_completions(server, client, body, param):
    raw = body if isinstance(body, str) else json.dumps(body)
    resp = httpx.post(server["base"] + "/v1/completions", content=raw, timeout=10,
                      headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"] and err["param"] == param
    assert set(err) == {"message", "type", "param", "code"}
    # the server keeps serving
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2


def test_errors_chat_and_client(server, client):
    for body, param in [
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL, "messages": "hi"}, "messages"),
        ({"model": MODEL, "messages": [{"content": "x"}]}, "messages[0]"),
        ({"model": MODEL, "messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ]:
        resp = httpx.post(server["base"] + "/v1/chat/completions", json=body, timeout=10)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model="other", prompt="beca", max_tokens=2)
    assert ei.value.status_code == 400 and ei.value.body["code"] == "model_not_found"
    assert httpx.get(server["base"] + "/v1/nothing", timeout=10).status_code == 404
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


def test_concurrent_streams_equal_alone(server, client):
    n = 16
    reqs = [dict(prompt=_prompt(i), max_tokens=8 + (i % 4) * 3, temperature=0) for i in range(n)]
    alone = [client.completions.create(model=MODEL, **kw).choices[0].text for kw in reqs]
    t0 = time.monotonic()
    with ThreadPoolExecutor(n) as ex:
        together = list(ex.map(lambda kw: _stream_text(client, **kw), reqs))
    assert time.monotonic() - t0 < 40
    for i, (text, reason) in enumerate(together):
        assert reason in ("stop", "length")
        assert text == alone[i], f"request {i} differs when batched"
    st = _wait_idle(server)
    assert st["session"]["rounds"] > 0


def test_client_disconnect(server, client):
    before = _stats(server)["cancelled_total"]
    others = [dict(prompt=_prompt(i), max_tokens=20, temperature=0) for i in range(3)]
    alone = [client.completions.create(model=MODEL, **kw).choices[0].text for kw in others]

    def rude():
        # asks for far more tokens than the others; goes away after the first chunk
        stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=400, temperature=0, stream=True)
        next(iter(stream))
        stream.close()

    t0 = time.monotonic()
    with ThreadPoolExecutor(4) as ex:
        futs = [ex.submit(rude)] + [ex.submit(_stream_text, client, **kw) for kw in others]
        results = [f.result(timeout=30) for f in futs]
    assert time.monotonic() - t0 < 20
    assert [r[0] for r in results[1:]] == alone
    st = _wait_idle(server, timeout=15)
    assert st["cancelled_total"] == before + 1
    # a non-streaming request still works afterwards
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3).usage.completion_tokens == 3


def test_serve_arguments_and_env(monkeypatch):
    import argparse

    from mtpflow.config import ConfigError
    from mtpflow.server import add_serve_arguments, serve_config_from_args

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    args = p.parse_args(["--model", str(PAIR / "target"), "--max-batch-size", "3", "--port", "0"])
    assert (args.host, args.port, args.max_context, args.served_model_name) == ("127.0.0.1", 0, None, None)
    monkeypatch.setenv("MTPFLOW_DRAFT_MODEL", str(PAIR / "drafter"))
    monkeypatch.setenv("MTPFLOW_DRAFT_KIND", "mtp")
    monkeypatch.setenv("MTPFLOW_DRAFT_BLOCK_SIZE", "6")
    cfg = serve_config_from_args(args)
    assert cfg.model.draft_model == str(PAIR / "drafter") and cfg.model.draft_kind == "mtp"
    assert cfg.draft.block_size == 6 and cfg.batch.max_batch_size == 3 and cfg.batch.policy == "continuous"
    # flags win over the environment
    cfg = serve_config_from_args(p.parse_args(["--draft-block-size", "2", "--draft-model", "x/y"]))
    assert cfg.draft.block_size == 2 and cfg.model.draft_model == "x/y"
    monkeypatch.setenv("MTPFLOW_DRAFT_BLOCK_SIZE", "six")
    with pytest.raises(ConfigError):
        serve_config_from_args(p.parse_args([]))
    monkeypatch.delenv("MTPFLOW_DRAFT_BLOCK_SIZE")
    args = p.parse_args(["--max-queued", "5", "--max-body-size", "512K", "--request-timeout", "30"])
    assert (args.max_queued, args.max_body_size, args.request_timeout) == (5, "512K", 30.0)
    serve_config_from_args(args)
    for bad, needle in ((["--max-queued", "-1"], "--max-queued"), (["--max-body-size", "lots"], "--max-body-size"),
                        (["--max-body-size", "0"], "--max-body-size"), (["--request-timeout", "0"], "--request-timeout")):
        with pytest.raises(ConfigError, match=needle):
            serve_config_from_args(p.parse_args(bad))


def test_parse_size():
    from mtpflow.server import parse_size

    assert [parse_size(x) for x in ("1048576", "512K", "8M", "8MiB", "1g", "1.5K")] == \
        [1 << 20, 512 << 10, 8 << 20, 8 << 20, 1 << 30, 1536]
    with pytest.raises(ValueError, match="not a size"):
        parse_size("8Q")


# --------------------------------------------------------------------------------------
# isolation: every request validated before the batch; a failing row ends alone
# --------------------------------------------------------------------------------------
def _post(server, body, path="/v1/completions", **kw):
    raw = body if isinstance(body, (str, bytes)) or hasattr(body, "__next__") else json.dumps(body)
    return httpx.post(server["base"] + path, content=raw, timeout=30, headers={"content-type": "application/json"},
                      **kw)


def _error(resp, status=400) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and "\n" not in err["message"]
    return err


@pytest.mark.parametrize("seed", [-1, 2**63, 2**70, -(2**70)])
def test_seed_out_of_range_is_a_400(server, seed):
    err = _error(_post(server, {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0.7, "seed": seed}))
    assert err["param"] == "seed" and "2**63" in err["message"]


def test_largest_seed_works(server, client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0.8)
    a = client.completions.create(seed=2**63 - 1, **kw)
    assert a.choices[0].text == client.completions.create(seed=2**63 - 1, **kw).choices[0].text
    assert client.completions.create(seed=0, **kw).usage.completion_tokens == 6


@pytest.mark.parametrize(
    "raw,param,needle",
    [
        ('{"model": "target", "prompt": "beca", "x": ' + "[" * 100 + "]" * 100 + "}", None, "nested deeper"),
        ('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", None, "nested deeper"),
        ('{"model": "target", "prompt": "beca \\ud800 daka"}', "prompt", "surrogate"),
        ('{"model": "target", "messages": [{"role": "user", "content": "x\\udfff"}]}', "messages[0].content", "surrogate"),
        (b'{"model": "target", "prompt": "beca \xff\xfe"}', None, "UTF-8"),
        ('{"model": "target", "prompt": "beca", "max_tokens": ' + "9" * 5000 + "}", None, "JSON"),
        ('{"model": "target", "prompt": "beca", "temperature": NaN}', "temperature", "temperature"),
        ('{"model": "target", "prompt": "beca", "top_p": Infinity}', "top_p", "top_p"),
        ('{"model": "target", "prompt": "beca", "n": 1000}', "n", "'n'"),
        ('{"model": "target", "prompt": "beca", "logprobs": 6}', "logprobs", "logprobs"),
        ('{"model": "target", "prompt": "beca", "max_time": -1}', "max_time", "max_time"),
        ('{"model": "target", "prompt": "beca", "stop": ["' + "x" * 300 + '"]}', "stop", "stop"),
    ],
)
def test_bad_bodies_are_400s(server, client, raw, param, needle):
    path = "/v1/chat/completions" if "messages" in str(raw) else "/v1/completions"
    err = _error(_post(server, raw, path=path))
    assert err["param"] == param and needle in err["message"], err
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


def test_chat_logprobs_fields_are_validated(server):
    base = {"model": MODEL, "messages": [{"role": "user", "content": "beca"}]}
    assert _error(_post(server, {**base, "top_logprobs": 3}, "/v1/chat/completions"))["param"] == "top_logprobs"
    assert _error(_post(server, {**base, "logprobs": True, "top_logprobs": 21}, "/v1/chat/completions"))["param"] \
        == "top_logprobs"
    assert _error(_post(server, {**base, "logprobs": 2}, "/v1/chat/completions"))["param"] == "logprobs"


def test_body_size_limit_is_a_413(server, client):
    big = json.dumps({"model": MODEL, "prompt": "beca " * (MAX_BODY // 4)})
    assert len(big) > MAX_BODY
    err = _error(_post(server, big), 413)
    assert err["code"] == "request_too_large" and str(MAX_BODY) in err["message"]

    def chunked():  # no Content-Length: the limit holds while reading
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536].encode()

    err = _error(_post(server, chunked()), 413)
    assert err["code"] == "request_too_large"
    # a body just under the limit is read (and refused for its length in tokens, not its size)
    err = _error(_post(server, {"model": MODEL, "prompt": "beca " * (MAX_BODY // 6)}))
    assert err["code"] == "context_length_exceeded"
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


def test_rejections_are_logged_once(server):
    calls = server["logs"].calls
    n = len(calls)
    _error(_post(server, {"model": MODEL, "prompt": PROMPT, "top_p": 7}))
    new = [c.kwargs for c in calls[n:] if c.kwargs.get("event") == "request.rejected"]
    assert len(new) == 1 and new[0]["status"] == 400 and new[0]["param"] == "top_p"


def _solo(client, kw, stream: bool = False) -> str:
    """The greedy text of one request (streamed or not)."""
    if stream:
        return _stream_text(client, temperature=0, **kw)[0]
    return client.completions.create(model=MODEL, temperature=0, **kw).choices[0].text


def test_a_failing_row_ends_alone(server, client):
    goods = [dict(prompt=_prompt(i), max_tokens=10 + 3 * i) for i in range(5)]
    alone = [_solo(client, kw) for kw in goods]
    rec0 = server["sched"].batcher.recoveries
    server["faults"].raised_with.clear()
    bad = [dict(prompt=POISON_ROUND + [5, 6], max_tokens=30), dict(prompt=POISON_PREFILL + [5], max_tokens=30),
           dict(prompt=POISON_ROUND + [7], max_tokens=30, stream=True)]

    def bad_one(kw):
        try:
            if kw.pop("stream", False):
                return _stream_text(client, temperature=0, **kw)
            client.completions.create(model=MODEL, temperature=0, **kw)
        except openai.APIError as exc:
            return exc
        return None

    sampled = dict(model=MODEL, prompt=_prompt(7), max_tokens=30, temperature=0.9, seed=11)
    sampled_alone = client.completions.create(**sampled).choices[0].text
    with ThreadPoolExecutor(9) as ex:
        fg = [ex.submit(_solo, client, kw, i % 2 == 1) for i, kw in enumerate(goods)]
        fs = ex.submit(lambda: client.completions.create(**sampled).choices[0].text)
        fb = [ex.submit(bad_one, dict(kw)) for kw in bad]
        got = [f.result(timeout=60) for f in fg]
        errs = [f.result(timeout=60) for f in fb]
    for i, g in enumerate(got):
        assert g == alone[i], f"good request {i} changed by a failing neighbour"
    # a seeded sampled row resumes on the same draws (they are keyed by seed and position)
    assert fs.result(timeout=60) == sampled_alone
    assert isinstance(errs[0], openai.InternalServerError) and "fault in the round" in errs[0].message
    assert isinstance(errs[1], openai.InternalServerError) and "fault in the prefill" in errs[1].message
    assert isinstance(errs[2], openai.APIError) and "fault in the round" in str(errs[2])  # an error event in the stream
    assert server["sched"].batcher.recoveries > rec0
    # the failures happened inside batches of good rows (then again in the failing row's probe, alone)
    raised = server["faults"].raised_with
    assert max(n for w, n in raised if w == "round") > 1 and ("round", 1) in raised, raised
    _wait_idle(server)
    failed = [c.kwargs for c in server["logs"].calls if c.kwargs.get("event") == "request.failed"]
    assert any("fault in the round" in f["error"] for f in failed)


# a property test: random bad requests thrown into a live batch of good ones
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_GOODS = [dict(prompt=_prompt(i), max_tokens=8 + 5 * i) for i in range(4)]
_SOLO: dict[int, str] = {}


def _bad_requests():
    """(raw body or dict, expected status) of requests that must fail alone."""
    base = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5}
    ints = st.integers(min_value=-(2**80), max_value=2**80)
    junk = st.one_of(st.text(max_size=5), st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=2),
                                                                                             st.integers(), max_size=1))
    field = st.one_of(
        st.builds(lambda s: {"seed": s, "temperature": 0.7}, ints.filter(lambda s: not 0 <= s < 2**63)),
        st.builds(lambda v: {"temperature": v}, st.floats(allow_nan=True).filter(lambda v: not 0 <= v <= 100)),
        st.builds(lambda v: {"top_p": v}, st.floats(allow_nan=True).filter(lambda v: not 0 < v <= 1)),
        st.builds(lambda v: {"min_p": v}, st.floats(allow_nan=True).filter(lambda v: not 0 <= v <= 1)),
        st.builds(lambda v: {"top_k": v}, st.integers(max_value=-1)),
        st.builds(lambda v: {"max_tokens": v}, st.one_of(st.integers(max_value=0), st.integers(min_value=600))),
        st.builds(lambda v: {"n": v}, st.one_of(st.integers(max_value=0), st.integers(min_value=17))),
        st.builds(lambda v: {"logprobs": v}, st.one_of(st.integers(max_value=-1), st.integers(min_value=6))),
        st.builds(lambda v: {"max_time": v}, st.floats(max_value=0.0)),
        st.builds(lambda k, v: {k: v}, st.sampled_from(["temperature", "top_p", "seed", "max_tokens", "n", "stream",
                                                        "speculative", "logprobs"]), junk),
        # stop: a string or a list of strings; anything else (text and [] are valid stops)
        st.builds(lambda v: {"stop": v}, st.one_of(st.integers(), st.lists(st.integers(), min_size=1, max_size=2),
                                                   st.dictionaries(st.text(max_size=2), st.integers(), max_size=1))),
        st.builds(lambda ids: {"prompt": ids}, st.lists(st.integers(min_value=2048), min_size=1, max_size=3)),
    )
    as_dict = field.map(lambda f: ({**base, **f}, {400}))
    raw = st.one_of(
        st.integers(min_value=65, max_value=3000).map(lambda d: ('{"prompt": ' + "[" * d + "]" * d + "}", {400})),
        st.sampled_from(["\\ud800", "\\udfff", "a\\udc00b"]).map(
            lambda s: ('{"model": "target", "prompt": "' + s + '"}', {400})),
        st.binary(min_size=1, max_size=8).map(lambda b: (b'{"prompt": "' + b + b'\xff"}', {400})),
        st.text(max_size=20).map(lambda t: ('{"prompt": ' + json.dumps(t)[:-1], {400})),  # truncated JSON
        st.just(('{"model": "target", "prompt": "' + "beca " * (MAX_BODY // 4) + '"}', {413})),
    )
    poison = st.sampled_from([POISON_ROUND, POISON_PREFILL]).map(
        lambda m: ({**base, "prompt": m + [9, 10], "max_tokens": 20}, {500}))
    return st.one_of(as_dict, raw, poison)


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(bads=st.lists(_bad_requests(), min_size=1, max_size=4), stream=st.booleans())
def test_property_bad_requests_never_hurt_good_ones(server, client, bads, stream):
    if not _SOLO:
        _SOLO.update({i: _solo(client, kw) for i, kw in enumerate(_GOODS)})

    def bad(item):
        body, want = item
        resp = _post(server, body)
        assert resp.status_code in want, (body if len(str(body)) < 300 else str(body)[:300], resp.text[:300])
        err = resp.json()["error"]
        assert err["message"] and "\n" not in err["message"] and "Traceback" not in err["message"]

    with ThreadPoolExecutor(len(_GOODS) + len(bads)) as ex:
        fg = [ex.submit(_solo, client, kw, stream) for kw in _GOODS]
        fb = [ex.submit(bad, b) for b in bads]
        for f in fb:
            f.result(timeout=60)
        for i, f in enumerate(fg):
            assert f.result(timeout=60) == _SOLO[i], f"good request {i} differs from its solo output"
    _wait_idle(server)


# --------------------------------------------------------------------------------------
# cancellation, deadlines, backpressure
# --------------------------------------------------------------------------------------
def _slow(i: int = 0, max_tokens: int = 400, **kw) -> dict:
    return {"model": MODEL, "prompt": SLOW + [5 + i], "max_tokens": max_tokens, "temperature": 0, **kw}


def test_non_streaming_request_cancelled_when_client_goes(server):
    before = _stats(server)["cancelled_total"]
    t0 = time.monotonic()
    with pytest.raises(httpx.TimeoutException):  # the client gives up after 1 s of a ~10 s request
        httpx.post(server["base"] + "/v1/completions", json=_slow(), timeout=1.0)
    while _stats(server)["cancelled_total"] == before:
        assert time.monotonic() - t0 < 2.5, "the row kept decoding after its client left"
        time.sleep(0.05)
    st = _wait_idle(server, timeout=2)
    assert st["open_requests"] == 0
    cancelled = [c.kwargs for c in server["logs"].calls if c.kwargs.get("event") == "request.cancelled"]
    assert cancelled and cancelled[-1]["completion_tokens"] < 400


def test_deadline_ends_a_row_with_length_and_timeout_detail(server, client):
    t0 = time.monotonic()
    r = client.completions.create(**_slow(), extra_body={"max_time": 0.6})
    assert time.monotonic() - t0 < 3.0  # the request would take ~10 s
    c = r.choices[0]
    assert c.finish_reason == "length" and c.model_extra["finish_detail"] == "timeout"
    assert 0 < r.usage.completion_tokens < 400 and c.text
    done = [x.kwargs for x in server["logs"].calls if x.kwargs.get("request_id") == r.id]
    assert [d["event"] for d in done] == ["request.done"] and done[0]["finish_detail"] == "timeout"
    # streams too; an ordinary request has no finish_detail
    with httpx.stream("POST", server["base"] + "/v1/completions", timeout=30,
                      json={**_slow(1), "stream": True, "max_time": 0.4}) as resp:
        chunks = [json.loads(ln[6:]) for ln in resp.iter_lines() if ln.startswith("data: {")]
    final = chunks[-1]["choices"][0]
    assert final["finish_reason"] == "length" and final["finish_detail"] == "timeout"
    assert 0 < chunks[-1]["usage"]["completion_tokens"] < 400
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0).choices[0]
    assert "finish_detail" not in (plain.model_extra or {})


def test_queue_bound_answers_503_with_retry_after(server):
    sched = server["sched"]
    old = sched.max_queued
    base = server["base"]
    q0 = httpx.get(base + "/metrics", timeout=10).text
    try:
        with ThreadPoolExecutor(10) as ex:
            running = [ex.submit(httpx.post, base + "/v1/completions", json=_slow(i, 40), timeout=60) for i in range(8)]
            deadline = time.monotonic() + 10
            while _stats(server)["active_rows"] < 8:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            sched.max_queued = 2  # the batch is full: two may wait, the third is refused
            queued = [ex.submit(httpx.post, base + "/v1/completions", json=_slow(8 + i, 5), timeout=60) for i in range(2)]
            while _stats(server)["queued"] < 2:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            refused = httpx.post(base + "/v1/completions", json=_slow(11, 5), timeout=10)
            err = _error(refused, 503)
            assert err["code"] == "queue_full" and int(refused.headers["Retry-After"]) >= 1
            # a deadline holds in the queue too: the request ends empty, cut by its time limit
            sched.max_queued = 3
            late = httpx.post(base + "/v1/completions", json=_slow(12, 5, max_time=0.2), timeout=10).json()
            assert late["choices"][0]["finish_detail"] == "timeout" and late["choices"][0]["text"] == ""
            assert late["usage"]["completion_tokens"] == 0
            results = [f.result(timeout=60) for f in running + queued]
    finally:
        sched.max_queued = old
    assert [r.status_code for r in results] == [200] * 10
    waited = [r.json()["usage"]["queue_time_s"] for r in results[8:]]
    assert min(waited) > 0.1, waited  # they waited for a row to leave the batch
    assert all(r.json()["usage"]["queue_time_s"] < min(waited) for r in results[:8])
    q1 = httpx.get(base + "/metrics", timeout=10).text
    assert _metric(q1, "vllm:request_queue_time_seconds_count") >= _metric(q0, "vllm:request_queue_time_seconds_count") + 10
    assert _metric(q1, 'mtpflow:requests_rejected_total{model_name="target",status="503"}') >= 1


def test_tokenization_does_not_block_the_event_loop(server, client, monkeypatch):
    tok = server["sched"].tokenizer._tokenizer
    encode = tok.encode

    def slow_encode(text, *a, **kw):
        if "slowtokenize" in text:
            time.sleep(1.5)
        return encode(text, *a, **kw)

    monkeypatch.setattr(tok, "encode", slow_encode)
    with ThreadPoolExecutor(2) as ex:
        f = ex.submit(client.completions.create, model=MODEL, prompt="beca slowtokenize", max_tokens=3)
        time.sleep(0.2)
        gaps, busy = [], []
        for _ in range(3):  # /health answers while the tokenizer works (a blocked loop: > 1.2 s)
            t = time.monotonic()
            assert httpx.get(server["base"] + "/health", timeout=5).status_code == 200
            gaps.append(time.monotonic() - t)
            busy.append(not f.done())
        assert busy[0] and max(gaps) < 0.8, (gaps, busy)
        assert f.result(timeout=30).usage.completion_tokens == 3
    # a body near the size limit does not stall it either
    big = json.dumps({"model": MODEL, "prompt": "beca " * (MAX_BODY // 6)})
    with ThreadPoolExecutor(1) as ex:
        f = ex.submit(_post, server, big)
        t = time.monotonic()
        assert httpx.get(server["base"] + "/health", timeout=5).status_code == 200
        assert time.monotonic() - t < 0.8
        assert f.result(timeout=30).status_code == 400


# --------------------------------------------------------------------------------------
# metrics
# --------------------------------------------------------------------------------------
def _metric(text: str, name: str) -> float:
    """Sum of the samples of ``name`` (a full sample name, labels optional) in Prometheus text."""
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        key, val = line.rsplit(" ", 1)
        if key == name or (key.split("{")[0] == name and "{" not in name):
            total, found = total + float(val), True
    assert found, f"{name} not in /metrics"
    return total


def test_metrics_prometheus(server, client):
    base = server["base"]
    _wait_idle(server)
    m0 = httpx.get(base + "/metrics", timeout=10)
    assert m0.headers["content-type"].startswith("text/plain; version=0.0.4")
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    u = r.usage.model_extra
    text = httpx.get(base + "/metrics", timeout=10).text
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                 "vllm:request_queue_time_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:time_to_first_token_seconds", "vllm:request_success_total", "vllm:num_requests_running"):
        assert f"# TYPE {name} " in text, name

    def delta(name):
        return _metric(text, name) - _metric(m0.text, name)

    # the request was alone: the counters moved by exactly its usage
    assert delta("vllm:spec_decode_num_draft_tokens_total") == u["draft_tokens"] > 0
    assert delta("vllm:spec_decode_num_accepted_tokens_total") == u["accepted_tokens"]
    # a round drafts unless the budget left has no room (the last round of a max_tokens row)
    assert u["rounds"] - 1 <= delta("vllm:spec_decode_num_drafts_total") <= u["rounds"]
    assert delta("vllm:spec_decode_num_accepted_tokens_per_pos_total") == u["accepted_tokens"]
    first = _metric(text, 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="target",position="0"}')
    second = _metric(text, 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="target",position="1"}')
    assert first >= second  # a draft is accepted only after the ones before it
    assert delta('vllm:request_success_total{model_name="target",finished_reason="length"}') + \
        delta('vllm:request_success_total{model_name="target",finished_reason="stop"}') == 1
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    assert delta("vllm:generation_tokens_total") == r.usage.completion_tokens
    assert 'vllm:e2e_request_latency_seconds_bucket{model_name="target",le="+Inf"}' in text
    # 1 + accepted / drafts is the mean acceptance length, as vLLM
    assert 1 + delta("vllm:spec_decode_num_accepted_tokens_total") / delta("vllm:spec_decode_num_drafts_total") > 1


# --------------------------------------------------------------------------------------
# logprobs and n
# --------------------------------------------------------------------------------------
def _target_logprobs(server, ids: list[int], out: list[int]) -> list[float]:
    """log softmax of the target's own logits at each generated token (one forward, no speculation)."""

    def ref(s):
        import mlx.core as mx

        cache = s.target.make_cache()
        s.target.set_offsets(cache, mx.array([0], dtype=mx.int32))
        h = s.target.forward(mx.array([ids + out], dtype=mx.int32), cache)
        lg = s.target.logits(h)[0, len(ids) - 1: len(ids) - 1 + len(out)].astype(mx.float32)
        lp = lg - mx.logsumexp(lg, axis=-1, keepdims=True)
        return mx.take_along_axis(lp, mx.array(out)[:, None], axis=1)[:, 0].tolist()

    return server["sched"].call(ref)


def test_completion_logprobs(server, client):
    sched = server["sched"]
    ids = sched.call(lambda s: list(s.tokenizer.encode(PROMPT)))
    kw = dict(model=MODEL, prompt=ids, max_tokens=20, temperature=0, logprobs=3)
    r = client.completions.create(**kw)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    # the tokens read as the text (a decode drops the first token's leading space)
    assert "".join(lp.tokens).lstrip() == r.choices[0].text.lstrip() and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and val <= 0 and max(top.values()) == pytest.approx(val)  # greedy: the top token
    out = sched.call(lambda s: list(s.tokenizer.encode(r.choices[0].text)))
    # the target's own distribution, and the same without speculation
    ref = _target_logprobs(server, ids, out)
    assert lp.token_logprobs == pytest.approx(ref, abs=2e-4)
    plain = client.completions.create(**kw, extra_body={"speculative": False})
    assert plain.usage.model_extra["draft_tokens"] == 0 and r.usage.model_extra["accepted_tokens"] > 0
    p2 = plain.choices[0].logprobs
    assert p2.tokens == lp.tokens and p2.token_logprobs == pytest.approx(lp.token_logprobs, abs=2e-4)
    assert [sorted(t) for t in p2.top_logprobs] == [sorted(t) for t in lp.top_logprobs]
    # streamed: the chunks' logprobs add up to the same
    toks, vals = [], []
    for ch in client.completions.create(**kw, stream=True):
        if ch.choices and ch.choices[0].logprobs:
            toks += ch.choices[0].logprobs.tokens
            vals += ch.choices[0].logprobs.token_logprobs
    assert toks == lp.tokens and vals == pytest.approx(lp.token_logprobs, abs=1e-6)
    # no logprobs asked: none given
    assert client.completions.create(model=MODEL, prompt=ids, max_tokens=3).choices[0].logprobs is None


def test_logprobs_of_sampled_rows_follow_their_filters(server, client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0.9, seed=3, logprobs=5,
                                  extra_body={"top_k": 2})
    lp = r.choices[0].logprobs
    for val, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 2  # top-k removed the rest: probability 0, not listed
        assert any(abs(val - v) < 1e-6 for v in top.values())  # the sampled token is one of them
        assert sum(math.exp(v) for v in top.values()) == pytest.approx(1.0, abs=1e-4)  # renormalised over 2


def test_chat_logprobs_shape(server, client):
    msgs = [{"role": "user", "content": "beca daka"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(c.token for c in content).lstrip() == r.choices[0].message.content.lstrip()
    for c in content:
        assert c.logprob <= 0 and bytes(c.bytes).decode() == c.token and len(c.top_logprobs) == 2
        assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
    parts = []
    for ch in client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0, logprobs=True,
                                             top_logprobs=2, stream=True):
        if ch.choices and ch.choices[0].logprobs and ch.choices[0].logprobs.content:
            parts += ch.choices[0].logprobs.content
    assert [(c.token, round(c.logprob, 5)) for c in parts] == [(c.token, round(c.logprob, 5)) for c in content]
    plain = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0, logprobs=True)
    assert all(c.top_logprobs == [] for c in plain.choices[0].logprobs.content)


def test_n_choices_prefilled_once(server, client):
    base = server["base"]
    one = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    _wait_idle(server)
    before = _metric(httpx.get(base + "/metrics", timeout=10).text, "mtpflow:prefill_tokens_total")
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, n=3)
    after = _metric(httpx.get(base + "/metrics", timeout=10).text, "mtpflow:prefill_tokens_total")
    assert after - before == one.usage.prompt_tokens  # three rows, one prefill
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.text == one.choices[0].text for c in r.choices)  # greedy: all the same
    assert r.usage.prompt_tokens == one.usage.prompt_tokens
    assert r.usage.completion_tokens == 3 * one.usage.completion_tokens
    # seeded: choice i is the request with seed + i
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0.9)
    two = client.completions.create(n=2, seed=40, **kw)
    assert [c.text for c in two.choices] == [client.completions.create(seed=s, **kw).choices[0].text for s in (40, 41)]
    # streamed: chunks of both choices, each adding up to its text
    got = {0: "", 1: ""}
    finish = {}
    for ch in client.completions.create(n=2, seed=40, stream=True, **kw):
        for c in ch.choices:
            got[c.index] += c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert [got[0], got[1]] == [c.text for c in two.choices] and set(finish) == {0, 1}
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "beca"}], n=2,
                                          max_tokens=5, temperature=0)
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content


def test_logprobs_with_draft_trees_equal_target_only():
    """The recorder at engine level, on a session that verifies draft trees."""
    from conftest import RoundLog, quiet_log

    from mtpflow.config import load_config
    from mtpflow.engine import generate_stream, load_session, make_request
    from mtpflow.serve.logprobs import LogprobRecorder

    rec, rounds = LogprobRecorder(), RoundLog()
    cfg = load_config(overrides={"model": {"model": str(PAIR / "target"), "draft_model": str(PAIR / "drafter")},
                                 "draft": {"block_size": 4, "tree": "2,2,1"}})
    s = load_session(cfg, extra_plugins=[rec, rounds], log=quiet_log())
    ids = list(s.tokenizer.encode(PROMPT))
    out = {}
    for rid, spec in (("tree", True), ("plain", False)):
        rec.wanted[rid] = 2
        toks = []
        for ev in generate_stream(s, [make_request(s, ids, 24, request_id=rid, speculative=spec)]):
            toks += ev.tokens
        out[rid] = (toks, rec.take(rid, len(toks)))
    assert any(r.tree for r in rounds.records), "no round verified a tree"
    (t1, e1), (t2, e2) = out["tree"], out["plain"]
    assert t1 == t2 and None not in e1
    assert [e[0] for e in e1] == pytest.approx([e[0] for e in e2], abs=2e-4)
    assert [[i for i, _ in e[1]] for e in e1] == [[i for i, _ in e[1]] for e in e2]


# --------------------------------------------------------------------------------------
# hardening: local files, server paths in errors
# --------------------------------------------------------------------------------------
def test_image_paths_get_one_answer_and_no_server_path(server, tmp_path):
    """No existence oracle: an existing file, a missing one, /etc/passwd and a data URL on this
    text-only target are refused; the local ones with one identical message; no server path."""
    real = tmp_path / "cat.png"
    real.write_bytes(b"\x89PNG")

    def ask(url):
        msgs = [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                             {"type": "image_url", "image_url": {"url": url}}]}]
        return _error(_post(server, {"model": MODEL, "messages": msgs, "max_tokens": 2}, "/v1/chat/completions"))

    local = [ask(u)["message"] for u in (str(real), f"file://{real}", str(tmp_path / "missing.png"), "/etc/passwd",
                                         "../etc/passwd", str(PAIR / "target" / "config.json"))]
    assert len(set(local)) == 1 and "allowed-local-media-path" in local[0], local
    from test_server_media import data_url, png

    text_only = ask(data_url(png(2, 2)))["message"]
    assert "no vision or audio tower" in text_only
    for msg in local + [text_only]:
        assert str(PAIR) not in msg and str(PAIR.resolve()) not in msg and str(tmp_path) not in msg, msg


def test_response_format_without_a_byte_decoder_is_a_400(server, client):
    """This target's tokenizer has no byte decoder: llguidance cannot constrain it, decided at validation."""
    pytest.importorskip("llguidance")
    for rf in ({"type": "json_object"}, {"type": "regex", "regex": "[ab]+"}):
        for path, extra in (("/v1/completions", {"prompt": PROMPT}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "beca"}]})):
            err = _error(_post(server, {"model": MODEL, "max_tokens": 4, "response_format": rf, **extra}, path))
            assert err["param"] == "response_format" and err["code"] == "unsupported", err
            assert "not available with this model" in err["message"]
    err = _error(_post(server, {"model": MODEL, "prompt": PROMPT, "response_format": {"type": "regex", "regex": "("}}))
    assert err["code"] == "invalid_value"  # a broken grammar is still named as such
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


# --------------------------------------------------------------------------------------
# logit_bias, frequency / presence penalties; echo, best_of, suffix refused
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra, param, needle", [
    ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"-3": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias", "outside the vocabulary"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"5": "x"}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": [1, 2]}, "logit_bias", "an object"),
    ({"frequency_penalty": 2.5}, "frequency_penalty", "[-2, 2]"),
    ({"presence_penalty": -3}, "presence_penalty", "[-2, 2]"),
    ({"presence_penalty": "high"}, "presence_penalty", "a number"),
    ({"echo": True}, "echo", "not supported"),
    ({"best_of": 3}, "best_of", "not supported"),
    ({"suffix": "the end"}, "suffix", "not supported"),
])
def test_sampling_fields_are_validated(server, extra, param, needle):
    err = _error(_post(server, {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, **extra}))
    assert err["param"] == param and needle in err["message"], err


def test_logit_bias_and_penalties_act_and_speculation_keeps_them(server, client):
    base = dict(model=MODEL, prompt=PROMPT, max_tokens=16, logprobs=1, echo=False, best_of=1, suffix=None)
    plain = client.completions.create(temperature=0, **base)
    first = plain.choices[0].logprobs.tokens[0]
    tok = server["sched"].call(lambda s: s.tokenizer.encode(first, add_special_tokens=False))[-1]
    for kw in ({"temperature": 0}, {"temperature": 0.8, "seed": 7}):
        extra = {"logit_bias": {str(tok): -60}, "frequency_penalty": 2.0, "presence_penalty": 1.5}
        spec = client.completions.create(**base, **kw, extra_body=extra)
        alone = client.completions.create(**base, **kw, extra_body={**extra, "speculative": False})
        assert spec.choices[0].text == alone.choices[0].text
        assert spec.usage.model_extra["draft_tokens"] > 0 and alone.usage.model_extra["draft_tokens"] == 0
        lp, lp_alone = spec.choices[0].logprobs.token_logprobs, alone.choices[0].logprobs.token_logprobs
        assert lp == pytest.approx(lp_alone, abs=2e-4)
    # the bias moved the first token's probability (greedy rows report the processed distribution)
    biased = client.completions.create(temperature=0, **base, extra_body={"logit_bias": {str(tok): -60}})
    if biased.choices[0].logprobs.tokens[0] == first:
        assert biased.choices[0].logprobs.token_logprobs[0] < plain.choices[0].logprobs.token_logprobs[0] - 1
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "beca"}], max_tokens=4,
                                          logit_bias={str(tok): 5}, frequency_penalty=0.5, presence_penalty=0.5)
    assert chat.usage.completion_tokens >= 1
