"""The requests of :mod:`mtpflow.serve.loadtest`: good ones (with their solo outputs as
references), bad ones of every kind the server must refuse, and half-header connections."""

from __future__ import annotations

import json
import random
import socket
import time
from urllib.parse import urlparse

WORDS = ("beca daka doli bugi base dana gane bate dozi behe gebu fine firo gifa "
         "biro deli cecu dude dewe duza fini data dawi feru dezo camu femu finu coha").split()


# --------------------------------------------------------------------------------------
# the workload
# --------------------------------------------------------------------------------------
def good_requests(model: str, n: int, seed: int) -> list[dict]:
    """``n`` distinct greedy requests (a third of them chat; every fourth with ``logit_bias``
    and frequency / presence penalties)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12)))
        mt = rng.randint(8, 48)
        extra = {}
        if i % 4 == 1:
            extra = {"logit_bias": {str(rng.randint(3, 999)): rng.choice([-100, -5, 5])},
                     "frequency_penalty": rng.choice([0.5, 2.0]), "presence_penalty": rng.choice([-1.0, 1.0])}
        if i % 3 == 2:
            out.append({"path": "/v1/chat/completions", "chat": True,
                        "body": {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": mt,
                                 "temperature": 0, **extra}})
        else:
            out.append({"path": "/v1/completions", "chat": False,
                        "body": {"model": model, "prompt": text, "max_tokens": mt, "temperature": 0, **extra}})
    return out


def bomb_png(width: int = 9000, height: int = 9000) -> bytes:
    """A 1 x 1 PNG whose header claims ``width x height`` pixels (a decompression bomb's header)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00\x00"))
            + chunk(b"IEND", b""))


def _image_chat(model: str, url: str) -> bytes:
    return json.dumps({"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": url}}]}]}).encode()


def bad_request(rng: random.Random, model: str, max_body: int, faults: bool = False,
                pick: int | None = None) -> tuple[str, bytes, set[int], str]:
    """``(path, raw body, accepted statuses, kind)`` of one bad request (``faults``: also requests
    that pass validation and then fail while decoding, see :mod:`mtpflow.serve.faults`); ``pick``:
    the kind's index (modulo their number; default: a random kind)."""
    base = {"model": model, "prompt": "beca daka", "max_tokens": 8}

    def j(**kw):
        return json.dumps({**base, **kw}).encode()

    import base64

    bomb = "data:image/png;base64," + base64.b64encode(bomb_png()).decode()
    chat = "/v1/chat/completions"
    kinds = [
        ("image-local-file", lambda: _image_chat(model, rng.choice(["/etc/passwd", "file:///etc/hostname", "../x.png",
                                                                    "/nonexistent.png"])), {400}, chat),
        ("image-bomb", lambda: _image_chat(model, bomb), {400}, chat),
        ("logit_bias-bad-key", lambda: j(logit_bias={rng.choice(["x", "-1", "99999999"]): 1}), {400}),
        ("logit_bias-out-of-range", lambda: j(logit_bias={"5": 150}), {400}),
        ("frequency_penalty-3", lambda: j(frequency_penalty=3), {400}),
        ("echo", lambda: j(echo=True), {400}),
        ("best_of", lambda: j(best_of=2), {400}),
        ("suffix", lambda: j(suffix="end"), {400}),
        ("seed-negative", lambda: j(seed=-rng.randint(1, 2**40), temperature=0.7), {400}),
        ("seed-huge", lambda: j(seed=2**63 + rng.randint(0, 2**70), temperature=0.7), {400}),
        ("temperature-nan", lambda: b'{"model": "%s", "prompt": "beca", "temperature": NaN}' % model.encode(), {400}),
        ("top_p-zero", lambda: j(top_p=0), {400}),
        ("top_k-negative", lambda: j(top_k=-3), {400}),
        ("max_tokens-zero", lambda: j(max_tokens=0), {400}),
        ("max_tokens-huge", lambda: j(max_tokens=10**9), {400}),
        ("n-zero", lambda: j(n=0), {400}),
        ("logprobs-9", lambda: j(logprobs=9), {400}),
        ("type-confusion", lambda: j(temperature="hot"), {400}),
        ("token-out-of-vocab", lambda: j(prompt=[10**7]), {400}),
        ("unknown-model", lambda: j(model="nope"), {400}),
        ("deep-json", lambda: b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", {400}),
        ("lone-surrogate", lambda: b'{"model": "%s", "prompt": "beca \\ud83d daka"}' % model.encode(), {400}),
        ("not-utf8", lambda: b'{"model": "%s", "prompt": "beca \xc3\x28"}' % model.encode(), {400}),
        ("truncated-json", lambda: j()[: rng.randint(1, 20)], {400}),
        ("not-an-object", lambda: b"[1, 2, 3]", {400}),
        ("too-large", lambda: json.dumps({**base, "prompt": "beca " * (max_body // 5 + 10)}).encode(), {413}),
    ]
    if faults:
        from .faults import FAULT_PREFILL, FAULT_ROUND

        kinds += [
            ("fault-in-round", lambda: j(prompt=FAULT_ROUND + [rng.randint(3, 999)], max_tokens=30), {500}),
            ("fault-in-prefill", lambda: j(prompt=FAULT_PREFILL + [rng.randint(3, 999)], max_tokens=30), {500}),
        ]
        kinds += kinds[-2:] * 4  # a fair share of the bad requests
    kind, make, want, *path = rng.choice(kinds) if pick is None else kinds[pick % len(kinds)]
    return path[0] if path else "/v1/completions", make(), want, kind


def half_header(base: str, limit: float) -> tuple[bool, float]:
    """Open a connection, send half a request head and wait: ``(closed by the server
    within limit seconds, seconds it took)`` (the server's header timeout)."""
    u = urlparse(base)
    t = time.monotonic()
    with socket.create_connection((u.hostname, u.port), timeout=limit) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
        try:
            while s.recv(4096):
                pass
            closed = True
        except socket.timeout:
            closed = False
        except OSError:  # reset by the server
            closed = True
    return closed, time.monotonic() - t
