"""The HTTP API against create_app with the real model: shapes, headers, errors, overload."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest

from warmgate_server.context import RUNTIME
from warmgate_server.source import weights_digest
from warmgate_server.testing import minilm_path, wait_for_phase

LONG_TEXT = "the quick brown fox jumps over the lazy dog " * 20  # about 180 tokens


async def test_probes_and_reports_while_warming_then_ready(start_server) -> None:
    client = await start_server("--warmup", wait=False)
    response = await client.get("/ready")
    early = await response.json()
    assert response.status == 503 and early["phase"] in ("loading", "warming")
    assert (await client.get("/healthz")).status == 200
    refused = await client.post("/v1/embeddings", json={"input": "too early"})
    assert refused.status == 503
    assert "not ready" in (await refused.json())["error"]["message"]

    report = await wait_for_phase(client, {"ready"})
    assert set(report) == {
        "phase", "ready", "model", "device", "dtype", "workers", "torch_threads",
        "planned_shapes", "warmed_shapes", "progress", "warmup_seconds", "error", "started_at",
        "pid", "model_settings", "download", "forward",
    }  # fmt: skip
    # On a CPU: warmgate's packed pass, attention over padded keys, and no CUDA graphs.
    assert report["forward"] == {
        "pass": "packed",
        "attention": "padded keys",
        "cuda_graphs": {"mode": "off", "reason": "the device is cpu"},
    }
    # The model folder's own sentence-transformers files chose the pooling and normalisation.
    assert report["model_settings"]["pooling"] == "mean"
    assert report["model_settings"]["normalize"] is True
    assert report["model_settings"]["chosen_by"] == {
        "pooling": "1_Pooling/config.json",
        "normalize": "modules.json",
        "prompt": "default (no prompt)",
        "max_input_length": "the largest of --sequence-buckets",
    }
    assert report["model_settings"]["max_input_length"] == 64
    assert report["ready"] is True and report["error"] is None
    # A folder: no hub commit, and the digest of the weights it holds.
    assert report["model"] == {
        "id": report["model"]["id"],
        "revision": "main",
        "served_name": "all-MiniLM-L6-v2",
        "commit": None,
        "weights_digest": weights_digest(minilm_path()),
    }
    assert report["download"] is None
    assert (report["device"], report["dtype"]) == ("cpu", "float32")
    assert report["workers"] >= 1 and report["torch_threads"] >= 1
    planned = [(s["batch_size"], s["seq_len"]) for s in report["planned_shapes"]]
    assert planned == [(1, 16), (4, 16), (1, 32), (4, 32), (1, 64), (4, 64)]
    warmed = [(s["batch_size"], s["seq_len"]) for s in report["warmed_shapes"]]
    assert warmed == planned
    assert all(
        s["steady_ms"] > 0 and s["runs"] >= 2 and s["seconds"] >= s["steady_ms"] / 1000.0
        for s in report["warmed_shapes"]
    )
    assert report["progress"] == {"done": 6, "total": 6}


async def test_openai_embeddings_response(start_server) -> None:
    client = await start_server("--model-revision", "abc123")
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


async def test_base64_and_dimensions(start_server) -> None:
    client = await start_server()
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


async def test_tei_embed_normalize_and_truncate(start_server) -> None:
    client = await start_server()
    response = await client.post("/embed", json={"inputs": "hello", "normalize": False})
    assert response.status == 200 and response.headers["X-Warmgate-Revision"] == "main"
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


async def test_info_models_profile_and_metrics(start_server) -> None:
    client = await start_server()
    info = await (await client.get("/info")).json()
    assert info["hidden_size"] == 384 and info["max_input_length"] == 64
    assert info["served_model_name"] == "all-MiniLM-L6-v2"
    models = await (await client.get("/v1/models")).json()
    assert [entry["id"] for entry in models["data"]] == ["all-MiniLM-L6-v2"]
    await client.post("/embed", json={"inputs": ["a", "b", "c"]})
    profile = await (await client.get("/warmup/profile")).json()
    assert profile == {"shapes": [{"batch_size": 4, "seq_len": 16, "count": 1}]}
    text = await (await client.get("/metrics")).text()
    for name in (
        'warmgate_http_requests_total{endpoint="/embed",status="200"} 1.0',
        "warmgate_queue_depth 0.0",
        "warmgate_ready 1.0",
        'warmgate_inference_duration_seconds_count{phase="warm",shape="4x16"} 1.0',
        "warmgate_padding_ratio_count 1.0",
        "warmgate_batch_tokens_sum 64.0",
        'warmgate_warmup_shape_steady_seconds{shape="4x64"}',
        "warmgate_cold_hits_total 0.0",
    ):
        assert name in text, name
    samples = dict(
        line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#")
    )
    wall = sum(
        float(value)
        for key, value in samples.items()
        if key.startswith("warmgate_inference_duration_seconds_sum")
    )
    cpu = float(samples["warmgate_inference_cpu_seconds_total"])
    # the served batch took CPU time in its model thread, and no more than its wall time
    assert 0 < cpu <= wall * 1.05 + 0.001


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


@pytest.fixture
async def strict_client(start_server):
    return await start_server(
        "--max-batch-size", "4", "--max-client-batch-size", "4", "--payload-limit", "2048"
    )  # fmt: skip


@pytest.mark.parametrize(("body", "status", "code"), BAD_OPENAI)
async def test_bad_openai_input_gets_a_4xx_in_openai_shape(
    strict_client, body: str, status: int, code: str
) -> None:
    response = await strict_client.post(
        "/v1/embeddings", data=body, headers={"Content-Type": "application/json"}
    )
    assert response.status == status
    error = (await response.json())["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    assert error["message"]
    ok = await strict_client.post("/v1/embeddings", json={"input": "still serving"})
    assert ok.status == 200


@pytest.mark.parametrize(("body", "status", "error_type"), BAD_TEI)
async def test_bad_tei_input_gets_a_4xx_in_tei_shape(
    strict_client, body: str, status: int, error_type: str
) -> None:
    response = await strict_client.post(
        "/embed", data=body, headers={"Content-Type": "application/json"}
    )
    assert response.status == status
    error = await response.json()
    assert set(error) == {"error", "error_type"} and error["error_type"] == error_type
    assert (await strict_client.post("/embed", json={"inputs": "still serving"})).status == 200


async def queued_inputs(client) -> float:
    exposition = await (await client.get("/metrics")).text()
    line = next(row for row in exposition.splitlines() if row.startswith("warmgate_queue_depth "))
    return float(line.split()[1])


async def test_a_full_queue_answers_429_at_once_and_loses_nothing(
    start_server, monkeypatch
) -> None:
    """The batcher's own bound (inputs queued), apart from --max-concurrent-requests: requests
    of many inputs can fill the queue before the in-flight limit is reached. The forward passes
    are held for real (WARMGATE_FAULT_INJECTION's hang) so the queue stays full while the third
    request arrives; it gets a 429 with a JSON error at once, and the queued ones are served."""
    from warmgate_server import faults

    monkeypatch.setenv(faults.ENV, "1")
    client = await start_server(
        "--max-concurrent-requests", "8", "--max-batch-size", "4", "--max-client-batch-size", "16"
    )  # the queue holds max(8 x 4, 2 x 16) = 32 inputs
    held = await client.post("/debug/faults", json={"mode": "hang", "hang_seconds": 120})
    assert held.status == 200
    inputs = [f"sentence number {n} of a request" for n in range(16)]
    first = asyncio.ensure_future(client.post("/v1/embeddings", json={"input": inputs}))
    second = asyncio.ensure_future(client.post("/v1/embeddings", json={"input": inputs}))
    try:
        # Both workers hold a batch of 4; the other 24 inputs wait.
        for _ in range(200):
            if await queued_inputs(client) == 24:
                break
            await asyncio.sleep(0.02)
        assert await queued_inputs(client) == 24
        rejected = await client.post("/v1/embeddings", json={"input": inputs})
        assert rejected.status == 429
        error = (await rejected.json())["error"]
        assert error["code"] == "overloaded" and "queue is full" in error["message"], error
        assert not first.done() and not second.done()
    finally:
        await client.post("/debug/faults", json={"mode": "off"})
    for response in await asyncio.gather(first, second):
        assert response.status == 200
        assert len((await response.json())["data"]) == 16
    assert await queued_inputs(client) == 0
    assert client.server.app[RUNTIME].in_flight == 0
    assert (await client.post("/v1/embeddings", json={"input": inputs})).status == 200


async def test_overload_answers_429_at_once(start_server) -> None:
    client = await start_server("--max-concurrent-requests", "2")
    batch = {"input": ["a sentence that takes a while to embed"] * 4}
    responses = await asyncio.gather(
        *(client.post("/v1/embeddings", json=batch) for _ in range(12))
    )
    statuses = sorted(response.status for response in responses)
    assert set(statuses) == {200, 429}, statuses
    rejected = next(response for response in responses if response.status == 429)
    assert (await rejected.json())["error"]["type"] == "rate_limit_error"
    assert client.server.app[RUNTIME].in_flight == 0
    assert (await client.post("/v1/embeddings", json=batch)).status == 200
