"""The OpenAI-compatible server, driven with the official ``openai`` client.

One server (session-scoped) on 127.0.0.1, a free port, in a background
thread; every loop is bounded by a timeout.
"""

from __future__ import annotations

import json
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
    app = create_app(cfg, max_context=512, log=structlog.wrap_logger(cap, processors=[]))
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
    yield {"base": base, "app": app, "sched": app.state.scheduler, "logs": cap}
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
