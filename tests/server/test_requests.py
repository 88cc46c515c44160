"""Requests and their answers over HTTP, against one warmed app that the whole module shares
(the real model): response shapes, headers, vectors, and a 4xx in the route's own shape for
every bad body, after which the app still serves. Tests whose app state must be fresh (counts,
the warmup, overload) are test_routes.py's."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator

import numpy as np
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient
from support.server import make_config, serving

pytestmark = pytest.mark.asyncio(loop_scope="module")

LONG_TEXT = "the quick brown fox jumps over the lazy dog " * 20  # about 180 tokens
ARGS = [
    "--model-revision", "abc123", "--max-batch-size", "4", "--max-client-batch-size", "4",
    "--payload-limit", "2048",
]  # fmt: skip


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(minilm_dir, loaded_minilm) -> AsyncIterator[TestClient]:
    async with serving(make_config(minilm_dir, *ARGS), loaded_minilm) as ready:
        yield ready


async def test_openai_embeddings_response(client) -> None:
    response = await client.post(
        "/v1/embeddings", json={"input": ["hello world", "second"], "model": "all-MiniLM-L6-v2"}
    )
    assert response.status == 200
    assert response.headers["X-Warmgate-Revision"] == "abc123"
    assert response.headers["X-Warmgate-Cold"] in ("0", "1")
    assert response.headers["X-Warmgate-Pod"]
    timings = {
        name: float(duration.removeprefix("dur="))
        for name, duration in (
            metric.strip().split(";") for metric in response.headers["Server-Timing"].split(",")
        )
    }
    assert list(timings) == ["tokenize", "queue", "model", "model-cpu", "embed"]
    assert timings["model"] > 0 and timings["model-cpu"] > 0
    # the stages happen one after another inside the whole request
    assert timings["tokenize"] + timings["queue"] + timings["model"] <= timings["embed"] + 0.3
    body = await response.json()
    assert body["object"] == "list" and body["model"] == "all-MiniLM-L6-v2"
    assert [item["index"] for item in body["data"]] == [0, 1]
    vector = np.array(body["data"][0]["embedding"])
    assert vector.shape == (384,) and abs(np.linalg.norm(vector) - 1) < 1e-5
    assert body["usage"] == {"prompt_tokens": 4 + 3, "total_tokens": 7}


async def test_base64_and_dimensions(client) -> None:
    floats = await (await client.post("/v1/embeddings", json={"input": "hi there"})).json()
    encoded = await (
        await client.post("/v1/embeddings", json={"input": "hi there", "encoding_format": "base64"})
    ).json()
    decoded = np.frombuffer(base64.b64decode(encoded["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, floats["data"][0]["embedding"], rtol=1e-6)
    short = await (
        await client.post("/v1/embeddings", json={"input": "hi there", "dimensions": 64})
    ).json()
    short_vector = np.array(short["data"][0]["embedding"])
    assert short_vector.shape == (64,) and abs(np.linalg.norm(short_vector) - 1) < 1e-5


async def test_tei_embed_normalize_and_truncate(client) -> None:
    response = await client.post("/embed", json={"inputs": "hello", "normalize": False})
    assert response.status == 200 and response.headers["X-Warmgate-Revision"] == "abc123"
    (vector,) = await response.json()
    assert abs(np.linalg.norm(vector) - 1) > 1e-3  # raw mean pooling is not unit length
    too_long = await client.post("/embed", json={"inputs": LONG_TEXT})
    assert too_long.status == 422
    assert (await too_long.json())["error_type"] == "Validation"
    right = await client.post("/embed", json={"inputs": [LONG_TEXT], "truncate": True})
    left = await client.post(
        "/embed",
        json={"inputs": [LONG_TEXT + "zebra"], "truncate": True, "truncation_direction": "Left"},
    )
    assert right.status == 200 and left.status == 200
    assert (await right.json())[0] != (await left.json())[0]


# OpenAI answers a request it cannot take with 400 (TEI: 422 for validation, 400 for empty).
BAD_OPENAI = [
    ("{not json", 400, "invalid_json"),
    ('["a list"]', 400, "invalid_type"),
    ("{}", 400, "missing"),
    ('{"input": 5}', 400, "invalid_type"),
    ('{"input": [[101, "x"]]}', 400, "invalid_type"),
    ('{"input": [{"text": "x"}]}', 400, "invalid_type"),
    ('{"input": [[101, 99999999]]}', 400, "invalid_token_ids"),
    ('{"input": [[101, -1]]}', 400, "invalid_token_ids"),
    ('{"input": []}', 400, "empty_input"),
    ('{"input": [[]]}', 400, "empty_input"),
    ('{"input": ["ok", ""]}', 400, "empty_input"),
    ('{"input": ["a", "b", "c", "d", "e"]}', 400, "too_many_inputs"),
    (json.dumps({"input": LONG_TEXT}), 400, "input_too_long"),
    ('{"input": "x", "model": "gpt-4"}', 404, "model_not_found"),
    ('{"input": "x", "encoding_format": "int8"}', 400, "invalid_encoding_format"),
    ('{"input": "x", "dimensions": 0}', 400, "invalid_dimensions"),
    ('{"input": "x", "dimensions": 1000}', 400, "invalid_dimensions"),
    ('{"input": "x", "dimensions": "64"}', 400, "invalid_type"),
    ('{"input": "x", "user": 7}', 400, "invalid_type"),
    (json.dumps({"input": "y" * 3000}), 413, "payload_too_large"),
]

BAD_TEI = [
    ("{not json", 400, "Validation"),
    ('{"inputs": []}', 400, "Empty"),
    ('{"inputs": ""}', 400, "Empty"),
    ('{"inputs": 3}', 422, "Validation"),
    ('{"inputs": [[1, 2], 3]}', 422, "Validation"),
    ('{"inputs": ["a", "b", "c", "d", "e"]}', 422, "Validation"),
    (json.dumps({"inputs": LONG_TEXT}), 422, "Validation"),
    ('{"inputs": "x", "normalize": "yes"}', 422, "Validation"),
    ('{"inputs": "x", "truncate": 1}', 422, "Validation"),
    ('{"inputs": "x", "truncation_direction": "Up"}', 422, "Validation"),
    ('{"inputs": "x", "prompt_name": "query"}', 422, "Validation"),
    (json.dumps({"inputs": "y" * 3000}), 413, "Validation"),
]


async def refused(client: TestClient, path: str, body: str, good: dict) -> tuple[int, dict]:
    """The status and JSON of `path`'s answer to a bad raw `body`; the app then still serves
    `good`."""
    response = await client.post(path, data=body, headers={"Content-Type": "application/json"})
    answer = await response.json()
    assert (await client.post(path, json=good)).status == 200
    return response.status, answer


@pytest.mark.parametrize(("body", "status", "code"), BAD_OPENAI)
async def test_bad_openai_input_gets_a_4xx_in_openai_shape(
    client, body: str, status: int, code: str
) -> None:
    got, answer = await refused(client, "/v1/embeddings", body, {"input": "still serving"})
    error = answer["error"]
    assert got == status and set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and error["message"]


@pytest.mark.parametrize(("body", "status", "error_type"), BAD_TEI)
async def test_bad_tei_input_gets_a_4xx_in_tei_shape(
    client, body: str, status: int, error_type: str
) -> None:
    got, error = await refused(client, "/embed", body, {"inputs": "still serving"})
    assert got == status and set(error) == {"error", "error_type"}
    assert error["error_type"] == error_type


async def test_every_kind_of_request_runs_the_same_model_path(client) -> None:
    """/embed_all's token states, mean-pooled, are /embed's unnormalised vectors (MiniLM pools
    with the mean); /similarity's scores are the cosines of /embed's vectors. Each answer says
    where its time went: all three go through the batcher and a model worker."""
    texts = ["a warm model", "answers every request fast, even the first one"]
    answers = {}
    for path, body in (
        ("/embed", {"inputs": texts, "normalize": False}),
        ("/embed_all", {"inputs": texts}),
        ("/similarity", {"inputs": {"source_sentence": texts[0], "sentences": texts}}),
    ):
        response = await client.post(path, json=body)
        assert response.status == 200, await response.text()
        timing = response.headers["Server-Timing"]
        model_ms = float(timing.split("model;dur=")[1].split(",")[0])
        assert model_ms > 0, (path, timing)
        answers[path] = await response.json()
    vectors = np.array(answers["/embed"])
    pooled = np.array([np.mean(states, axis=0) for states in answers["/embed_all"]])
    np.testing.assert_allclose(pooled, vectors, atol=1e-5)
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    np.testing.assert_allclose(answers["/similarity"], unit @ unit[0], atol=1e-5)
