"""The router's HTTP/1.1 server, on asyncio's transports.

The router answers small requests whose bodies it forwards whole, so it needs this much of
HTTP/1.1's server side: a request's head parsed once, its body framed by Content-Length or
chunked coding (`Expect: 100-continue` answered), keep-alive connections (HTTP/1.1's default,
HTTP/1.0's `Connection: keep-alive`), pipelined requests answered in order, HEAD for every GET
route, and the answer written in one call. aiohttp's web server spent about 0.2 ms of CPU more
per request on this (request and response objects, a stream reader, signals, a multidict per
request), which on a small node is taken from the model servers beside the router
(docs/benchmarks.md, the router section).

What a server owes its clients besides:
- a malformed request gets a 400 (a head too long 431, a body over the limit 413, an unknown
  transfer coding 501) with a JSON error that says what is wrong, and the connection closes
  (its framing is lost);
- an unknown path gets a 404 and a known path with another method a 405 with `Allow`, both
  JSON;
- a handler that raises gets a 500 (logged with its traceback), never a dropped connection;
- a connection idle for `keepalive_seconds` (or stuck in a half-sent head that long) is closed;
- `close()` stops accepting, closes idle connections and answers every request already in
  flight with `Connection: close` (`shutdown` waits for them).
The client's disconnect is seen while its request is handled (`Request.gone()`), since the
connection keeps reading.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import http
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import unquote

import orjson

from .upstream import MAX_HEAD_BYTES, dechunk

log = logging.getLogger("warmgate.router")

MAX_HEADERS = 128
KEEPALIVE_SECONDS = 75.0  # aiohttp's and nginx's default
SWEEP_SECONDS = 5.0
LINGER_SECONDS = 2.0


class Headers:
    """A request's headers, read by any case of their names (repeated ones joined by ", ")."""

    __slots__ = ("_items",)

    def __init__(self, items: dict[str, str]) -> None:
        self._items = items  # lower-cased names

    def get(self, name: str, default: str | None = None) -> str | None:
        return self._items.get(name.lower(), default)

    def __getitem__(self, name: str) -> str:
        return self._items[name.lower()]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._items


class Request:
    __slots__ = ("_conn", "body", "headers", "match_info", "method", "path", "query", "version")

    def __init__(
        self,
        method: str,
        path: str,
        query: str,
        version: str,
        headers: Headers,
        body: bytes,
        connection: _Connection,
    ) -> None:
        self.method = method
        self.path = path
        self.query = query
        self.version = version
        self.headers = headers
        self.body = body
        self.match_info: dict[str, str] = {}
        self._conn = connection

    def gone(self) -> bool:
        """The client closed its connection (it will never read the answer)."""
        transport = self._conn.transport
        return transport is None or transport.is_closing()


class Response:
    __slots__ = ("body", "close", "headers", "status")

    def __init__(
        self,
        status: int = 200,
        body: bytes = b"",
        content_type: str | None = "application/json",
        headers: dict[str, str] | None = None,
    ) -> None:
        self.status = status
        self.body = body
        self.headers: dict[str, str] = {}
        if content_type:
            self.headers["Content-Type"] = content_type
        if headers:
            self.headers.update(headers)
        self.close = False
        """Close the connection after this answer (`Connection: close`)."""


Handler = Callable[[Request], Awaitable[Response]]


def json_response(status: int, body: Any, headers: dict[str, str] | None = None) -> Response:
    return Response(status, orjson.dumps(body), headers=headers)


class HttpError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers


class Routes:
    """Exact paths, and patterns with named groups (`match_info`), per method; GET routes
    answer HEAD too."""

    def __init__(self) -> None:
        self._exact: dict[str, dict[str, Handler]] = {}
        self._patterns: list[tuple[re.Pattern[str], dict[str, Handler]]] = []

    def add(self, method: str, path: str, handler: Handler) -> None:
        self._exact.setdefault(path, {})[method] = handler

    def add_pattern(self, method: str, pattern: str, handler: Handler) -> None:
        for compiled, methods in self._patterns:
            if compiled.pattern == pattern:
                methods[method] = handler
                return
        self._patterns.append((re.compile(pattern), {method: handler}))

    def find(self, request: Request) -> Handler:
        methods = self._exact.get(request.path)
        if methods is None:
            for compiled, candidates in self._patterns:
                match = compiled.fullmatch(request.path)
                if match:
                    request.match_info = match.groupdict()
                    methods = candidates
                    break
        if methods is None:
            raise HttpError(404, f"no route {request.path}")
        method = "GET" if request.method == "HEAD" else request.method
        handler = methods.get(method)
        if handler is None:
            allowed = ", ".join(sorted(methods))
            raise HttpError(
                405, f"{request.method} {request.path}: allowed {allowed}", {"Allow": allowed}
            )
        return handler


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return json_response(status, {"error": message, "error_type": _phrase(status)}, headers)


_date = ["", 0]


def _http_date() -> str:
    now = int(time.time())
    if _date[1] != now:
        _date[0] = email.utils.formatdate(now, usegmt=True)
        _date[1] = now
    return str(_date[0])


def _phrase(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


class Server:
    """Serves `routes`; `draining()` true makes every answer close its connection."""

    def __init__(
        self,
        routes: Routes,
        *,
        max_body: int,
        draining: Callable[[], bool] = lambda: False,
        keepalive_seconds: float = KEEPALIVE_SECONDS,
    ) -> None:
        self.routes = routes
        self.max_body = max_body
        self.draining = draining
        self.keepalive_seconds = keepalive_seconds
        self.connections: set[_Connection] = set()
        self.handling: set[asyncio.Task[None]] = set()
        """The requests being handled (also what keeps their tasks alive)."""
        self.closing = False
        self._listener: asyncio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen; the port (the one given, or the one picked for 0)."""
        loop = asyncio.get_running_loop()
        self._listener = await loop.create_server(
            lambda: _Connection(self), host, port, reuse_address=True
        )
        self._sweeper = loop.create_task(self._sweep())
        return int(self._listener.sockets[0].getsockname()[1])

    def close(self) -> None:
        """Stop accepting; close idle connections; busy ones close after their answer."""
        self.closing = True
        if self._listener is not None:
            self._listener.close()
        for connection in list(self.connections):
            if not connection.busy:
                connection.close()

    async def shutdown(self, seconds: float = 60.0) -> None:
        """close(), then wait up to `seconds` for the requests in flight to be answered."""
        self.close()
        if self.handling:
            await asyncio.wait(list(self.handling), timeout=seconds)
        for connection in list(self.connections):
            connection.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        if self._listener is not None:
            await self._listener.wait_closed()

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(min(SWEEP_SECONDS, self.keepalive_seconds / 2))
            now = time.monotonic()
            for connection in list(self.connections):
                if not connection.busy and now - connection.idle_since > self.keepalive_seconds:
                    connection.close()

    async def dispatch(self, request: Request) -> Response:
        try:
            handler = self.routes.find(request)
            return await handler(request)
        except HttpError as error:
            return _error(error.status, error.message, error.headers)
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            return _error(500, f"the router failed on {request.method} {request.path}")


class _Connection(asyncio.Protocol):
    """One client connection: requests read and answered one at a time, in order."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.busy = False
        self.idle_since = time.monotonic()
        self._head: tuple[str, str, str, dict[str, str]] | None = None
        self._framing = 0  # 0: no body, >0: Content-Length, -1: chunked
        self._chunks: list[bytes] = []
        self._continued = False
        self._paused = False
        self._lingering = False

    # -- asyncio.Protocol -----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # after an error answer: read and dropped until the client closes
        self.buffer += data
        if not self.busy:
            self.idle_since = time.monotonic()  # a request on its way: not idle
        else:
            # Pipelined, or the next request before this answer: read on (a hang-up must
            # be seen), but stop reading when a request's worth is waiting.
            if len(self.buffer) > self.server.max_body + MAX_HEAD_BYTES and not self._paused:
                self._paused = True
                assert self.transport is not None
                self.transport.pause_reading()
            return
        self._next()

    def eof_received(self) -> bool:
        return False  # the transport closes: gone() from now on

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    # -- requests -------------------------------------------------------------------------
    def _next(self) -> None:
        try:
            request = self._parse()
        except HttpError as error:
            self.busy = True
            self._write(_error(error.status, error.message), head_only=False, close=True)
            return
        if request is None:
            return
        self.busy = True
        keep_alive = _keep_alive(request)
        task = asyncio.get_running_loop().create_task(self._handle(request, keep_alive))
        self.server.handling.add(task)
        task.add_done_callback(self.server.handling.discard)

    async def _handle(self, request: Request, keep_alive: bool) -> None:
        response = await self.server.dispatch(request)
        close = not keep_alive or response.close or self.server.closing or self.server.draining()
        self._write(
            response,
            head_only=request.method == "HEAD",
            close=close,
            http10=request.version == "HTTP/1.0",
        )
        if close or self.transport is None or self.transport.is_closing():
            return  # a client that hung up: what it pipelined before is not run
        self.busy = False
        self.idle_since = time.monotonic()
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        if self.buffer:
            self._next()

    def _write(
        self, response: Response, *, head_only: bool, close: bool, http10: bool = False
    ) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        body = response.body
        lines = [
            f"HTTP/1.1 {response.status} {_phrase(response.status)}",
            f"Content-Length: {len(body)}",
            f"Date: {_http_date()}",
        ]
        lines += [f"{name}: {value}" for name, value in response.headers.items()]
        if close:
            lines.append("Connection: close")
        elif http10:
            lines.append("Connection: keep-alive")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        transport.write(head if head_only or not body else head + body)
        if not close:
            return
        if not self.buffer and response.status < 400:
            transport.close()
            return
        # The client may still be sending (a body refused unread, pipelined requests): closing
        # with unread bytes would reset the connection, and a reset can destroy the answer
        # before the client reads it. So: end our side, drop what comes, close at the
        # client's end or after LINGER_SECONDS (nginx's lingering close).
        self._lingering = True
        self.buffer.clear()
        if self._paused:
            self._paused = False
            transport.resume_reading()
        if transport.can_write_eof():
            transport.write_eof()
        asyncio.get_running_loop().call_later(LINGER_SECONDS, transport.close)

    def _parse(self) -> Request | None:
        buffer = self.buffer
        if self._head is None:
            # Blank lines before a request line are allowed (RFC 9112, 2.2).
            while buffer[:2] == b"\r\n":
                del buffer[:2]
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(buffer) > MAX_HEAD_BYTES:
                    raise HttpError(
                        431, f"the request's head is longer than {MAX_HEAD_BYTES} bytes"
                    )
                return None
            if end > MAX_HEAD_BYTES:
                raise HttpError(431, f"the request's head is longer than {MAX_HEAD_BYTES} bytes")
            self._head = _parse_head(bytes(buffer[:end]))
            del buffer[: end + 4]
            headers = self._head[3]
            self._framing, self._continued = _framing(headers, self.server.max_body)
            self._chunks = []
        if self._framing > 0 and len(buffer) < self._framing:
            self._continue()
            return None
        if self._framing == -1:
            try:
                done = dechunk(buffer, self._chunks)
            except ValueError as error:
                raise HttpError(400, f"the chunked body is malformed: {error}") from None
            if sum(len(c) for c in self._chunks) > self.server.max_body:
                raise HttpError(413, f"the request body is over {self.server.max_body} bytes")
            if not done:
                self._continue()
                return None
            body = b"".join(self._chunks)
            self._chunks = []
        elif self._framing > 0:
            body = bytes(buffer[: self._framing])
            del buffer[: self._framing]
        else:
            body = b""
        method, target, version, headers = self._head
        self._head = None
        path, _, query = target.partition("?")
        return Request(method, unquote(path), query, version, Headers(headers), body, self)

    def _continue(self) -> None:
        """`Expect: 100-continue`: the client waits for this before it sends the body."""
        if not self._continued and self.transport is not None:
            self._continued = True
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")


def _parse_head(raw: bytes) -> tuple[str, str, str, dict[str, str]]:
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[0].isalpha() or not parts[0].isupper():
        raise HttpError(400, f"bad request line {lines[0][:80]!r}")
    method, target, version = parts
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise HttpError(
            505 if version.startswith("HTTP/") else 400, f"bad version {version[:20]!r}"
        )
    if not target.startswith("/"):
        raise HttpError(400, f"request target {target[:80]!r} is not a path")
    if len(lines) - 1 > MAX_HEADERS:
        raise HttpError(431, f"more than {MAX_HEADERS} header lines")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip() or " " in name:
            raise HttpError(400, f"bad header line {line[:80]!r}")
        lower = name.lower()
        value = value.strip()
        if lower in headers:
            if lower in ("content-length", "host") and headers[lower] != value:
                raise HttpError(400, f"two different {name} headers")
            if lower not in ("content-length", "host"):
                headers[lower] += ", " + value
        else:
            headers[lower] = value
    return method, target, version, headers


def _framing(headers: dict[str, str], max_body: int) -> tuple[int, bool]:
    """(framing, continued): Content-Length n > 0, chunked -1, no body 0; continued is False
    when the client waits for `100 Continue` before its body."""
    coding = headers.get("transfer-encoding")
    length = headers.get("content-length")
    continued = headers.get("expect", "").lower() != "100-continue"
    if coding is not None:
        if length is not None:
            raise HttpError(400, "both Transfer-Encoding and Content-Length")
        if coding.lower() != "chunked":
            raise HttpError(501, f"Transfer-Encoding {coding[:40]!r}: only chunked is served")
        return -1, continued
    if length is None:
        return 0, True
    if not length.isdigit():
        raise HttpError(400, f"Content-Length {length[:40]!r} is not a number")
    size = int(length)
    if size > max_body:
        raise HttpError(413, f"the request body ({size} bytes) is over {max_body} bytes")
    return size, continued if size else True


def _keep_alive(request: Request) -> bool:
    connection = (request.headers.get("connection") or "").lower()
    if request.version == "HTTP/1.1":
        return "close" not in connection
    return "keep-alive" in connection
