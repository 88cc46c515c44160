"""The router's HTTP/1.1 server, on asyncio's transports.

The router answers small requests whose bodies it forwards whole, so it needs this much of
HTTP/1.1's server side: a request's head parsed once, its body framed by Content-Length or
chunked coding (`Expect: 100-continue` answered), keep-alive connections (HTTP/1.1's default,
HTTP/1.0's `Connection: keep-alive`), pipelined requests answered in order, HEAD for every GET
route, and the answer written in one call. aiohttp's web server spent about 0.2 ms of CPU more
per request on this (request and response objects, a stream reader, signals, a multidict per
request), which on a small node is taken from the model servers beside the router
(docs/benchmarks.md, the router section).

The framing is llhttp's (httptools' HttpRequestParser, strict): what it refuses (two
Content-Lengths, Content-Length with Transfer-Encoding, a chunk size or Content-Length that is
not plain digits, CR, LF or NUL in a header value, obs-fold, ...) is answered 400 like any
malformed request, after the requests before it, and nothing after it is read (docs/router.md).

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
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn
from urllib.parse import unquote

import httptools
import orjson

from .upstream import MAX_HEAD_BYTES

log = logging.getLogger("warmgate.router")

MAX_HEADERS = 128
KEEPALIVE_SECONDS = 75.0  # aiohttp's and nginx's default
SWEEP_SECONDS = 5.0
LINGER_SECONDS = 2.0
MAX_QUEUED = 32  # pipelined requests read ahead of their answers
_HEAD_TOO_LONG = f"the request's head is longer than {MAX_HEAD_BYTES} bytes"


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
    """One client connection: requests read and answered one at a time, in order.

    llhttp (httptools) frames the requests as they come; each whole one (or the error that
    ended the connection's framing) waits in `queue` until the ones before it are answered."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.queue: deque[Request | HttpError] = deque()
        self.busy = False
        self.idle_since = time.monotonic()
        self._backlog = 0  # bytes read while busy, until the queue is empty again
        self._paused = False
        self._lingering = False
        self._ended = False  # llhttp stopped (an error, an upgrade): nothing more is parsed
        self._error: HttpError | None = None  # raised by a callback, answered for llhttp's
        # The request being read.
        self._in_message = False
        self._in_head = False
        self._head_bytes = 0
        self._head_seen = 0
        self._url = b""
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._size = 0
        self._expect = False
        self._continued = False

    # -- asyncio.Protocol -----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        if self._lingering or self._ended:
            return  # after an error answer: read and dropped until the client closes
        if not self.busy:
            self.idle_since = time.monotonic()  # a request on its way: not idle
        in_head = self._in_head
        try:
            self.parser.feed_data(data)
            if self._in_head:
                # llhttp keeps a header line until its end: bound what a head may hold.
                if in_head:
                    self._head_seen += len(data)
                if self._head_seen > MAX_HEAD_BYTES:
                    raise HttpError(431, _HEAD_TOO_LONG)
        except HttpError as error:
            self._end(error)
        except httptools.HttpParserUpgrade:
            # A request with `Connection: upgrade` (whole, queued; answered, never upgraded)
            # or CONNECT (refused by its target): llhttp reads nothing after it.
            self._end(self._error)
        except httptools.HttpParserError as error:
            self._end(self._error or self._refusal(error))
        if self.busy:
            # Pipelined, or the next request before this answer: read on (a hang-up must be
            # seen), but stop reading when a request's worth is waiting.
            self._backlog += len(data)
            if (
                self._backlog > self.server.max_body + MAX_HEAD_BYTES
                or len(self.queue) >= MAX_QUEUED
            ) and not self._paused:
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

    # -- llhttp's callbacks ---------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._in_message = True
        self._in_head = True
        self._head_bytes = 0
        self._head_seen = 0
        self._url = b""
        self._headers = {}
        self._body = []
        self._size = 0
        self._expect = False
        self._continued = False

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_bytes += len(url)
        if self._head_bytes > MAX_HEAD_BYTES:
            self._raise(HttpError(431, _HEAD_TOO_LONG))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > MAX_HEAD_BYTES:
            self._raise(HttpError(431, _HEAD_TOO_LONG))
        headers = self._headers
        if len(headers) >= MAX_HEADERS:
            self._raise(HttpError(431, f"more than {MAX_HEADERS} header lines"))
        lower = name.decode("latin-1").lower()
        text = value.decode("latin-1").strip(" \t")
        if lower in headers:
            if lower == "host":
                if headers[lower] != text:
                    self._raise(HttpError(400, "two different Host headers"))
                return
            headers[lower] += ", " + text
        else:
            headers[lower] = text

    def on_headers_complete(self) -> None:
        self._in_head = False
        version = self.parser.get_http_version()
        if version not in ("1.1", "1.0"):
            if version == "0.9":  # llhttp's reading of a request line with no version
                self._raise(HttpError(400, "bad request line: no HTTP version"))
            self._raise(HttpError(505, f"bad version HTTP/{version}"))
        if not self._url.startswith(b"/"):
            target = self._url[:80].decode("latin-1")
            self._raise(HttpError(400, f"request target {target!r} is not a path"))
        headers = self._headers
        has_body = False
        coding = headers.get("transfer-encoding")
        if coding is not None:
            if coding.lower() != "chunked":
                self._raise(
                    HttpError(501, f"Transfer-Encoding {coding[:40]!r}: only chunked is served")
                )
            has_body = True
        else:
            length = headers.get("content-length")
            if length is not None:
                # llhttp took it: one header, ASCII digits only.
                size = int(length)
                if size > self.server.max_body:
                    self._raise(
                        HttpError(
                            413,
                            f"the request body ({size} bytes) is over {self.server.max_body} bytes",
                        )
                    )
                has_body = size > 0
        self._expect = has_body and headers.get("expect", "").lower() == "100-continue"

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > self.server.max_body:
            self._raise(HttpError(413, f"the request body is over {self.server.max_body} bytes"))
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._in_message = False
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._body = []
        path, _, query = self._url.decode("latin-1").partition("?")
        method = self.parser.get_method().decode("latin-1")
        version = "HTTP/" + self.parser.get_http_version()
        self.queue.append(
            Request(method, unquote(path), query, version, Headers(self._headers), body, self)
        )

    def _raise(self, error: HttpError) -> NoReturn:
        self._error = error
        raise error

    def _refusal(self, error: httptools.HttpParserError) -> HttpError:
        """What llhttp refused, said in the words of the request's parts."""
        reason = (
            str(error.__context__ or error)
            if isinstance(error, httptools.HttpParserCallbackError)
            else str(error)
        )
        if isinstance(error, httptools.HttpParserInvalidMethodError):
            return HttpError(400, f"bad request line: {reason}")
        if isinstance(error, httptools.HttpParserInvalidURLError):
            return HttpError(400, f"bad request line: the target is not a URL ({reason})")
        if reason == "Duplicate Content-Length":
            return HttpError(400, "two different Content-Length headers, or one repeated")
        if "Content-Length can't be present" in reason:
            return HttpError(400, "both Transfer-Encoding and Content-Length")
        if "Content-Length" in reason:
            return HttpError(400, f"the Content-Length is not a number of ASCII digits ({reason})")
        if "Transfer-Encoding" in reason:
            return HttpError(400, f"the Transfer-Encoding is malformed ({reason})")
        if not self._in_head and self._in_message:
            return HttpError(400, f"the chunked body is malformed: {reason}")
        if self._url and ("header" in reason or "after start line" in reason):
            return HttpError(400, f"bad header line: {reason}")
        return HttpError(400, f"bad request line: {reason}")

    # -- requests -------------------------------------------------------------------------
    def _end(self, error: HttpError | None) -> None:
        """llhttp stops here: the requests before are answered, then this error (or, with
        none, the connection closes after them)."""
        self._ended = True
        self._error = None
        self._in_message = False
        if error is not None:
            self.queue.append(error)

    def _next(self) -> None:
        if not self.queue:
            self._backlog = 0
            if self._ended:
                self.busy = True
                self.close()
            else:
                self._continue()
            return
        item = self.queue.popleft()
        self.busy = True
        if isinstance(item, HttpError):
            self._write(_error(item.status, item.message), head_only=False, close=True)
            return
        keep_alive = _keep_alive(item)
        task = asyncio.get_running_loop().create_task(self._handle(item, keep_alive))
        self.server.handling.add(task)
        task.add_done_callback(self.server.handling.discard)

    async def _handle(self, request: Request, keep_alive: bool) -> None:
        response = await self.server.dispatch(request)
        close = not keep_alive or response.close or self.server.closing or self.server.draining()
        if self._ended and not self.queue:
            close = True  # llhttp read nothing after this request
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
        if not self._in_message and not self.queue and response.status < 400:
            transport.close()
            return
        # The client may still be sending (a body refused unread, pipelined requests): closing
        # with unread bytes would reset the connection, and a reset can destroy the answer
        # before the client reads it. So: end our side, drop what comes, close at the
        # client's end or after LINGER_SECONDS (nginx's lingering close).
        self._lingering = True
        self.queue.clear()
        if self._paused:
            self._paused = False
            transport.resume_reading()
        if transport.can_write_eof():
            transport.write_eof()
        asyncio.get_running_loop().call_later(LINGER_SECONDS, transport.close)

    def _continue(self) -> None:
        """`Expect: 100-continue`: the client waits for this before it sends the body; sent
        once the request is the next to answer and its body has not come whole."""
        if (
            self._expect
            and not self._continued
            and self._in_message
            and not self._in_head
            and self.transport is not None
        ):
            self._continued = True
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")


def _keep_alive(request: Request) -> bool:
    connection = (request.headers.get("connection") or "").lower()
    if request.version == "HTTP/1.1":
        return "close" not in connection
    return "keep-alive" in connection
