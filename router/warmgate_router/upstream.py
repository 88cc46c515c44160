"""The router's connections to pods: HTTP/1.1 on asyncio's transports, pooled per pod.

The router sends one kind of request (a small POST or GET with a known body) and reads whole
answers, so this is all of HTTP/1.1's client side it needs: the request written in one call,
the answer's head parsed once, its body framed by Content-Length, chunked encoding or the end of
the connection. aiohttp's ClientSession did the same with about twice the CPU per request
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

MAX_HEAD_BYTES = 64 * 1024
CRLF = b"\r\n"


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


# Body framings
_LENGTH, _CHUNKED, _UNTIL_CLOSE = 1, 2, 3


class _Connection(asyncio.Protocol):
    """One connection to a pod, carrying one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.waiter: asyncio.Future[Answer] | None = None
        self.idle_since = 0.0
        self.keep_alive = True
        self._answer: Answer | None = None
        self._framing = 0
        self._length = 0
        self._chunks: list[bytes] = []

    # -- asyncio.Protocol -----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.waiter is None or self.waiter.done():
            # Bytes nobody asked for: the connection's framing is lost, never reuse it.
            self.close()
            return
        self.buffer += data
        try:
            answer = self._parse()
        except _Malformed as error:
            self._fail(Failed(f"the pod's answer is not valid HTTP/1.1: {error}"))
            self.close()
            return
        if answer is not None:
            if self.buffer:  # more than one answer to one request
                self.keep_alive = False
            self.waiter.set_result(answer)

    def eof_received(self) -> bool:
        if self._framing == _UNTIL_CLOSE and self.waiter is not None and not self.waiter.done():
            assert self._answer is not None
            self._answer.body = bytes(self.buffer)
            self.buffer.clear()
            self.keep_alive = False
            self.waiter.set_result(self._answer)
        else:
            self._fail(Failed("the pod closed the connection before its answer was complete"))
        return False  # the transport closes: is_closing() from now on

    def connection_lost(self, exc: Exception | None) -> None:
        reason = f": {exc}" if exc else ""
        self._fail(Failed(f"the connection to the pod was lost before its answer{reason}"))

    # -- requests -------------------------------------------------------------------------
    def send(self, head: bytes, body: bytes | None) -> asyncio.Future[Answer]:
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self._answer = None
        self._framing = 0
        self._chunks = []
        self.transport.write(head + body if body else head)
        return self.waiter

    def reusable(self) -> bool:
        return (
            self.keep_alive
            and self.transport is not None
            and not self.transport.is_closing()
            and not self.buffer
        )

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _fail(self, error: Exception) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(error)

    # -- parsing --------------------------------------------------------------------------
    def _parse(self) -> Answer | None:
        while self._answer is None:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buffer) > MAX_HEAD_BYTES:
                    raise _Malformed(f"a head longer than {MAX_HEAD_BYTES} bytes")
                return None
            answer = self._head(bytes(self.buffer[:end]))
            del self.buffer[: end + 4]
            if 100 <= answer.status < 200:
                continue  # informational (100 Continue, 103 Early Hints): the answer follows
            self._answer = answer
        buffer = self.buffer
        if self._framing == _LENGTH:
            if len(buffer) < self._length:
                return None
            self._answer.body = bytes(buffer[: self._length])
            del buffer[: self._length]
        elif self._framing == _CHUNKED:
            if not self._dechunk():
                return None
        elif self._framing == _UNTIL_CLOSE:
            return None  # eof_received ends it
        answer, self._answer = self._answer, None
        return answer

    def _head(self, raw: bytes) -> Answer:
        lines = raw.decode("latin-1").split("\r\n")
        version, _, rest = lines[0].partition(" ")
        code = rest[:3]
        if not version.startswith("HTTP/1.") or not code.isdigit():
            raise _Malformed(f"status line {lines[0][:80]!r}")
        answer = Answer(int(code))
        length: str | None = None
        chunked = False
        connection = ""
        for line in lines[1:]:
            name, colon, value = line.partition(":")
            if not colon or not name or name != name.strip():
                raise _Malformed(f"header line {line[:80]!r}")
            value = value.strip()
            lower = name.lower()
            if lower == "content-length":
                if length is not None and length != value:
                    raise _Malformed("two different Content-Length headers")
                length = value
            elif lower == "transfer-encoding":
                chunked = value.lower().rsplit(",", 1)[-1].strip() == "chunked"
                if not chunked:
                    raise _Malformed(f"Transfer-Encoding {value!r}")
            elif lower == "connection":
                connection = value.lower()
            answer.headers.append((name, value))
        self.keep_alive = (
            "close" not in connection if version == "HTTP/1.1" else "keep-alive" in connection
        )
        if answer.status < 200:
            return answer
        if answer.status in (204, 304):
            self._framing, self._length = _LENGTH, 0
        elif chunked:
            self._framing = _CHUNKED
        elif length is not None:
            if not length.isdigit():
                raise _Malformed(f"Content-Length {length!r}")
            self._framing, self._length = _LENGTH, int(length)
        else:
            self._framing = _UNTIL_CLOSE
            self.keep_alive = False
        return answer

    def _dechunk(self) -> bool:
        """Move whole chunks from the buffer to the body; True at the last chunk's end."""
        try:
            done = dechunk(self.buffer, self._chunks)
        except ValueError as error:
            raise _Malformed(str(error)) from None
        if done:
            assert self._answer is not None
            self._answer.body = b"".join(self._chunks)
            self._chunks = []
        return done


def dechunk(buffer: bytearray, chunks: list[bytes]) -> bool:
    """Chunked transfer coding: move whole chunks from the front of `buffer` to `chunks`; True
    once the last chunk and its trailers are consumed; ValueError when it is not that coding."""
    while True:
        end = buffer.find(CRLF)
        if end < 0:
            if len(buffer) > MAX_HEAD_BYTES:
                raise ValueError("a chunk size line too long")
            return False
        size_text = bytes(buffer[:end]).split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise ValueError(f"chunk size {size_text[:20]!r}") from None
        if size < 0:
            raise ValueError(f"chunk size {size_text[:20]!r}")
        if size == 0:
            # Trailers, then an empty line.
            trailer_end = buffer.find(b"\r\n\r\n", end)
            if buffer[end : end + 4] == b"\r\n\r\n":
                trailer_end = end
            elif trailer_end < 0:
                return False
            del buffer[: trailer_end + 4]
            return True
        start = end + 2
        if len(buffer) < start + size + 2:
            return False
        if buffer[start + size : start + size + 2] != CRLF:
            raise ValueError("a chunk not followed by CRLF")
        chunks.append(bytes(buffer[start : start + size]))
        del buffer[: start + size + 2]


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
