"""Bad input, whatever it is: arbitrary JSON of any shape and depth, arbitrary bytes, and
Unicode a tokenizer chokes on (unpaired surrogates, control characters) sent to every POST route
of a real server. Each gets an answer below 500, a 4xx in the route's own error shape, and the
server keeps serving."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.parse
import urllib.request

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

OPENAI_ROUTES = ("/v1/embeddings", "/embeddings")
TEI_ROUTES = ("/embed", "/embed_all", "/", "/invocations", "/tokenize", "/decode", "/similarity")

text = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)
scalars = st.none() | st.booleans() | st.integers() | st.floats() | text
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(text, inner, max_size=5),
    max_leaves=20,
)
keys = st.sampled_from(
    ["input", "inputs", "ids", "model", "encoding_format", "dimensions", "user", "normalize",
     "truncate", "truncation_direction", "prompt_name", "add_special_tokens",
     "skip_special_tokens", "parameters", "source_sentence", "sentences"]
)  # fmt: skip
# Objects with the routes' own field names (so validation goes deep), anything else as JSON,
# and bytes that are not JSON at all.
bodies = (
    st.dictionaries(keys, values, max_size=4).map(lambda d: json.dumps(d).encode())
    | values.map(lambda v: json.dumps(v).encode())
    | st.binary(max_size=200)
)


def post(url: str, body: bytes) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def check(server, path: str, body: bytes) -> None:
    status, raw = post(server.url + path, body)
    assert status < 500, (path, body[:200], raw[:300])
    if status >= 400:
        error = json.loads(raw)
        if path in OPENAI_ROUTES:
            assert set(error["error"]) == {"message", "type", "param", "code"}, error
            assert error["error"]["message"]
        else:
            assert set(error) == {"error", "error_type"} and error["error"], error


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(path=st.sampled_from(OPENAI_ROUTES + TEI_ROUTES), body=bodies)
def test_any_body_gets_a_4xx_in_the_routes_shape(server, path: str, body: bytes) -> None:
    check(server, path, body)


def test_unicode_a_tokenizer_chokes_on(server) -> None:
    nasty = [
        "\ud800",  # an unpaired surrogate (JSON can carry it as an escape)
        "ok \udfff then",
        "\x00\x01\x1b[31m\x7f",
        "\u202e\u200b\ufeff",
        "a" * 5 + "\U0010ffff",
    ]
    for text in nasty:
        for path, body in (
            ("/v1/embeddings", {"input": text}),
            ("/embed", {"inputs": [text, "fine"]}),
            ("/tokenize", {"inputs": text}),
            ("/similarity", {"inputs": {"source_sentence": text, "sentences": [text]}}),
        ):
            check(server, path, json.dumps(body).encode())
    deep = b"[" * 100_000 + b"]" * 100_000
    for path in OPENAI_ROUTES + TEI_ROUTES:
        check(server, path, deep)
    status, _ = post(server.url + "/v1/embeddings", json.dumps({"input": "still here"}).encode())
    assert status == 200


def test_a_slow_sender_gets_408_and_holds_nothing(server) -> None:
    """A client that announces a body and stops sending it gets 408 after --body-timeout (2 s
    here), on a closed connection, and others are served meanwhile."""
    address = urllib.parse.urlsplit(server.url)
    started = time.monotonic()
    with socket.create_connection((address.hostname, address.port), timeout=30) as slow:
        slow.sendall(
            b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n" + b'{"input": "only a part'
        )
        status, _ = post(server.url + "/embed", json.dumps({"inputs": "meanwhile"}).encode())
        assert status == 200
        answer = b""
        while chunk := slow.recv(65536):  # the server closes the connection after answering
            answer += chunk
    waited = time.monotonic() - started
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer[:300]
    error = json.loads(body)["error"]
    assert error["code"] == "body_timeout" and "--body-timeout" in error["message"]
    assert 2.0 <= waited < 20.0


def test_a_huge_text_is_refused_on_its_tokens_or_cut_to_the_limit(server) -> None:
    """1.5 MB of text in one input, under --payload-limit: tokenized whole, so refused without
    truncation with its count of tokens, never of characters; with truncation, the vector of
    its first (or last) 128 tokens, the same as a 3,000-character start's (or end's)."""
    huge = "warm models answer fast " * 62_500
    status, raw = post(server.url + "/v1/embeddings", json.dumps({"input": huge}).encode())
    error = json.loads(raw)["error"]
    assert status == 400 and error["code"] == "input_too_long", error
    assert "input 0 has 250002 tokens, above the limit of 128" in error["message"], error

    def embed(text: str, direction: str) -> np.ndarray:
        body = {"inputs": text, "truncate": True, "truncation_direction": direction}
        status, raw = post(server.url + "/embed", json.dumps(body).encode())
        assert status == 200, raw[:300]
        return np.array(json.loads(raw)[0])

    np.testing.assert_allclose(embed(huge, "Right"), embed(huge[:3000], "Right"), atol=1e-6)
    np.testing.assert_allclose(embed(huge, "Left"), embed(huge[-3000:], "Left"), atol=1e-6)
