"""The router's HTTP/1.1 client (warmgate_router.upstream) against real sockets on loopback:
servers written byte by byte, so each framing and each way a pod can fail is made for real.
The router's behaviour through it against real warmgate servers is tests/router/test_proxy.py."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

import orjson
import pytest

from warmgate_contract.names import API_VERSION
from warmgate_router.config import RouterConfig
from warmgate_router.metrics import Metrics
from warmgate_router.proxy import Router, build_server
from warmgate_router.upstream import Failed, NotSent, Upstream
from warmgate_router.view import ALIASES, SERVICES, SLICES, View

Reply = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Pod:
    """A loopback server answering each request with `reply`; counts connections."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.connections = 0
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                await self.reply(reader, writer)
                if writer.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


def fixed(*parts: bytes, close: bool = False) -> Reply:
    async def reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for part in parts:
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(0.01)  # separate reads on the client's side
        if close:
            writer.close()

    return reply


def held(release: asyncio.Event, answer: bytes) -> Reply:
    """Answers only once the test sets `release` (already set: at once): a pod that is slow for
    exactly as long as the test needs, whatever the machine's load."""

    async def reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await release.wait()
        writer.write(answer)
        await writer.drain()

    return reply


async def until(condition: Callable[[], bool], seconds: float = 5.0) -> None:
    """Wait for a state that has no event to await (a FIN the client's loop has read), bounded."""
    async with asyncio.timeout(seconds):
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.01)


@pytest.fixture
async def pods():
    started: list[Pod] = []

    async def start(reply: Reply) -> tuple[Pod, int]:
        pod = Pod(reply)
        port = await pod.start()
        started.append(pod)
        return pod, port

    yield start
    for pod in started:
        await pod.stop()


async def call(upstream: Upstream, port: int, body: bytes = b'{"input": "x"}', seconds=5.0):
    return await upstream.request(
        "POST",
        "127.0.0.1",
        port,
        "/v1/embeddings",
        body,
        {"Content-Type": "application/json"},
        connect_timeout=1.0,
        answer_timeout=seconds,
    )


async def test_answers_by_length_reuse_one_connection_and_send_a_proper_request(pods):
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
    rest = b'Content-Length: 10\r\nX-Warmgate-Cold: 0\r\n\r\n{"a"'
    pod, port = await pods(fixed(head, rest, b": [1]}"))
    upstream = Upstream()
    for _ in range(5):
        answer = await call(upstream, port)
        assert answer.status == 200
        assert answer.body == b'{"a": [1]}'
        assert ("X-Warmgate-Cold", "0") in answer.headers
    assert pod.connections == 1
    first = pod.requests[0]
    assert first.startswith(b"POST /v1/embeddings HTTP/1.1\r\n")
    assert f"Host: 127.0.0.1:{port}\r\n".encode() in first
    assert b"Content-Length: 14\r\n" in first
    assert first.endswith(b'\r\n\r\n{"input": "x"}')
    upstream.close()


async def test_chunked_and_informational_answers_are_read_whole(pods):
    informational = b"HTTP/1.1 100 Continue\r\n\r\n"
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4;ext=1\r\nabcd\r\n"
    _, port = await pods(fixed(informational, head, b"3\r\nefg\r\n0\r\nX-Trailer: t\r\n\r\n"))
    upstream = Upstream()
    for _ in range(3):
        answer = await call(upstream, port)
        assert (answer.status, answer.body) == (200, b"abcdefg")
    assert upstream.idle_connections() == 1
    upstream.close()


async def test_an_answer_framed_by_the_end_of_the_connection_is_read_and_not_reused(pods):
    pod, port = await pods(fixed(b"HTTP/1.0 200 OK\r\n\r\nall ", b"of it", close=True))
    upstream = Upstream()
    for _ in range(3):
        answer = await call(upstream, port)
        assert (answer.status, answer.body) == (200, b"all of it")
    assert pod.connections == 3
    assert upstream.idle_connections() == 0


async def test_connection_close_from_a_draining_pod_opens_a_new_connection_and_fails_nothing(pods):
    pod, port = await pods(
        fixed(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok", close=True)
    )
    upstream = Upstream()
    for _ in range(4):
        assert (await call(upstream, port)).body == b"ok"
    assert pod.connections == 4


async def test_an_idle_connection_the_pod_closed_is_not_reused(pods):
    # The pod answers, then ends the idle keep-alive connection (as a server's keep-alive
    # timeout or a draining server does).
    pod, port = await pods(fixed(b"HTTP/1.1 204 No Content\r\n\r\n", close=True))
    upstream = Upstream()
    for _ in range(3):
        assert (await call(upstream, port)).status == 204
        await until(lambda: upstream.idle_connections() == 0)  # the pod's FIN was read
    assert pod.connections == 3


async def test_a_refused_or_unopened_connection_is_not_sent(pods):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    upstream = Upstream()
    with pytest.raises(NotSent, match="cannot connect"):
        await call(upstream, free)
    # A listener that never accepts, its accept queue full: the kernel drops the SYN.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(0)
    filler = socket.create_connection(silent.getsockname())
    try:
        with pytest.raises(NotSent, match="within 1 s"):
            await call(upstream, silent.getsockname()[1])
    finally:
        filler.close()
        silent.close()


async def test_a_pod_that_fails_mid_answer_or_answers_garbage_is_failed_not_retried(pods):
    upstream = Upstream()
    _, cut = await pods(fixed(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial", close=True))
    with pytest.raises(Failed, match="before its answer was complete"):
        await call(upstream, cut)
    _, garbage = await pods(fixed(b"SSH-2.0-OpenSSH\r\n\r\n"))
    with pytest.raises(Failed, match=r"not valid HTTP/1\.1"):
        await call(upstream, garbage)
    # The pod reads the request and closes without a byte of answer.
    _, closing = await pods(fixed(close=True))
    with pytest.raises(Failed, match="before its answer was complete"):
        await call(upstream, closing)
    assert upstream.idle_connections() == 0


async def test_a_slow_answer_times_out_and_its_connection_is_dropped(pods):
    release = asyncio.Event()
    pod, port = await pods(held(release, b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nlate"))
    upstream = Upstream()
    with pytest.raises(Failed, match=r"did not answer within 0\.2 s"):
        await call(upstream, port, seconds=0.2)
    assert upstream.idle_connections() == 0
    release.set()  # the late answer goes to a connection the router closed
    # ... and never lands on the next request, which gets a connection of its own.
    assert (await call(upstream, port)).body == b"late"
    assert pod.connections == 2


async def test_a_cancelled_request_drops_its_connection(pods):
    """The client that sent the request to the router left: its pod connection still has an
    answer coming, so it is closed, never pooled."""
    release = asyncio.Event()
    pod, port = await pods(held(release, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"))
    upstream = Upstream()
    task = asyncio.create_task(call(upstream, port))
    await until(lambda: len(pod.requests) == 1)  # the pod has the request
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert upstream.idle_connections() == 0
    release.set()
    assert (await call(upstream, port)).body == b"ok"
    assert pod.connections == 2


async def test_idle_connections_past_keepalive_are_closed(pods):
    pod, port = await pods(fixed(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"))
    upstream = Upstream(keepalive_seconds=0.2)
    await call(upstream, port)
    assert upstream.idle_connections() == 1
    await asyncio.sleep(0.3)
    await call(upstream, port)
    assert pod.connections == 2
    assert upstream.idle_connections() == 1
    upstream.close()


# -- a pod's malformed framing, through the real router: 502, the connection dropped --------


async def start_router(pod_port: int):
    """The router's own server (build_server) with one service, `docs`, whose one pod is on
    `pod_port`."""
    view = View()
    router = Router(RouterConfig(), view, None, Metrics())
    router.synced.set()
    created = "2026-01-01T00:00:00Z"
    view.on_listing(
        SERVICES,
        "team",
        [
            {
                "apiVersion": API_VERSION,
                "kind": "EmbeddingService",
                "metadata": {"namespace": "team", "name": "docs", "creationTimestamp": created},
                "spec": {"model": {"id": "m"}, "replicas": 1},
            }
        ],
    )
    view.on_listing(ALIASES, "team", [])
    view.on_listing(
        SLICES,
        "team",
        [
            {
                "metadata": {
                    "namespace": "team",
                    "name": "docs-a",
                    "labels": {"kubernetes.io/service-name": "docs"},
                },
                "ports": [{"name": "http", "port": pod_port}],
                "endpoints": [
                    {
                        "addresses": ["127.0.0.1"],
                        "conditions": {"ready": True, "serving": True, "terminating": False},
                        "targetRef": {"kind": "Pod", "name": "docs-pod"},
                    }
                ],
            }
        ],
    )
    server = build_server(router)
    return router, server, await server.start("127.0.0.1", 0)


CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
MALFORMED_ANSWERS = {
    "chunk size 0x2": CHUNKED + b"0x2\r\n[]\r\n0\r\n\r\n",
    "chunk size +2": CHUNKED + b"+2\r\n[]\r\n0\r\n\r\n",
    "two Content-Lengths": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n[]",
    "a bare LF in a header": b"HTTP/1.1 200 OK\r\nX-A: a\nX-B: b\r\nContent-Length: 2\r\n\r\n[]",
    "a NUL in a header": b"HTTP/1.1 200 OK\r\nX-A: a\x00b\r\nContent-Length: 2\r\n\r\n[]",
    "Content-Length: 0x2": b"HTTP/1.1 200 OK\r\nContent-Length: 0x2\r\n\r\n[]",
    "Transfer-Encoding: gzip": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n[]",
    "no status line": b"SSH-2.0-OpenSSH\r\n\r\n",
}


@pytest.mark.parametrize("answer", list(MALFORMED_ANSWERS.values()), ids=list(MALFORMED_ANSWERS))
async def test_a_pod_answering_with_malformed_framing_gets_the_client_a_502(pods, answer):
    pod, pod_port = await pods(fixed(answer))
    router, server, port = await start_router(pod_port)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = b'{"inputs": "a"}'
        writer.write(
            b"POST /embed HTTP/1.1\r\nHost: r\r\nX-Warmgate-Model: docs\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        error = orjson.loads(await asyncio.wait_for(reader.readexactly(length), 5))
        writer.close()
        assert head.startswith(b"HTTP/1.1 502 ")
        assert "not valid HTTP/1.1" in error["error"], error
        assert len(pod.requests) == 1  # sent once, never again
        assert router.upstream.idle_connections() == 0  # the pod's connection was dropped
    finally:
        await server.shutdown(seconds=2)
        await router.close()
