"""Whatever reaches the server over the wire, as real HTTP on loopback: TCP sockets to one warmed
app that the whole module shares (the real all-MiniLM-L6-v2), with bytes that no client library
framed. A corpus of malformed and odd framing (request smuggling's Content-Length and
Transfer-Encoding combinations, bad chunk sizes, bare CR and LF, NUL, obs-fold, non-ASCII digits,
bodies in a Content-Encoding they are not in), arbitrary bytes and mutated valid requests, and
arbitrary JSON bodies for every POST route (hypothesis): every answer is HTTP with a status below
500 (a route's own 4xx is JSON in its API's error shape), a stream that starts with a whole
request is answered, and no stream holds the server: it closes each connection within seconds of
the client's end of stream. Afterwards the server serves sentence-transformers' vector, has
nothing in flight, logged no error of its own, and its memory did not grow with what it was sent.
What any client library sends is tests/clients/test_bad_input.py's, on a server process."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import gzip
import http.client
import json
import logging
import os
import random
import re
import socket
import time
import zlib
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import h11
import numpy as np
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.server import make_config, serving

from warmgate_server.context import RUNTIME

pytestmark = pytest.mark.asyncio(loop_scope="module")

PAYLOAD_LIMIT = 512 * 1024
ARGS = [
    "--max-batch-size", "4", "--max-client-batch-size", "4",
    "--payload-limit", str(PAYLOAD_LIMIT), "--body-timeout", "2",
]  # fmt: skip
ANSWER_S = 10.0
"""How long a whole request's answer may take: milliseconds of model time, on a loaded CI box."""
CLOSE_S = 3.0
"""How long the server may keep a connection open after the client's end of stream (aiohttp
closes it at once; --body-timeout, 2 s here, bounds a body that stopped coming)."""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(minilm_dir, loaded_minilm) -> AsyncIterator[TestClient]:
    async with serving(make_config(minilm_dir, *ARGS), loaded_minilm) as ready:
        yield ready


# -- reading what the server writes ------------------------------------------------------------

STATUS_LINE = re.compile(rb"HTTP/[0-9]\.[0-9] ([1-5][0-9][0-9]) [^\r\n]*")
HEADER_LINE = re.compile(rb"([!#$%&'*+.^_`|~0-9A-Za-z-]+):[ \t]*([^\r\n]*)")


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes


def read_answers(data: bytes, head: bool = False) -> tuple[list[Answer], bytes]:
    """The whole answers `data` starts with, and what follows them (an unfinished answer, or
    bytes that are not HTTP). An answer is a status line, header lines and Content-Length bytes
    of body (how aiohttp frames every answer); 1xx answers, and answers to HEAD, have none."""
    answers: list[Answer] = []
    while (end := data.find(b"\r\n\r\n")) >= 0:
        status_line, *lines = data[:end].split(b"\r\n")
        matched = STATUS_LINE.fullmatch(status_line)
        assert matched, f"not an HTTP status line: {status_line!r}"
        headers = {}
        for line in lines:
            header = HEADER_LINE.fullmatch(line)
            assert header, f"not an HTTP header line: {line!r}"
            headers[header[1].decode().lower()] = header[2].decode("latin-1").strip()
        status = int(matched[1])
        length = 0
        if status >= 200 and not head:
            assert headers.get("content-length", "").isdigit(), (status_line, headers)
            length = int(headers["content-length"])
        if len(data) < end + 4 + length:
            break
        answers.append(Answer(status, headers, data[end + 4 : end + 4 + length]))
        data = data[end + 4 + length :]
    return answers, data


def finals(answers: list[Answer]) -> list[Answer]:
    return [answer for answer in answers if answer.status >= 200]


def receive(sock: socket.socket, into: bytearray) -> bool:
    """One read into `into`; False once the server has closed the connection."""
    try:
        chunk = sock.recv(65536)
    except ConnectionResetError:
        return False
    into += chunk
    return bool(chunk)


def exchange(
    port: int, data: bytes | Sequence[bytes], awaited: int, head: bool = False
) -> list[Answer]:
    """Send `data` (a sequence: its parts 0.3 s apart) on a new connection; return the server's
    answers. The first `awaited` final answers (to the whole requests the stream starts with)
    are waited for, ANSWER_S at most, before our end of stream, since aiohttp takes a
    half-closed connection for a client that has gone; then our EOF (shutdown of our writing
    side), after which the server must close the connection within CLOSE_S. Fails on either
    wait and on anything the server writes that is not HTTP."""
    parts = [data] if isinstance(data, bytes) else list(data)
    shown = b"".join(parts)[:300]
    got = bytearray()
    with socket.create_connection(("127.0.0.1", port), timeout=CLOSE_S) as sock:
        for index, part in enumerate(parts):
            if index:
                time.sleep(0.3)
            try:
                sock.sendall(part)
            except ConnectionError:  # refused and closed before all of it was sent
                break
        open_ = True
        deadline = time.monotonic() + ANSWER_S
        while open_ and len(finals(read_answers(bytes(got), head)[0])) < awaited:
            sock.settimeout(max(deadline - time.monotonic(), 0.01))
            try:
                open_ = receive(sock, got)
            except TimeoutError:
                pytest.fail(f"no answer within {ANSWER_S:g}s to the whole request {shown!r}")
        if open_:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_WR)
            sock.settimeout(CLOSE_S)
            try:
                while receive(sock, got):
                    pass
            except TimeoutError:
                pytest.fail(f"the server held the connection {CLOSE_S:g}s past our EOF: {shown!r}")
    answers, rest = read_answers(bytes(got), head)
    assert rest == b"", f"an unfinished or non-HTTP answer {rest[:300]!r} to {shown!r}"
    return answers


def check_answer(answer: Answer, shown: bytes) -> None:
    """Below 500, and a route's JSON error (aiohttp's own refusals are plain text) says why."""
    assert answer.status < 500, (answer, shown[:300])
    if answer.status >= 400 and answer.headers.get("content-type", "").startswith(
        "application/json"
    ):
        error = json.loads(answer.body)["error"]
        assert error if isinstance(error, str) else error["message"], (answer, shown[:300])


def starts_with_a_whole_request(data: bytes) -> bool:
    """Whether `data` begins with a complete request as h11, an independent HTTP/1.1 parser,
    reads it: then the server must answer it (a 4xx if its own parser, llhttp, disagrees)."""
    connection = h11.Connection(h11.SERVER)
    connection.receive_data(data)  # b"": the end of the stream, ConnectionClosed from then on
    try:
        while (event := connection.next_event()) not in (h11.NEED_DATA, h11.PAUSED):
            if isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                return isinstance(event, h11.EndOfMessage)
    except h11.RemoteProtocolError:
        return False
    return False


def server_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What the server's own code logged as an error (a handler's unexpected exception)."""
    return [
        record.getMessage()
        for record in caplog.records
        if record.name.startswith("warmgate_server") and record.levelno >= logging.ERROR
    ]


# -- the corpus ---------------------------------------------------------------------------------


def request(path: bytes, *headers: bytes, body: bytes = b"") -> bytes:
    lines = [b"POST %s HTTP/1.1" % path, b"Host: warmgate", *headers]
    lines.append(b"Content-Length: %d" % len(body))
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


OPENAI_BODY = b'{"input": "a warm model"}'
TEI_BODY = b'{"inputs": "a warm model"}'
VALID = request(b"/v1/embeddings", b"Content-Type: application/json", body=OPENAI_BODY)
EMBED = b"POST /embed HTTP/1.1\r\nHost: warmgate\r\n"
CHUNKED = EMBED + b"Transfer-Encoding: chunked\r\n\r\n"


def embed_with(line: bytes) -> bytes:
    return EMBED + line + b"\r\nContent-Length: %d\r\n\r\n%s" % (len(TEI_BODY), TEI_BODY)


def with_length(*lines: bytes, body: bytes = TEI_BODY) -> bytes:
    return EMBED + b"".join(line + b"\r\n" for line in lines) + b"\r\n" + body


GZIPPED = gzip.compress(TEI_BODY)
# 8 MiB of JSON that gzip shrinks to about 8 KiB: under --payload-limit as sent, far over it once
# decoded, which is what the limit is about.
BOMB = gzip.compress(b'{"inputs": "' + b" " * (8 << 20) + b'"}')
assert len(BOMB) < PAYLOAD_LIMIT
GZIP = b"Content-Encoding: gzip"
CHUNKED_TE = b"Transfer-Encoding: chunked"
TRUNCATED_DEFLATE = zlib.compress(TEI_BODY)[:12]

OK, BAD, NONE = frozenset({200}), frozenset({400}), frozenset()
OTHER = frozenset({400, 404, 405})
REFUSED_TE = frozenset({400, 501})
TOO_LARGE = frozenset({413})
BODY_TIMEOUT = frozenset({408})
DEFLATE = b"Content-Encoding: deflate"


def case(name: str, data: bytes | tuple[bytes, ...], statuses=BAD, answers: int = 1):
    """A corpus case: the bytes (parts 0.3 s apart when a tuple), the statuses allowed, how many
    final answers."""
    return pytest.param(data, statuses, answers, id=name)


CORPUS = [
    case("a valid request", VALID, OK),
    case("two pipelined", VALID + with_length(b"Content-Length: 26"), OK, 2),
    case(
        "odd chunk sizes, upper-case hex, leading zeros, an extension, a trailer",
        CHUNKED + b'1\r\n{\r\n00A;x=y\r\n"inputs": \r\nF\r\n"a warm model"}\r\n0\r\nT: t\r\n\r\n',
        OK,
    ),
    case("tokenize", request(b"/tokenize", body=TEI_BODY), OK),
    case("HTTP/1.0 without Host", VALID.replace(b"HTTP/1.1\r\nHost: warmgate", b"HTTP/1.0"), OK),
    case("an absolute-form target", VALID.replace(b"/v1/", b"http://warmgate/v1/"), OK),
    case("Expect: 100-continue", embed_with(b"Expect: 100-continue"), OK),
    case("Expect: something else", embed_with(b"Expect: 200-ok"), frozenset({417})),
    case("Upgrade: h2c on a POST", embed_with(b"Connection: Upgrade\r\nUpgrade: h2c"), OK),
    # Content-Encoding: aiohttp decodes the body; bytes that are not in it were a 500 until
    # issue 41 (routes._read_json did not catch aiohttp's RequestPayloadError).
    case("a gzip body", with_length(GZIP, b"Content-Length: %d" % len(GZIPPED), body=GZIPPED), OK),
    *[
        case(
            f"a body not in its Content-Encoding, {path.decode()} {encoding.decode()}",
            request(path, b"Content-Encoding: " + encoding, body=TEI_BODY),
        )
        for path in (b"/v1/embeddings", b"/embed", b"/tokenize", b"/decode", b"/", b"/role")
        for encoding in (b"gzip", b"deflate")
    ],
    case("Content-Encoding: br (not installed, or not in it)", embed_with(b"Content-Encoding: br")),
    case(
        "a truncated deflate body",
        with_length(DEFLATE, b"Content-Length: 12", body=TRUNCATED_DEFLATE),
    ),
    case(
        "a gzip body that decodes past --payload-limit",
        with_length(GZIP, b"Content-Length: %d" % len(BOMB), body=BOMB),
        TOO_LARGE,
    ),
    case(
        "a Content-Length over --payload-limit, no body sent",
        with_length(b"Content-Length: 99999999999", body=b""),
        TOO_LARGE,
    ),
    case(
        "a chunked body over --payload-limit",
        CHUNKED + (b"10000\r\n" + b" " * 0x10000 + b"\r\n") * 9,
        TOO_LARGE,
    ),
    # smuggling: each refused, and nothing after it read as another request
    case(
        "CL.TE",
        with_length(b"Content-Length: 5", b"Transfer-Encoding: chunked", body=b"0\r\n\r\n" + VALID),
    ),
    case(
        "TE.CL",
        with_length(
            b"Transfer-Encoding: chunked",
            b"Content-Length: 4",
            body=b"5c\r\n" + VALID + b"\r\n0\r\n\r\n",
        ),
    ),
    case("two Content-Lengths", with_length(b"Content-Length: 26", b"Content-Length: 0")),
    case("two equal Content-Lengths", with_length(b"Content-Length: 26", b"Content-Length: 26")),
    case("a comma list Content-Length", with_length(b"Content-Length: 26, 26")),
    case(
        "Transfer-Encoding twice",
        with_length(CHUNKED_TE, CHUNKED_TE, body=b"0\r\n\r\n"),
        REFUSED_TE,
    ),
    case(
        "Transfer-Encoding: xchunked",
        with_length(b"Transfer-Encoding: xchunked", body=b"0\r\n\r\n"),
        REFUSED_TE,
    ),
    case("Transfer-Encoding: identity", with_length(b"Transfer-Encoding: identity"), REFUSED_TE),
    case(
        "Transfer-Encoding after a vertical tab",
        with_length(b"Transfer-Encoding:\x0bchunked", body=b"0\r\n\r\n"),
    ),
    case("Content-Length after a vertical tab", with_length(b"Content-Length:\x0b26")),
    case("Content-Length: a superscript two", with_length("Content-Length: ²".encode())),
    case("Content-Length: Arabic-Indic", with_length("Content-Length: \u0662\u0666".encode())),
    case("Content-Length: fullwidth digits", with_length("Content-Length: \uff12\uff16".encode())),
    case("Content-Length: +26", with_length(b"Content-Length: +26")),
    case("Content-Length: 0x1a", with_length(b"Content-Length: 0x1a")),
    case("Content-Length: -1", with_length(b"Content-Length: -1")),
    case("Content-Length past 2**64", with_length(b"Content-Length: 18446744073709551617")),
    case("chunk size 0x5", CHUNKED + b"0x5\r\nhello\r\n0\r\n\r\n"),
    case("chunk size +5", CHUNKED + b"+5\r\nhello\r\n0\r\n\r\n"),
    case("chunk size -5", CHUNKED + b"-5\r\nhello\r\n0\r\n\r\n"),
    case("chunk size with a space", CHUNKED + b"5 \r\nhello\r\n0\r\n\r\n"),
    case("chunk size over-long", CHUNKED + b"1" + b"0" * 20 + b"\r\nhello\r\n0\r\n\r\n"),
    case("chunk size then a bare LF", CHUNKED + b"5\nhello\r\n0\r\n\r\n"),
    case("chunk data not followed by CRLF", CHUNKED + b"5\r\nhelloXX0\r\n\r\n"),
    case("a bare LF in a header value", embed_with(b"Accept: a\nX-Smuggled: 1")),
    case("a bare CR in a header value", embed_with(b"Accept: a\rX-Smuggled: 1")),
    case("a NUL in a header value", embed_with(b"Accept: a\x00b")),
    case("an obs-fold", embed_with(b"Accept: a\r\n b")),
    case("a space before a colon", embed_with(b"Accept : a")),
    case("bare LF line ends", VALID.replace(b"\r\n", b"\n")),
    case("a lower-case method", VALID.replace(b"POST", b"post")),
    case("HTTP/1.2", VALID.replace(b"HTTP/1.1", b"HTTP/1.2")),
    # aiohttp takes other versions in an HTTP/1 request line, and answers in kind ("HTTP/2.0 200
    # OK"); with `Connection: close` as well llhttp may not frame the body by its
    # Content-Length, and the handler then waits for it until --body-timeout
    case("HTTP/2.0", VALID.replace(b"HTTP/1.1", b"HTTP/2.0"), OK),
    case("HTTP/0.9", VALID.replace(b"HTTP/1.1", b"HTTP/0.9"), OK),
    case(
        "HTTP/2.0 and Connection: close",
        VALID.replace(b"HTTP/1.1", b"HTTP/2.0").replace(b"Host:", b"Connection: close\r\nHost:"),
        frozenset({200, 400, 408}),
    ),
    case("the HTTP/2 preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"),
    case("a NUL in the path", VALID.replace(b"/v1/", b"/v1\x00/")),
    case("UTF-8 in the path", VALID.replace(b"/v1/", "/v1é/".encode())),
    case("a header line over 8 KiB", embed_with(b"X-Long: " + b"a" * 9000)),
    case("too many headers", embed_with(b"X-Many: 1\r\n" * 200 + b"X-Last: 1")),
    case("a request line over 8 KiB", b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: w\r\n\r\n"),
    case("a TLS hello", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n"),
    case("a pipelined request after a bad one", embed_with(b"Accept: a\x00b") + VALID),
    # routes and methods
    case("an unknown route", VALID.replace(b"/v1/", b"/v2/"), frozenset({404})),
    case("GET on a POST route", b"GET /embed HTTP/1.1\r\nHost: w\r\n\r\n", frozenset({405})),
    case("CONNECT", b"CONNECT warmgate:443 HTTP/1.1\r\nHost: warmgate\r\n\r\n", OTHER),
    case("OPTIONS *", b"OPTIONS * HTTP/1.1\r\nHost: warmgate\r\n\r\n", OTHER),
    # not a whole request: no answer, and closed at our EOF
    case("a head cut short", VALID[:30], NONE, 0),
    case("a body cut short", VALID[:-5], NONE, 0),
    case("chunks without the last one", CHUNKED + b"5\r\nhello\r\n", NONE, 0),
    case("nothing", b"", NONE, 0),
    # the body after a pause: its handler is already reading it when it goes wrong; a framing
    # error there leaves the handler waiting for the rest until --body-timeout (408)
    case("a bad chunk size after a pause", (CHUNKED, b"zz\r\n\r\n"), BODY_TIMEOUT),
    case(
        "a truncated deflate body after a pause",
        (with_length(DEFLATE, b"Content-Length: 12", body=b""), TRUNCATED_DEFLATE),
        BODY_TIMEOUT,
    ),
    case(
        "a body not in its gzip after a pause",
        (with_length(GZIP, b"Content-Length: 26", body=b""), TEI_BODY),
    ),
]


@pytest.mark.parametrize(("data", "statuses", "answers"), CORPUS)
async def test_odd_and_malformed_framing_is_answered_below_500_and_closed(
    client, caplog, data, statuses, answers
):
    got = finals(await asyncio.to_thread(exchange, client.server.port, data, answers))
    shown = data if isinstance(data, bytes) else b"".join(data)
    assert len(got) == answers, (got, shown[:300])
    for answer in got:
        check_answer(answer, shown)
        assert answer.status in statuses, (answer, shown[:300])
    assert server_errors(caplog) == []


async def test_a_body_not_in_its_content_encoding_is_refused_in_the_route_s_shape(client):
    # aiohttp cannot gunzip it (RequestPayloadError): the client's fault, a 400 that says so in
    # each API's own error shape, where it was a 500 (a plain-text one on /tokenize).
    headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    response = await client.post("/v1/embeddings", data=OPENAI_BODY, headers=headers)
    body = await response.json()
    assert response.status == 400 and body["error"]["code"] == "invalid_body", body
    assert "cannot be read" in body["error"]["message"]
    for path in ("/embed", "/tokenize"):
        response = await client.post(path, data=b'{"inputs": "hi"}', headers=headers)
        body = await response.json()
        assert response.status == 400 and body["error_type"] == "Validation", (path, body)
        assert "cannot be read" in body["error"], (path, body)


async def test_a_head_request_gets_a_head_only(client):
    data = b"HEAD /embed HTTP/1.1\r\nHost: w\r\n\r\n"
    (head,) = finals(await asyncio.to_thread(exchange, client.server.port, data, 1, True))
    assert head.status == 405 and head.headers["allow"] == "POST" and head.body == b""


async def metric_statuses(client: TestClient, endpoint: str) -> Counter[str]:
    """warmgate_http_requests_total of `endpoint`, by status."""
    text = await (await client.get("/metrics")).text()
    pattern = (
        rf'warmgate_http_requests_total{{endpoint="{re.escape(endpoint)}",status="(\d+)"}} (\S+)'
    )
    return Counter({status: int(float(value)) for status, value in re.findall(pattern, text)})


async def test_clients_that_hang_up_mid_request_leave_nothing_in_flight(client, caplog):
    """Clients that close as soon as their request is written (aiohttp cancels their handlers,
    wherever they are: reading, tokenizing, queued, in the model): nothing stays in flight, the
    next request is served, and the metrics count them as 499, "client closed request" (until
    issue 41, as 500s that the server never answered)."""
    body = json.dumps({"inputs": ["a warm model answers fast"] * 4}).encode()
    data = request(b"/embed", body=body)

    def hang_up() -> None:
        for _ in range(20):
            with socket.create_connection(("127.0.0.1", client.server.port)) as sock:
                sock.sendall(data)

    before = await metric_statuses(client, "/embed")
    await asyncio.to_thread(hang_up)
    runtime = client.server.app[RUNTIME]
    for _ in range(60):  # until all 20 are counted (one cancelled before its handler began is
        # not counted at all) and their batches are done
        counted = await metric_statuses(client, "/embed") - before
        if counted.total() >= 20 and runtime.idle:
            break
        await asyncio.sleep(0.05)
    assert counted["499"] > 0 and set(counted) <= {"200", "499"}, counted
    assert runtime.idle and runtime.in_flight == 0
    response = await client.post("/embed", data=body)
    assert response.status == 200 and len(await response.json()) == 4
    assert server_errors(caplog) == []


# -- hypothesis: arbitrary bytes, and valid requests mutated --------------------------------------

FUZZ = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

WORDS = st.text(
    st.characters(codec="utf-8", categories=("L", "N", "P", "Zs")), min_size=1, max_size=24
)
PATHS = [
    (b"/v1/embeddings", "input"),
    (b"/embeddings", "input"),
    (b"/embed", "inputs"),
    (b"/embed_all", "inputs"),
    (b"/tokenize", "inputs"),
]


@st.composite
def valid_requests(draw: st.DrawFn) -> bytes:
    """A whole request the server answers 200: a text to one of the routes, its body framed by
    Content-Length or in chunks of drawn sizes (hex in either case, leading zeros, extensions)."""
    path, field = draw(st.sampled_from(PATHS))
    body = json.dumps({field: draw(WORDS)}).encode()
    head = b"POST %s HTTP/1.1\r\nHost: warmgate\r\nContent-Type: application/json\r\n" % path
    if draw(st.booleans()):
        return head + b"Content-Length: %d\r\n\r\n" % len(body) + body
    cuts = sorted(draw(st.lists(st.integers(1, len(body) - 1), max_size=4, unique=True)))
    framed = head + b"Transfer-Encoding: chunked\r\n\r\n"
    for start, end in zip([0, *cuts], [*cuts, len(body)], strict=True):
        size = draw(st.sampled_from(["%x", "%X", "%03x"])) % (end - start)
        framed += size.encode() + draw(st.sampled_from([b"", b";a=b"])) + b"\r\n"
        framed += body[start:end] + b"\r\n"
    return framed + b"0\r\n\r\n"


INTERESTING = [
    b"\r\n", b"\n", b"\r", b"\x00", b"\x0b", b" ", b"\t", b":", b";", b",", b"0x", b"+", b"-",
    b"\xff", "²".encode(), "\u0662\u0666".encode(), b"\r\n ", b"\r\n\r\n", b"0\r\n\r\n",
    b"Transfer-Encoding: chunked\r\n", b"Content-Length: 3\r\n", b"Content-Length: 99999999\r\n",
    b"Content-Encoding: gzip\r\n", b"Expect: 100-continue\r\n", b"Connection: close\r\n",
    b"HTTP/1.1", b"{", b'"',
]  # fmt: skip
HEADERS = [
    b"Content-Encoding: gzip", b"Content-Encoding: deflate", b"Transfer-Encoding: chunked",
    b"Content-Length: 0", b"Content-Length: 12", b"Expect: 100-continue", b"Connection: close",
    b"Connection: Upgrade\r\nUpgrade: h2c", b"Content-Type: text/plain",
]  # fmt: skip
MUTATIONS = [
    "insert", "delete", "replace", "flip a bit", "truncate", "duplicate a line", "add a header"
]  # fmt: skip


@st.composite
def mutated(draw: st.DrawFn) -> tuple[bytes, int, int]:
    """One or two pipelined valid requests, with up to four mutations; and how many mutations
    and requests."""
    requests = draw(st.lists(valid_requests(), min_size=1, max_size=2))
    data = bytearray(b"".join(requests))
    count = draw(st.integers(0, 4))
    for _ in range(count):
        at = draw(st.integers(0, len(data)))
        operation = draw(st.sampled_from(MUTATIONS))
        if operation == "insert":
            data[at:at] = draw(st.sampled_from(INTERESTING) | st.binary(min_size=1, max_size=3))
        elif operation == "delete":
            del data[at : at + draw(st.integers(1, 8))]
        elif operation == "replace":
            data[at : at + 1] = draw(st.sampled_from(INTERESTING))
        elif operation == "flip a bit":
            if at < len(data):
                data[at] ^= 1 << draw(st.integers(0, 7))
        elif operation == "truncate":
            del data[at:]
        else:  # a line repeated, or a header added, at a line's end (in the head or not)
            lines = bytes(data).split(b"\r\n")
            line = draw(st.integers(0, len(lines) - 1))
            added = lines[line]
            if operation == "add a header":
                added = draw(st.sampled_from(HEADERS))
            data = bytearray(b"\r\n".join([*lines[: line + 1], added, *lines[line + 1 :]]))
    return bytes(data), count, len(requests)


def check_stream(port: int, data: bytes, awaited: int | None = None) -> list[Answer]:
    """Any bytes: HTTP answers below 500, one at least when a whole request comes first (or the
    `awaited` ones), and the connection closed once we end the stream; then a valid request is
    still served."""
    if awaited is None:
        awaited = int(starts_with_a_whole_request(data))
    answers = finals(exchange(port, data, awaited))
    assert len(answers) >= awaited, f"no answer to the whole request {data[:300]!r}"
    for answer in answers:
        check_answer(answer, data)
    after = finals(exchange(port, request(b"/embed", body=TEI_BODY), awaited=1))
    assert [answer.status for answer in after] == [200], (data[:300], after)
    return answers


async def test_arbitrary_bytes_get_http_answers_below_500_and_never_hold_the_server(client, caplog):
    port = client.server.port

    @FUZZ
    @given(
        st.binary(max_size=400)
        | st.builds(
            lambda start, rest: start + rest,
            st.sampled_from([b"POST /v1/embeddings HTTP/1.1\r\n", b"GET / HTTP/1.1\r\n", EMBED]),
            st.binary(max_size=200),
        )
    )
    def check(data: bytes) -> None:
        check_stream(port, data)

    await asyncio.to_thread(check)
    assert server_errors(caplog) == []
    assert client.server.app[RUNTIME].in_flight == 0


async def test_mutated_valid_requests_get_http_answers_below_500_and_never_hold_the_server(
    client, caplog
):
    port = client.server.port
    seen: Counter[str] = Counter()

    @settings(FUZZ, max_examples=200)
    @given(mutated())
    def check(case: tuple[bytes, int, int]) -> None:
        data, mutations, requests = case
        if mutations == 0:  # the generator's requests are valid: each one served
            assert starts_with_a_whole_request(data)
            answers = check_stream(port, data, awaited=requests)
            assert [answer.status for answer in answers] == [200] * requests, (data, answers)
        else:
            answers = check_stream(port, data)
        seen["answered" if answers else "unanswered"] += 1
        seen.update(str(answer.status) for answer in answers)

    await asyncio.to_thread(check)
    # The mutations reach every outcome: served, refused by the parser or a route, unanswered.
    assert seen["200"] and seen["400"] and seen["unanswered"], seen
    assert server_errors(caplog) == []
    assert client.server.app[RUNTIME].in_flight == 0


# -- hypothesis: any JSON body for every POST route ----------------------------------------------

TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=30)  # surrogates too
SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | TEXT
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(TEXT, inner, max_size=5),
    max_leaves=20,
)
IDS = st.lists(st.integers(0, 30_521), min_size=1, max_size=6)  # MiniLM's vocabulary
INPUTS = WORDS | IDS | st.lists(WORDS | IDS, min_size=1, max_size=4)
TRUNCATION = st.sampled_from(["Left", "right", "LEFT"])
# Values a client means for each field, mostly valid, so that validation goes past its first
# check and some requests are served; each field gets arbitrary JSON a quarter of the time
# (bodies()), which is where most refusals come from.
FIELDS: dict[str, st.SearchStrategy[object]] = {
    "input": INPUTS,
    "inputs": INPUTS,
    "model": st.just("all-MiniLM-L6-v2"),
    "encoding_format": st.sampled_from(["float", "base64"]),
    "dimensions": st.integers(1, 384),
    "user": WORDS,
    "normalize": st.booleans(),
    "return_dense": st.booleans(),
    "return_sparse": st.booleans(),
    "return_colbert_vecs": st.booleans(),
    "truncate": st.booleans(),
    "truncation_direction": TRUNCATION,
    "add_special_tokens": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "ids": IDS | st.lists(IDS, min_size=1, max_size=4),
    "parameters": st.fixed_dictionaries(
        {}, optional={"truncate": st.booleans(), "truncation_direction": TRUNCATION}
    ),
    "role": st.just("serving"),  # not "standby": that would close this module's connections
}
SIMILARITY = st.fixed_dictionaries(
    {"source_sentence": WORDS, "sentences": st.lists(WORDS, min_size=1, max_size=3)}
)
OPENAI_FIELDS = ("input", "model", "encoding_format", "dimensions", "user")
TEI_FIELDS = (
    "inputs", "normalize", "truncate", "truncation_direction", "dimensions", "prompt_name"
)  # fmt: skip
# (path, its error shape, its fields): every POST route add_routes serves.
ROUTES = [
    ("/v1/embeddings", "openai", OPENAI_FIELDS),
    ("/embeddings", "openai", OPENAI_FIELDS),
    ("/embed", "tei", TEI_FIELDS),
    ("/embed_all", "tei", TEI_FIELDS),
    ("/", "tei", (*TEI_FIELDS, "parameters")),
    ("/invocations", "tei", (*TEI_FIELDS, "parameters")),
    ("/similarity", "tei", ("inputs", "parameters")),
    ("/tokenize", "tei", ("inputs", "add_special_tokens", "prompt_name")),
    ("/decode", "tei", ("ids", "skip_special_tokens")),
    ("/embed_sparse", "tei", ("inputs", "truncate")),
    ("/embed_multi", "tei", (*TEI_FIELDS, "return_dense", "return_sparse", "return_colbert_vecs")),
    ("/rerank", "tei", ("query", "texts", "raw_scores")),
    ("/predict", "tei", ("inputs", "raw_scores")),
    ("/role", "role", ("role",)),
]
JSON_EXAMPLES = 100
OTHER_KINDS = {"/embed_sparse", "/rerank", "/predict"}  # 424: not this kind of model


def bodies(path: str, fields: Sequence[str]) -> st.SearchStrategy[bytes]:
    """Objects of the route's own fields (any subset), each a value a client could mean or any
    JSON; any other JSON; bytes that are not JSON."""

    def value(name: str) -> st.SearchStrategy[object]:
        meant = FIELDS.get(name, st.nothing())
        if name == "inputs" and path in ("/", "/invocations", "/similarity"):
            meant = SIMILARITY if path == "/similarity" else meant | SIMILARITY
        return st.one_of(meant, meant, meant, JSON)

    objects = st.fixed_dictionaries({}, optional={name: value(name) for name in fields})
    return st.one_of(
        objects.map(lambda body: json.dumps(body).encode()),
        objects.map(lambda body: json.dumps(body).encode()),
        JSON.map(lambda body: json.dumps(body).encode()),
        st.binary(max_size=100),
    )


def post(port: int, path: str, body: bytes, encoding: str | None = None) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=ANSWER_S)
    headers = {"Content-Type": "application/json"}
    if encoding:
        headers["Content-Encoding"] = encoding
    try:
        connection.request("POST", path, body, headers)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def check_error_shape(shape: str, answer: object) -> None:
    """schemas' errors: OpenAI's {"error": {message, type, param, code}}, TEI's {"error",
    "error_type"}, /role's {"error"}."""
    assert isinstance(answer, dict), answer
    if shape == "openai":
        assert set(answer["error"]) == {"message", "type", "param", "code"}, answer
        assert answer["error"]["message"] and answer["error"]["code"], answer
    elif shape == "tei":
        assert set(answer) == {"error", "error_type"} and answer["error"], answer
    else:
        assert set(answer) == {"error"} and answer["error"], answer


@pytest.mark.parametrize(("path", "shape", "fields"), ROUTES, ids=[r[0] for r in ROUTES])
async def test_any_json_body_gets_200_or_a_4xx_in_the_routes_shape(
    client, caplog, path, shape, fields
):
    port = client.server.port
    statuses: Counter[int] = Counter()

    @settings(FUZZ, max_examples=JSON_EXAMPLES, suppress_health_check=list(HealthCheck))
    @given(bodies(path, fields))
    def check(body: bytes) -> None:
        status, raw = post(port, path, body)
        statuses[status] += 1
        assert status == 200 or 400 <= status < 500, (path, body[:300], status, raw[:300])
        answer = json.loads(raw)
        if status >= 400:
            check_error_shape(shape, answer)

    await asyncio.to_thread(check)
    if path in OTHER_KINDS:
        assert set(statuses) == {424}, statuses
    else:  # deep enough to be served, and refused
        assert statuses[200] and set(statuses) - {200}, statuses
    assert server_errors(caplog) == []
    assert client.server.app[RUNTIME].in_flight == 0


# -- afterwards ----------------------------------------------------------------------------------


async def test_after_the_fuzz_the_server_serves_sentence_transformers_vector(
    client, sentence_transformer
):
    text = "a warm model answers every request fast"
    response = await client.post("/v1/embeddings", json={"input": text})
    assert response.status == 200
    served = np.array((await response.json())["data"][0]["embedding"])
    expected = sentence_transformer.encode([text], normalize_embeddings=True)[0]
    np.testing.assert_allclose(served, expected, atol=1e-5)
    assert (await (await client.get("/role")).json()) == {"role": "serving"}


def rss() -> int:
    """The process's resident memory, once the garbage collector and glibc have given back what
    is free (malloc_trim: each thread's malloc arena otherwise keeps freed memory resident, so
    RSS would follow which threads happened to hold the last large buffers)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


MEMORY_BATCH = 150
PADDING = "x" * (256 * 1024)
GROWTH_BOUND = 16 << 20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="RSS from /proc (Linux)")
async def test_memory_does_not_grow_with_the_bodies_served_and_refused(client, caplog):
    """Two batches of MEMORY_BATCH requests, each with a 256 KiB body, served or refused by a
    route, and a gzip body that decodes past --payload-limit: the process's RSS after the second
    is within GROWTH_BOUND of its RSS after the first. Anything kept per request that is as big
    as its body (the bytes, the parsed JSON, an answer, a task or buffer holding one) adds 37 MiB
    over the second batch (measured, keeping only each body's bytes); the first batch pays what
    is paid once, and the second then grows by under 1 MiB here. The texts are short: a long one
    makes the tokenizer's threads grow their malloc arenas the first time each tokenizes one,
    by up to 20 MiB, whichever batch that falls in. The server shares this process (an app on
    the test's loop), so its RSS is the process's."""
    port = client.server.port
    kinds = [
        ("/v1/embeddings", {"input": "a warm model", "user": PADDING}, 200),
        ("/embed", {"inputs": ["a warm model", "answers"], "padding": PADDING}, 200),
        ("/embed_all", {"inputs": "a warm model", "padding": PADDING}, 200),
        ("/tokenize", {"inputs": "a warm model", "padding": PADDING}, 200),
        ("/embed", {"inputs": 5, "padding": PADDING}, 422),
        ("/v1/embeddings", {"input": "a warm model " * 700, "user": PADDING}, 400),  # too long
        (
            "/similarity",
            {"inputs": {"source_sentence": "a", "sentences": ["b"]}, "x": PADDING},
            200,
        ),
    ]

    def batch(seed: int) -> Counter[int]:
        statuses: Counter[int] = Counter()
        rng = random.Random(seed)
        for _ in range(MEMORY_BATCH):
            path, body, status = rng.choice(kinds)
            got, raw = post(port, path, json.dumps(body).encode())
            assert got == status, (path, got, raw[:300])
            statuses[got] += 1
        got, raw = post(port, "/embed", BOMB, "gzip")
        assert got == 413, raw[:300]
        return statuses

    await asyncio.to_thread(batch, 1)
    first = rss()
    statuses = await asyncio.to_thread(batch, 2)
    growth = rss() - first
    assert len(statuses) >= 3, statuses
    assert growth < GROWTH_BOUND, f"RSS grew {growth / 2**20:.1f} MiB over {MEMORY_BATCH} requests"
    assert server_errors(caplog) == []
