"""The HTTP layer of ``mtpflow serve`` (no model needed): connection limits and startup errors."""

from __future__ import annotations

import socket
import threading
import time

import pytest

pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")

from conftest import FIXTURES  # noqa: E402

TARGET = FIXTURES / "pair_e" / "target"


def _app():
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def health(request):
        return JSONResponse({"status": "ok"})

    async def echo(request):
        return JSONResponse({"bytes": len(await request.body())})

    return Starlette(routes=[Route("/health", health), Route("/echo", echo, methods=["POST"])])


@pytest.fixture()
def limited():
    """A server with a 0.5 s header timeout, a 0.6 s body timeout, a 1 s keep-alive and 4 KiB heads; its port."""
    from mtpflow.serve.http import bind, listening_server, uvicorn_config

    sock = bind("127.0.0.1", 0)
    heard: list[int] = []
    cfg = uvicorn_config(_app(), log_level="warning", header_timeout=0.5, body_timeout=0.6,
                         timeout_keep_alive=1, max_header_size=4096)
    srv = listening_server(cfg, sock, heard.append)
    t = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    deadline = time.monotonic() + 20
    while not heard:
        assert time.monotonic() < deadline and t.is_alive(), "server did not start"
        time.sleep(0.02)
    assert heard == [sock.getsockname()[1]]  # called once, when listening, with the real port
    yield heard[0]
    srv.should_exit = True
    t.join(10)
    sock.close()


def _closed_within(conn: socket.socket, limit: float) -> float:
    """Seconds until the server closed ``conn`` (fails past ``limit``)."""
    conn.settimeout(limit)
    t = time.monotonic()
    try:
        while conn.recv(4096):
            pass
    except socket.timeout:
        pytest.fail(f"the connection was still open after {limit} s")
    except ConnectionResetError:
        pass
    return time.monotonic() - t


def test_half_a_header_or_nothing_is_closed_at_the_header_timeout(limited):
    port = limited
    silent = socket.create_connection(("127.0.0.1", port))
    half = socket.create_connection(("127.0.0.1", port))
    half.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    slow = socket.create_connection(("127.0.0.1", port))
    t0 = time.monotonic()
    for _ in range(4):  # a byte at a time (slowloris) does not extend the deadline
        slow.sendall(b"X-A: b\r\n")
        time.sleep(0.2)
    for conn in (silent, half, slow):
        _closed_within(conn, 3.0)
        conn.close()
    assert time.monotonic() - t0 < 3.0
    # a complete request is answered, and its idle keep-alive connection closes after timeout_keep_alive
    ok = socket.create_connection(("127.0.0.1", port))
    ok.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert b"200 OK" in ok.recv(4096)
    assert 0.7 < _closed_within(ok, 3.0) < 2.5
    ok.close()
    # an unfinished request head past max_header_size is refused at once
    big = socket.create_connection(("127.0.0.1", port))
    big.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 8192)
    big.settimeout(3)
    assert big.recv(4096).startswith(b"HTTP/1.1 4")
    big.close()


def test_a_stalled_body_is_closed_and_a_slow_steady_one_is_answered(limited):
    port = limited
    head = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\nContent-Length: 40\r\n\r\n"
    stalled = socket.create_connection(("127.0.0.1", port))
    stalled.sendall(head + b"a" * 10)  # then nothing
    assert _closed_within(stalled, 3.0) < 2.0
    stalled.close()
    steady = socket.create_connection(("127.0.0.1", port))
    steady.sendall(head)
    t0 = time.monotonic()
    for _ in range(8):  # 1.6 s in all, longer than the body timeout, but never 0.6 s without a byte
        steady.sendall(b"b" * 5)
        time.sleep(0.2)
    steady.settimeout(3)
    reply = steady.recv(4096)
    assert time.monotonic() - t0 > 0.6 and b"200 OK" in reply and b'{"bytes":40}' in reply, reply
    steady.close()


def _cli(capsys, *argv):
    from mtpflow.cli import main

    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("argv, needle", [
    (("--port", "99999"), "--port must be in 0..65535"),
    (("--port", "-1"), "--port must be in 0..65535"),
    (("--host", "no.such.host.invalid"), "does not resolve"),
    (("--host", "203.0.113.7"), "cannot listen on 203.0.113.7"),  # not this machine's address
    (("--header-timeout", "0"), "--header-timeout"),
    (("--body-timeout", "-1"), "--body-timeout"),
    (("--limit-concurrency", "-2"), "--limit-concurrency"),
    (("--max-header-size", "lots"), "--max-header-size"),
    (("--allowed-local-media-path", "/nonexistent/dir"), "is not a directory"),
])
def test_startup_errors_are_one_line_before_the_model_loads(capsys, argv, needle):
    # the model does not exist: an error about it would mean the address was checked after loading
    rc, out, err = _cli(capsys, "serve", "--model", "/nonexistent/model", *argv)
    assert rc == 2 and "serving" not in out, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mtpflow: error: ") and needle in lines[0], err


def test_a_busy_port_is_one_line(capsys):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        rc, out, err = _cli(capsys, "serve", "--model", "/nonexistent/model", "--port", busy.getsockname()[1])
    finally:
        busy.close()
    assert rc == 2 and "serving" not in out and "cannot listen on 127.0.0.1" in err and len(err.strip().splitlines()) == 1
