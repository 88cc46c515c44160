"""The router's HTTP/1.1 server (warmgate_router/httpd.py) on loopback: what clients send at
their defaults (requests, httpx, curl: keep-alive, chunked uploads, `Expect: 100-continue`),
what they may send by mistake (each malformed request gets a 4xx JSON error and a closed
connection), and what a server owes them (pipelined answers in order, HEAD, HTTP/1.0, idle
connections closed, a handler's failure answered 500, a graceful shutdown). The router's own
routes through this server are tests/router/test_proxy.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess

import httpx
import orjson
import pytest
import requests

from warmgate_router.httpd import Request, Response, Routes, Server, json_response


async def echo(request: Request) -> Response:
    return json_response(
        200,
        {
            "method": request.method,
            "path": request.path,
            "query": request.query,
            "length": len(request.body),
            "body": request.body.decode("utf-8", "replace")[:100],
            "type": request.headers.get("content-type"),
            "model": request.match_info.get("model"),
        },
    )


async def boom(request: Request) -> Response:
    raise RuntimeError("a handler bug")


@pytest.fixture
async def serve():
    servers: list[Server] = []

    async def start(**options) -> tuple[Server, int]:
        routes = Routes()
        routes.add("POST", "/echo", echo)
        routes.add("GET", "/echo", echo)
        routes.add("POST", "/boom", boom)
        routes.add("POST", "/slow", slow)
        routes.add_pattern("POST", "/models/(?P<model>.+)/echo", echo)
        options.setdefault("max_body", 1024 * 1024)
        server = Server(routes, **options)
        servers.append(server)
        return server, await server.start("127.0.0.1", 0)

    yield start
    for server in servers:
        await server.shutdown(seconds=2)


released = asyncio.Event()
seen_gone: list[bool] = []


async def slow(request: Request) -> Response:
    for _ in range(100):
        if released.is_set() or request.gone():
            break
        await asyncio.sleep(0.05)
    seen_gone.append(request.gone())
    return json_response(200, {"slow": True})


async def raw(port: int, data: bytes, read_until_close: bool = True) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    try:
        if read_until_close:
            return await asyncio.wait_for(reader.read(), 5)
        return await asyncio.wait_for(reader.read(65536), 5)
    finally:
        writer.close()


def answers(data: bytes, heads: tuple[int, ...] = ()) -> list[tuple[int, dict[str, str], bytes]]:
    """Split raw bytes into (status, headers, body) answers by Content-Length; the answers
    numbered in `heads` answer HEAD (a Content-Length, no body)."""
    found: list[tuple[int, dict[str, str], bytes]] = []
    while data:
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = 0 if len(found) in heads else int(headers.get("content-length", 0))
        found.append((int(lines[0].split(" ")[1]), headers, rest[:length]))
        data = rest[length:]
    return found


async def test_the_clients_users_run_at_their_defaults(serve):
    _, port = await serve()
    url = f"http://127.0.0.1:{port}"

    def clients() -> list[dict]:
        seen = []
        with requests.Session() as session:  # pooled keep-alive
            for _ in range(3):
                seen.append(
                    session.post(url + "/echo?x=1", json={"input": "샘플 문장입니다"}).json()
                )

            def chunks():  # a generator body: requests sends it chunked
                yield b'{"input": '
                yield b'"streamed"}'

            seen.append(session.post(url + "/echo", data=chunks()).json())
        with httpx.Client() as client:
            seen.append(client.post(url + "/models/team/docs/echo", json={"a": 1}).json())
            seen.append(client.get(url + "/echo").json())
        return seen

    seen = await asyncio.to_thread(clients)
    assert seen[0] == {
        "method": "POST",
        "path": "/echo",
        "query": "x=1",
        "length": len(json.dumps({"input": "샘플 문장입니다"}).encode()),
        "body": json.dumps({"input": "샘플 문장입니다"}),
        "type": "application/json",
        "model": None,
    }
    assert seen[3]["body"] == '{"input": "streamed"}'  # chunked, reassembled
    assert seen[4]["model"] == "team/docs" and seen[4]["path"] == "/models/team/docs/echo"
    assert seen[5]["method"] == "GET" and seen[5]["length"] == 0

    # `Expect: 100-continue` (curl sends it for large bodies, 1 KiB before curl 8.5 and 1 MiB
    # since; set here so the test does not depend on curl's version): the body waits for 100.
    big = "x" * 300_000
    done = await asyncio.to_thread(
        subprocess.run,
        [
            "curl",
            "-sS",
            "-v",
            "--max-time",
            "10",
            "-H",
            "Content-Type: application/json",
            "-H",
            "Expect: 100-continue",
            "--data-binary",
            "@-",
            url + "/echo",
        ],
        input=json.dumps({"input": big}).encode(),
        capture_output=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()
    assert b"Expect: 100-continue" in done.stderr and b"100 Continue" in done.stderr
    assert json.loads(done.stdout)["length"] == len(json.dumps({"input": big}))


async def test_pipelined_requests_are_answered_in_order_on_one_connection(serve):
    _, port = await serve()
    one = b'{"n": 1}'
    two = b'{"n": 22}'
    data = (
        b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(one), one)
        + b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"%x\r\n%s\r\n0\r\n\r\n" % (len(two), two)
        + b"GET /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    got = answers(await raw(port, data))
    assert [status for status, _, _ in got] == [200, 200, 200]
    assert [orjson.loads(body)["body"] for _, _, body in got] == ['{"n": 1}', '{"n": 22}', ""]
    assert got[2][1]["connection"] == "close"
    assert "connection" not in got[0][1] and got[0][1]["date"].endswith("GMT")


@pytest.mark.parametrize(
    ("request_bytes", "status", "says"),
    [
        (b"POST /echo\r\nHost: x\r\n\r\n", 400, "bad request line"),
        (b"POST /echo HTTP/2.0\r\nHost: x\r\n\r\n", 505, "bad version"),
        (b"POST /echo HTTP/1.1\r\nHost x\r\n\r\n", 400, "bad header line"),
        (b"POST /echo HTTP/1.1\r\nContent-Length: ten\r\n\r\n", 400, "is not a number"),
        (
            b"POST /echo HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nab",
            400,
            "two different Content-Length",
        ),
        (
            b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n",
            400,
            "both Transfer-Encoding and Content-Length",
        ),
        (b"POST /echo HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", 501, "only chunked"),
        (b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400, "chunk size"),
        (b"POST /echo HTTP/1.1\r\nContent-Length: 2000000\r\n\r\n", 413, "over 1048576 bytes"),
        (b"GET /echo HTTP/1.1\r\nX-Long: " + b"a" * 70000 + b"\r\n\r\n", 431, "head is longer"),
    ],
)
async def test_a_malformed_request_gets_a_json_error_and_a_closed_connection(
    serve, request_bytes, status, says
):
    _, port = await serve()
    got = answers(await raw(port, request_bytes))  # read until the server closes
    assert len(got) == 1
    assert got[0][0] == status
    assert got[0][1]["connection"] == "close"
    assert says in orjson.loads(got[0][2])["error"]


async def test_a_chunked_body_over_the_limit_is_refused(serve):
    _, port = await serve(max_body=1000)
    chunk = b"a" * 600
    data = (
        b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
        + (b"%x\r\n%s\r\n" % (len(chunk), chunk)) * 2
    )
    got = answers(await raw(port, data))
    assert got[0][0] == 413 and "over 1000 bytes" in orjson.loads(got[0][2])["error"]


async def test_unknown_routes_methods_head_http10_and_a_failing_handler(serve):
    _, port = await serve()
    data = (
        b"GET /nowhere HTTP/1.1\r\n\r\n"
        b"DELETE /echo HTTP/1.1\r\n\r\n"
        b"HEAD /echo HTTP/1.1\r\n\r\n"
        b"POST /boom HTTP/1.1\r\nContent-Length: 0\r\n\r\n"
        b"GET /echo HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"
        b"GET /echo HTTP/1.0\r\n\r\n"
    )
    got = answers(await raw(port, data), heads=(2,))
    statuses = [status for status, _, _ in got]
    assert statuses == [404, 405, 200, 500, 200, 200]
    assert "no route /nowhere" in orjson.loads(got[0][2])["error"]
    assert got[1][1]["allow"] == "GET, POST"
    assert got[2][2] == b"" and int(got[2][1]["content-length"]) > 0  # HEAD: no body
    assert "the router failed on POST /boom" in orjson.loads(got[3][2])["error"]
    assert got[4][1]["connection"] == "keep-alive"  # HTTP/1.0 asked to keep it
    assert got[5][1]["connection"] == "close"  # HTTP/1.0's default


async def test_idle_connections_are_closed_and_a_hang_up_is_seen_by_the_handler(serve):
    _, port = await serve(keepalive_seconds=0.4)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /echo HTTP/1.1\r\n\r\n")
    first = await asyncio.wait_for(reader.read(65536), 5)
    assert first.startswith(b"HTTP/1.1 200")
    # Idle past the keep-alive time: the server closes it (EOF on our side).
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()

    released.clear()
    seen_gone.clear()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /slow HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
    await writer.drain()
    await asyncio.sleep(0.2)
    writer.close()  # the client hangs up while its request is handled
    for _ in range(60):
        if seen_gone:
            break
        await asyncio.sleep(0.05)
    assert seen_gone == [True]


async def test_shutdown_answers_what_is_in_flight_with_connection_close(serve):
    server, port = await serve()
    released.clear()
    seen_gone.clear()
    idle = socket.create_connection(("127.0.0.1", port))
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /slow HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
    await writer.drain()
    await asyncio.sleep(0.2)
    stopping = asyncio.create_task(server.shutdown(seconds=5))
    await asyncio.sleep(0.2)
    with pytest.raises(OSError):  # no longer accepting
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    idle.settimeout(2)
    assert idle.recv(10) == b""  # the idle connection was closed
    idle.close()
    released.set()
    got = answers(await asyncio.wait_for(reader.read(), 5))
    await stopping
    assert got[0][0] == 200 and got[0][1]["connection"] == "close"
    assert seen_gone == [False]
    writer.close()


async def test_a_refused_body_still_being_sent_does_not_cost_the_client_its_answer(serve):
    """A body over the limit is refused after its head, while the client is still sending
    it: the server reads and drops the rest before closing, so the client gets the 413
    instead of a reset connection."""
    _, port = await serve(max_body=1000)
    body = b"x" * 4_000_000
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /echo HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body))
    sending = asyncio.create_task(_send_slowly(writer, body))
    got = answers(await asyncio.wait_for(reader.read(), 10))
    with contextlib.suppress(ConnectionError):
        await sending
    writer.close()
    assert got[0][0] == 413 and "over 1000 bytes" in orjson.loads(got[0][2])["error"]


async def _send_slowly(writer: asyncio.StreamWriter, body: bytes) -> None:
    for start in range(0, len(body), 256 * 1024):
        writer.write(body[start : start + 256 * 1024])
        await writer.drain()
        await asyncio.sleep(0.01)
