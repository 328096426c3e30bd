"""The server with a real tokenizer (SmolLM2): response_format (structured
output on the speculative path), image parts refused on a text-only target,
and the prefix cache across the turns of a chat."""

from __future__ import annotations

import base64
import json

import pytest

pytest.importorskip("starlette")
pytest.importorskip("llguidance")
from starlette.testclient import TestClient  # noqa: E402

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client():
    from mtpflow.config import load_config
    from mtpflow.server import create_app

    cfg = load_config(overrides={"model": {"model": "smollm2-135m", "draft_model": "smollm2-135m-mtp"},
                                 "draft": {"block_size": 3}, "batch": {"policy": "continuous", "prefix_cache_mb": 64}})
    app = create_app(cfg, max_context=2048)
    with TestClient(app) as c:
        yield c, app


def _chat(c, **body):
    body.setdefault("max_tokens", 40)
    body.setdefault("temperature", 0)
    return c.post("/v1/chat/completions", json=body)


def test_response_format_json_schema(client):
    c, app = client
    msgs = [{"role": "user", "content": "Give me a person as JSON with name and age."}]
    r = _chat(c, messages=msgs, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    assert r.status_code == 200, r.text
    obj = json.loads(r.json()["choices"][0]["message"]["content"])
    assert set(obj) == {"name", "age"} and isinstance(obj["age"], int)
    # exactly the engine's constrained output (the same request without speculation)
    r2 = _chat(c, messages=msgs, speculative=False,
               response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    assert r2.json()["choices"][0]["message"]["content"] == r.json()["choices"][0]["message"]["content"]
    r3 = _chat(c, messages=msgs, response_format={"type": "regex", "regex": "[0-9]{3}"}, max_tokens=6)
    assert r3.status_code == 200 and r3.json()["choices"][0]["message"]["content"].isdigit()


@pytest.mark.parametrize("rf, word", [
    ({"type": "yaml"}, "not supported"),
    ({"type": "json_schema", "json_schema": {"schema": "nope"}}, "must be an object"),
    ({"type": "regex", "regex": "(unclosed"}, "response_format"),
    ("json", "must be an object"),
])
def test_bad_response_formats_are_400s(client, rf, word):
    c, _ = client
    r = _chat(c, messages=[{"role": "user", "content": "hi"}], response_format=rf)
    assert r.status_code == 400 and word in r.json()["error"]["message"], r.text


def test_image_parts_on_a_text_only_target_and_remote_urls(client):
    c, _ = client
    png = "data:image/png;base64," + base64.b64encode(b"\\x89PNG\\r\\n\\x1a\\n" + b"0" * 20).decode()
    for url, word in (("https://example.com/cat.png", "remote"), (png, "text only")):
        msgs = [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                             {"type": "image_url", "image_url": {"url": url}}]}]
        r = _chat(c, messages=msgs)
        assert r.status_code == 400 and word in r.json()["error"]["message"].lower(), r.text


def test_the_second_turn_reuses_the_first(client):
    c, app = client
    sched = app.state.scheduler
    msgs = [{"role": "user", "content": "Name three colours of the rainbow."}]
    first = _chat(c, messages=msgs, max_tokens=24).json()["choices"][0]["message"]["content"]
    before = sched.call(lambda s: s.prefix_cache.describe())
    msgs += [{"role": "assistant", "content": first}, {"role": "user", "content": "And two more?"}]
    cached = _chat(c, messages=msgs, max_tokens=16).json()["choices"][0]["message"]["content"]
    after = sched.call(lambda s: s.prefix_cache.describe())
    assert after["hits"] == before["hits"] + 1 and after["tokens_reused"] > before["tokens_reused"] + 20
    plain = _chat(c, messages=msgs, max_tokens=16, speculative=False).json()["choices"][0]["message"]["content"]
    assert cached == plain  # reused K/V, same answer
