"""The HTTP layer of ``mtpflow serve``: address checks, the listening socket and uvicorn's limits.

* :func:`check_address` refuses a bad ``--host`` / ``--port`` with one line, before the model loads;
  :func:`bind` binds the socket (one line if the address is taken), also before the model loads.
* :func:`uvicorn_config` sets uvicorn's connection limits: ``timeout_keep_alive`` (an idle
  keep-alive connection closes after it), ``h11_max_incomplete_event_size`` (the largest request
  head), ``limit_concurrency`` (past it requests get 503) and -- uvicorn 0.55 has no such option --
  a **header timeout**: :func:`header_timeout_protocol` is uvicorn's h11 protocol that closes a
  connection whose request head has not fully arrived within ``header_timeout`` seconds of its
  first byte (or of the connection opening), so connections that send nothing or half a header
  cannot pile up; and a **body timeout**: a connection whose request body stalls (no byte of it
  for ``body_timeout`` seconds while the body is incomplete and uvicorn is reading) is closed, so
  a client that sends its head and then a trickle or nothing cannot hold a request open.
* :func:`serve` runs uvicorn on the bound socket and prints "serving on ..." once it listens.

Nothing here imports uvicorn at module level.
"""

from __future__ import annotations

import ipaddress
import socket

#: seconds a connection may take to send its whole request head (``--header-timeout``)
DEFAULT_HEADER_TIMEOUT = 10.0
#: seconds a request body may go without a byte before its connection is closed (``--body-timeout``)
DEFAULT_BODY_TIMEOUT = 30.0
#: seconds an idle keep-alive connection stays open (``--timeout-keep-alive``; uvicorn's default)
DEFAULT_KEEP_ALIVE = 5
#: bytes of a request head: request line and headers (``--max-header-size``; h11's default)
DEFAULT_MAX_HEADER_SIZE = 16 * 1024
#: concurrent connections + requests before new requests get 503 (``--limit-concurrency``)
DEFAULT_LIMIT_CONCURRENCY = 1024


def check_address(host: str, port: int) -> None:
    """Raise :class:`~mtpflow.config.ConfigError` (one line) for a port outside
    ``0..65535`` (0: any free port) or a host that is neither an IP address nor a
    name this machine resolves."""
    from ..config import ConfigError

    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(f"--port must be in 0..65535 (got {port}); 0 picks a free port")
    if not host:
        raise ConfigError("--host must not be empty (e.g. 127.0.0.1, or 0.0.0.0 for every interface)")
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise ConfigError(f"--host {host!r} does not resolve ({exc}); use an IP address such as 127.0.0.1") from None


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``(host, port)`` (not yet listening), or a one-line
    :class:`~mtpflow.config.ConfigError` (address in use, not this machine's, no permission)."""
    from ..config import ConfigError

    check_address(host, port)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def header_timeout_protocol(seconds: float, body_seconds: float = DEFAULT_BODY_TIMEOUT):
    """uvicorn's h11 protocol class with a header timeout of ``seconds``: a
    connection is closed when its request head is not complete ``seconds``
    after the connection opened (first request) or after the head's first byte
    arrived (later requests; between requests uvicorn's keep-alive timeout
    applies).  While a request body is incomplete, a connection that sends no
    byte of it for ``body_seconds`` is closed too (the app sees a disconnect);
    the clock does not run while uvicorn itself has paused reading (the app has
    not consumed what arrived)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class TimeoutH11Protocol(H11Protocol):
        header_timeout = float(seconds)
        body_timeout = float(body_seconds)

        def connection_made(self, transport) -> None:
            self._head_timer = self._body_timer = None
            super().connection_made(transport)
            self._arm_head_timer()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE:  # still waiting for (the rest of) a request head
                self._arm_head_timer()
            else:
                self._cancel_head_timer()
            self._cancel_body_timer()
            if self.conn.their_state is h11.SEND_BODY:  # each byte of the body restarts its clock
                self._arm_body_timer()

        def connection_lost(self, exc) -> None:
            self._cancel_head_timer()
            self._cancel_body_timer()
            super().connection_lost(exc)

        def _arm_head_timer(self) -> None:
            if self._head_timer is None and not self.transport.is_closing():
                self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

        def _arm_body_timer(self) -> None:
            if not self.transport.is_closing():
                self._body_timer = self.loop.call_later(self.body_timeout, self._body_timed_out)

        def _cancel_body_timer(self) -> None:
            if self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None

        def _body_timed_out(self) -> None:
            self._body_timer = None
            if self.conn.their_state is not h11.SEND_BODY or self.transport.is_closing():
                return
            if getattr(getattr(self, "flow", None), "read_paused", False):  # waiting on the app, not the client
                self._arm_body_timer()
                return
            self.transport.close()

    return TimeoutH11Protocol


def uvicorn_config(app, *, log_level: str = "info", header_timeout: float = DEFAULT_HEADER_TIMEOUT,
                   body_timeout: float = DEFAULT_BODY_TIMEOUT, timeout_keep_alive: int = DEFAULT_KEEP_ALIVE,
                   max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
                   limit_concurrency: int | None = DEFAULT_LIMIT_CONCURRENCY, **kw):
    """A ``uvicorn.Config`` for ``app`` with mtpflow's connection limits (module docstring)."""
    import uvicorn

    return uvicorn.Config(app, http=header_timeout_protocol(header_timeout, body_timeout), timeout_keep_alive=int(timeout_keep_alive),
                          h11_max_incomplete_event_size=int(max_header_size), limit_concurrency=limit_concurrency,
                          log_level=log_level, lifespan="on", **kw)


def listening_server(config, sock: socket.socket, on_listening):
    """A ``uvicorn.Server`` for ``config`` that calls ``on_listening(port)`` (the
    port ``sock`` really has) once it listens; run it with ``.run(sockets=[sock])``."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if self.started:
                on_listening(sock.getsockname()[1])

    return Server(config)


def serve(config, sock: socket.socket, on_listening) -> None:
    """Run uvicorn with ``config`` on the bound ``sock`` until interrupted (see :func:`listening_server`)."""
    try:
        listening_server(config, sock, on_listening).run(sockets=[sock])
    finally:
        sock.close()


__all__ = [
    "DEFAULT_BODY_TIMEOUT", "DEFAULT_HEADER_TIMEOUT", "DEFAULT_KEEP_ALIVE", "DEFAULT_LIMIT_CONCURRENCY", "DEFAULT_MAX_HEADER_SIZE", "bind",
    "check_address", "header_timeout_protocol", "listening_server", "serve", "uvicorn_config",
]
