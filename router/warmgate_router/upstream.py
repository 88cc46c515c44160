"""The router's connections to pods: HTTP/1.1 on asyncio's transports, pooled per pod.

The router sends one kind of request (a small POST or GET with a known body) and reads whole
answers, so this is all of HTTP/1.1's client side it needs: the request written in one call,
the answer framed by llhttp (httptools' HttpResponseParser, strict) by Content-Length, chunked
encoding or the end of the connection; the headers it is given are sent as they are (the
proxy checked the client's: `proxy.forwarded_headers`).
aiohttp's ClientSession did the same with about twice the CPU per request
(timers, a stream reader, a response object and a multidict per answer), which on a small node
is taken from the model servers next to the router (docs/benchmarks.md, the router section).

Errors say what the caller may do:
- `NotSent`: no connection was made (refused, unreachable, none within the connect timeout),
  so the pod never saw the request and another pod may take it;
- `Failed`: the request was written; the answer did not come whole (the connection ended
  early, the answer was malformed, the answer timeout passed), so the request may have run.

An idle connection is reused (the most recently used first) unless the pod closed it or it
has been idle longer than `keepalive_seconds`; an answer with `Connection: close`, or one
framed by the end of the connection, closes it after reading.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httptools

MAX_HEAD_BYTES = 64 * 1024


class NotSent(Exception):
    """The pod never saw the request: no connection could be made."""


class Failed(Exception):
    """The request reached the pod, but its answer did not come whole."""


@dataclass
class Answer:
    status: int
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""


class _Malformed(Exception):
    pass


class _Extra(Exception):
    """Bytes after the whole answer: a second answer to one request."""


class _Connection(asyncio.Protocol):
    """One connection to a pod, carrying one request at a time; llhttp (httptools) frames
    each answer."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser: httptools.HttpResponseParser | None = None
        self.waiter: asyncio.Future[Answer] | None = None
        self.idle_since = 0.0
        self.keep_alive = True
        self._answer: Answer | None = None  # the answer being read (None between answers)
        self._done: Answer | None = None  # the whole answer
        self._in_head = False
        self._head_seen = 0
        self._until_close = False
        self._chunks: list[bytes] = []
        self._error: _Malformed | None = None

    # -- asyncio.Protocol -----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        waiter = self.waiter
        if waiter is None or waiter.done() or self.parser is None:
            # Bytes nobody asked for: the connection's framing is lost, never reuse it.
            self.close()
            return
        try:
            in_head = self._in_head
            self.parser.feed_data(data)
            if self._in_head:
                # llhttp keeps a header line until its end: bound what a head may hold.
                if in_head:
                    self._head_seen += len(data)
                if self._head_seen > MAX_HEAD_BYTES:
                    raise _Malformed(f"a head longer than {MAX_HEAD_BYTES} bytes")
        except _Malformed as error:
            self._malformed(str(error))
            return
        except httptools.HttpParserCallbackError:
            if self._error is not None:
                self._malformed(str(self._error))
                return
            self.keep_alive = False  # _Extra: more than one answer to one request
        except httptools.HttpParserUpgrade:
            self.keep_alive = False  # a 101 or the like: nothing after it is HTTP
        except httptools.HttpParserError as error:
            self._malformed(str(error))
            return
        if self._done is not None:
            answer, self._done = self._done, None
            waiter.set_result(answer)

    def eof_received(self) -> bool:
        if (
            self._until_close
            and self._answer is not None
            and self.waiter is not None
            and not self.waiter.done()
        ):
            self._answer.body = b"".join(self._chunks)
            self._chunks = []
            self.keep_alive = False
            self.waiter.set_result(self._answer)
        else:
            self._fail(Failed("the pod closed the connection before its answer was complete"))
        return False  # the transport closes: is_closing() from now on

    def connection_lost(self, exc: Exception | None) -> None:
        reason = f": {exc}" if exc else ""
        self._fail(Failed(f"the connection to the pod was lost before its answer{reason}"))

    # -- llhttp's callbacks ---------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self._done is not None:
            raise _Extra
        self._answer = Answer(0)
        self._in_head = True
        self._head_seen = 0
        self._chunks = []

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self._answer is not None
        self._answer.headers.append((name.decode("latin-1"), value.decode("latin-1").strip(" \t")))

    def on_headers_complete(self) -> None:
        assert self._answer is not None and self.parser is not None
        self._in_head = False
        answer = self._answer
        answer.status = self.parser.get_status_code()
        if answer.status < 200:
            return  # informational (100 Continue, 103 Early Hints): the answer follows
        length = coding = None
        connection = ""
        for name, value in answer.headers:
            lower = name.lower()
            if lower == "content-length":
                length = value
            elif lower == "transfer-encoding":
                coding = value
            elif lower == "connection":
                connection = value.lower()
        if coding is not None and coding.lower().rsplit(",", 1)[-1].strip() != "chunked":
            self._error = _Malformed(f"Transfer-Encoding {coding[:40]!r}")
            raise self._error
        version = self.parser.get_http_version()
        self.keep_alive = (
            "close" not in connection if version == "1.1" else "keep-alive" in connection
        )
        if coding is None and length is None and answer.status not in (204, 304):
            self._until_close = True  # framed by the end of the connection
            self.keep_alive = False

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)

    def on_message_complete(self) -> None:
        answer = self._answer
        assert answer is not None
        self._answer = None
        if answer.status < 200:
            return
        answer.body = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks = []
        self._done = answer

    # -- requests -------------------------------------------------------------------------
    def send(self, head: bytes, body: bytes | None) -> asyncio.Future[Answer]:
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.parser = httptools.HttpResponseParser(self)
        self._answer = self._done = self._error = None
        self._in_head = self._until_close = False
        self._head_seen = 0
        self._chunks = []
        self.transport.write(head + body if body else head)
        return self.waiter

    def reusable(self) -> bool:
        return (
            self.keep_alive
            and self._answer is None
            and self.transport is not None
            and not self.transport.is_closing()
        )

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _malformed(self, reason: str) -> None:
        self.keep_alive = False
        self._fail(Failed(f"the pod's answer is not valid HTTP/1.1: {reason}"))
        self.close()

    def _fail(self, error: Exception) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(error)


class Upstream:
    """Pooled HTTP/1.1 connections to the pods, one pool per address and port."""

    def __init__(self, keepalive_seconds: float = 30.0) -> None:
        self.keepalive_seconds = keepalive_seconds
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._swept = time.monotonic()

    async def request(
        self,
        method: str,
        host: str,
        port: int,
        path: str,
        body: bytes | None,
        headers: dict[str, str],
        connect_timeout: float,
        answer_timeout: float,
    ) -> Answer:
        """Send one request (GET or POST: never HEAD, whose answer has no body), return the
        whole answer; NotSent or Failed (see the module)."""
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        connection = self._take(host, port, started)
        if connection is None:
            connection = await self._connect(loop, host, port, connect_timeout)
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        lines = [f"{method} {path} HTTP/1.1", f"Host: {authority}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        if body is not None or method in ("POST", "PUT", "PATCH"):
            lines.append(f"Content-Length: {len(body or b'')}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        waiter = connection.send(head, body)
        remaining = answer_timeout - (time.monotonic() - started)
        timer = loop.call_later(max(remaining, 0.0), _expire, waiter, answer_timeout)
        done = False
        try:
            answer = await waiter
            done = True
        finally:
            timer.cancel()
            if done and connection.reusable():
                connection.idle_since = time.monotonic()
                self._idle.setdefault((host, port), []).append(connection)
            else:
                # Failed, timed out, cancelled (the client left) or closing: the connection's
                # state is unknown, so it is never reused.
                connection.close()
        return answer

    def _take(self, host: str, port: int, now: float) -> _Connection | None:
        if now - self._swept > self.keepalive_seconds:
            self._sweep(now)
        idle = self._idle.get((host, port))
        while idle:
            connection = idle.pop()
            if self._fresh(connection, now):
                return connection
            connection.close()
        return None

    def _fresh(self, connection: _Connection, now: float) -> bool:
        return connection.reusable() and now - connection.idle_since < self.keepalive_seconds

    def _sweep(self, now: float) -> None:
        """Close connections idle too long, and forget pods with none left."""
        self._swept = now
        for key, idle in list(self._idle.items()):
            keep = [c for c in idle if self._fresh(c, now)]
            for connection in idle:
                if connection not in keep:
                    connection.close()
            if keep:
                self._idle[key] = keep
            else:
                del self._idle[key]

    async def _connect(
        self, loop: asyncio.AbstractEventLoop, host: str, port: int, connect_timeout: float
    ) -> _Connection:
        try:
            async with asyncio.timeout(connect_timeout):
                _, connection = await loop.create_connection(_Connection, host, port)
        except TimeoutError:
            raise NotSent(f"no connection to {host}:{port} within {connect_timeout:g} s") from None
        except OSError as error:
            raise NotSent(f"cannot connect to {host}:{port}: {error}") from None
        return connection

    def idle_connections(self) -> int:
        """Pooled connections the next request could still take."""
        now = time.monotonic()
        return sum(self._fresh(c, now) for idle in self._idle.values() for c in idle)

    def close(self) -> None:
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
        self._idle.clear()


def _expire(waiter: asyncio.Future[Answer], timeout: float) -> None:
    if not waiter.done():
        waiter.set_exception(Failed(f"the pod did not answer within {timeout:g} s"))
