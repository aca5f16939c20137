"""The HTTP edge of `kvcore serve`: a connection cap, a header read timeout, and aiohttp's own
parser errors answered as OpenAI-style JSON and logged as one line without request bytes."""

from __future__ import annotations

import asyncio
import json
from http import HTTPStatus
from typing import Any

import structlog
from aiohttp import web
from aiohttp.typedefs import Handler
from aiohttp.web import BaseRequest, RequestHandler

from kvcore.service.errors import APIError

log = structlog.get_logger("kvcore.service")

DEFAULT_MAX_CONNECTIONS = 1024
# from a connection's opening (a later request's: its first byte) to the complete header block
DEFAULT_HEADER_TIMEOUT_S = 30.0
KEEPALIVE_TIMEOUT_S = 75.0  # an idle keep-alive connection is closed after this
# after an early answer (413, 408) aiohttp reads and drops the rest of the body for this long
# before it closes (aiohttp's default is 10 s: a stalled client would keep the connection)
LINGERING_TIME_S = 2.0
REFUSE_LINGER_S = 0.5  # a refused connection (over the cap) is closed this long after its 503
SUPPORTED_VERSIONS = ((1, 0), (1, 1))  # this socket speaks HTTP/1 only


def _raw_response(status: int, message: str) -> bytes:
    """A complete HTTP/1.1 response that closes the connection, written straight to a transport
    (the connection never reached aiohttp's handler, or it is stuck inside its parser)."""
    body = json.dumps(APIError(status, message).body(), separators=(",", ":")).encode()
    phrase = HTTPStatus(status).phrase
    head = (f"HTTP/1.1 {status} {phrase}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode() + body


class JSONErrorHandler(RequestHandler):
    """aiohttp's connection handler whose parser errors (request line or header too long, bad
    Content-Length, Content-Length with Transfer-Encoding, bad chunk size, bare LF, a NUL in a
    header, ...) answer a JSON error body, and are logged with the status and the error's class
    only: the error text quotes request bytes, which can hold an API key."""

    def handle_error(self, request: BaseRequest, status: int = 500,
                     exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        log.warning("bad http request", status=status,
                    error=type(exc).__name__ if exc is not None else None)
        if request.writer.output_size > 0:  # as aiohttp: too late for another response
            raise ConnectionError("the response has started; cannot send an error response")
        phrase = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else "Error"
        response = web.json_response(APIError(status, f"bad HTTP request: {phrase}").body(),
                                     status=status)
        response.force_close()
        return response


def _unsupported_version(request: web.Request) -> web.StreamResponse:
    """505 for a request line naming another HTTP version (`HTTP/2.0` on this HTTP/1 socket),
    written raw: aiohttp would answer in the request's own version. The connection closes; the
    response returned only lets aiohttp finish (its write meets the closed transport)."""
    major, minor = request.version
    log.warning("bad http request", status=505, error="HTTPVersionNotSupported",
                version=f"{major}.{minor}")
    transport = request.transport
    if transport is not None and not transport.is_closing():
        transport.write(_raw_response(505, f"HTTP/{major}.{minor} is not supported: this "
                                           "server speaks HTTP/1.0 and HTTP/1.1"))
        transport.close()
    return web.Response(status=505)


class _Connection(asyncio.Protocol):
    """One client connection: counts toward the cap, and is closed when a request's header
    block does not complete within the header timeout (slowloris: a 408), or when it opens and
    sends nothing for that long (silently: no request to answer). The timer starts when the
    connection opens, again at the first byte of each later request, and stops when a request
    reaches the application."""

    def __init__(self, edge: Edge, handler: RequestHandler | None) -> None:
        self.edge = edge
        self.handler = handler  # None: refused (over the connection cap)
        self.transport: asyncio.Transport | None = None
        self.in_app = False
        self.received = False  # any byte yet
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if self.handler is None:
            log.warning("connection refused", reason="max_connections",
                        max_connections=self.edge.max_connections)
            transport.write(_raw_response(503, f"the server holds its maximum of "
                                          f"{self.edge.max_connections} connections; retry "
                                          "later"))
            # close a moment later: closing with the client's request unread would reset the
            # connection and could drop the answer before the client reads it
            asyncio.get_running_loop().call_later(REFUSE_LINGER_S, transport.close)
            return
        self.edge.connections[transport] = self
        self.handler.connection_made(transport)
        self._start_timer()  # a socket that never sends a byte holds a slot no longer

    def data_received(self, data: bytes) -> None:
        if self.handler is None:
            return
        self.received = True
        if not self.in_app and self._timer is None:
            self._start_timer()
        self.handler.data_received(data)

    def eof_received(self) -> bool | None:
        if self.handler is not None:
            self.handler.eof_received()
        return None  # the transport closes itself (a refused connection: at once)

    def pause_writing(self) -> None:
        if self.handler is not None:
            self.handler.pause_writing()

    def resume_writing(self) -> None:
        if self.handler is not None:
            self.handler.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        if self.handler is None:
            return
        self.edge.num_open -= 1
        if self.transport is not None:
            self.edge.connections.pop(self.transport, None)
        self.handler.connection_lost(exc)

    def entered(self) -> None:
        self.in_app = True
        self._cancel_timer()

    def left(self) -> None:
        self.in_app = False

    def _start_timer(self) -> None:
        self._timer = asyncio.get_running_loop().call_later(self.edge.header_timeout,
                                                            self._header_timeout)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _header_timeout(self) -> None:
        self._timer = None
        transport = self.transport
        if self.in_app or transport is None or transport.is_closing():
            return
        if not self.received:
            log.warning("connection closed", reason="idle_timeout",
                        timeout_s=self.edge.header_timeout)
            transport.close()
            return
        log.warning("connection closed", reason="header_timeout",
                    timeout_s=self.edge.header_timeout)
        transport.write(_raw_response(408, f"the request header did not arrive within "
                                      f"{self.edge.header_timeout:g} s"))
        transport.close()


class Edge:
    """Serves an application through aiohttp's public runner with the guards above:
    `install(app)` before the runner's setup, then `protocol_factory(runner)` for
    `loop.create_server`."""

    def __init__(self, max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 header_timeout: float = DEFAULT_HEADER_TIMEOUT_S) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        if header_timeout <= 0:
            raise ValueError(f"header_timeout must be > 0, got {header_timeout}")
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self.connections: dict[asyncio.BaseTransport, _Connection] = {}
        self.num_open = 0  # accepted connections not yet lost (the cap counts these)
        # RequestHandler's options: no access log (the app logs one line per request), bodies
        # are never decompressed (a Content-Encoding is refused with 415)
        self.handler_args: dict[str, Any] = {"access_log": None, "auto_decompress": False,
                                             "keepalive_timeout": KEEPALIVE_TIMEOUT_S,
                                             "lingering_time": LINGERING_TIME_S}

    def install(self, app: web.Application) -> None:
        """The middleware that tells a connection its request reached the application."""

        @web.middleware
        async def _arrived(request: web.Request, handler: Handler) -> web.StreamResponse:
            if tuple(request.version) not in SUPPORTED_VERSIONS:
                return _unsupported_version(request)
            connection = self.connections.get(request.transport)  # type: ignore[arg-type]
            if connection is not None:
                connection.entered()
            try:
                return await handler(request)
            finally:
                if connection is not None:
                    connection.left()

        app.middlewares.insert(0, _arrived)

    def protocol_factory(self, runner: web.AppRunner) -> Any:
        server = runner.server
        assert server is not None, "set the runner up first"
        loop = asyncio.get_running_loop()

        def make() -> _Connection:
            # counted here, not in connection_made: one accept batch calls the factory for
            # every connection before any of them is made
            if self.num_open >= self.max_connections:
                return _Connection(self, None)
            self.num_open += 1
            return _Connection(self, JSONErrorHandler(server, loop=loop, **self.handler_args))

        return make
