"""The HTTP API against an app of its own per test (create_app with the real model), where
what is checked depends on a fresh app: the reports while warming, exact counts, overload.
Requests that any warm app answers alike are test_requests.py's."""

from __future__ import annotations

import asyncio

import pytest

from warmgate_server.context import RUNTIME
from warmgate_server.source import weights_digest
from warmgate_testkit.process import minilm_path, wait_for_phase


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
        "pid", "model_settings", "download", "forward", "memory", "failure_reason",
    }  # fmt: skip
    # What the warmup measured of memory, every planned shape with its peak.
    memory = report["memory"]
    assert memory["device"] == "cpu" and memory["peak_bytes"] >= memory["loaded_bytes"] > 0
    assert {(s["batch_size"], s["seq_len"]) for s in memory["shapes"]} == {
        (s["batch_size"], s["seq_len"]) for s in report["planned_shapes"]
    }
    # On a CPU: warmgate's packed pass in torch, attention over padded keys, no CUDA graphs.
    linear = report["forward"].pop("linear")  # which kernel this CPU ran faster, measured
    assert report["forward"] == {
        "pass": "packed",
        "backend": "torch",
        "attention": "padded keys",
        "cuda_graphs": {"mode": "off", "reason": "the device is cpu"},
    }
    assert linear["chosen_by"] == "measured" and set(linear["kernels"]) <= {"onednn", "mkl"}
    assert set(linear["measured_ms"]) == {"onednn", "mkl"}
    # The model folder's own sentence-transformers files chose the pooling and normalisation.
    assert report["model_settings"]["pooling"] == "mean"
    assert report["model_settings"]["normalize"] is True
    assert report["model_settings"]["chosen_by"] == {
        "pooling": "1_Pooling/config.json",
        "normalize": "modules.json",
        "prompt": "default (no prompt)",
        "max_input_length": "the largest of --sequence-buckets",
        "task": "modules.json pools token vectors (an embedding model)",
    }
    assert report["model_settings"]["task"] == "embed"
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
    # Smallest first (by tokens; the bigger batch first among equal tokens): each shape's
    # memory peak is predicted from the smaller ones before it runs.
    assert warmed == [(1, 16), (1, 32), (4, 16), (1, 64), (4, 32), (4, 64)]
    assert all(s["steady_ms"] > 0 and s["runs"] >= 2 for s in report["warmed_shapes"])
    # The first shape runs whole passes (the gate times it): its warmup took at least one
    # steady pass. The others run one layer of the packed pass, their steady time scaled to
    # every layer, so it may be longer than the time they took.
    first = report["warmed_shapes"][0]
    assert first["seconds"] >= first["steady_ms"] / 1000.0
    assert report["progress"] == {"done": 6, "total": 6}


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


async def queued_inputs(client) -> float:
    exposition = await (await client.get("/metrics")).text()
    line = next(row for row in exposition.splitlines() if row.startswith("warmgate_queue_depth "))
    return float(line.split()[1])


@pytest.mark.parametrize("path", ["/v1/embeddings", "/embed_all"])
async def test_a_full_queue_answers_429_at_once_and_loses_nothing(start_server, path: str) -> None:
    """The batcher's own bound (inputs queued), apart from --max-concurrent-requests: requests
    of many inputs can fill the queue before the in-flight limit is reached. The forward passes
    are held for real (--fault-injection's hang) so the queue stays full while the third
    request arrives; it gets a 429 with a JSON error at once, and the queued ones are served.
    /embed_all's requests share that queue and its bound like every other."""
    client = await start_server(
        "--fault-injection",
        "--max-concurrent-requests",
        "8",
        "--max-batch-size",
        "4",
        "--max-client-batch-size",
        "16",
    )  # the queue holds max(8 x 4, 2 x 16) = 32 inputs
    openai = path == "/v1/embeddings"
    inputs = [f"sentence number {n} of a request" for n in range(16)]
    body = {"input": inputs} if openai else {"inputs": inputs}
    held = await client.post("/debug/faults", json={"mode": "hang", "hang_seconds": 120})
    assert held.status == 200
    first = asyncio.ensure_future(client.post(path, json=body))
    second = asyncio.ensure_future(client.post(path, json=body))
    try:
        # Both workers hold a batch of 4; the other 24 inputs wait.
        for _ in range(200):
            if await queued_inputs(client) == 24:
                break
            await asyncio.sleep(0.02)
        assert await queued_inputs(client) == 24
        rejected = await client.post(path, json=body)
        assert rejected.status == 429
        error = await rejected.json()
        message = error["error"]["message"] if openai else error["error"]
        assert "queue is full" in message, error
        assert not first.done() and not second.done()
    finally:
        await client.post("/debug/faults", json={"mode": "off"})
    for response in await asyncio.gather(first, second):
        assert response.status == 200
        answer = await response.json()
        assert len(answer["data"] if openai else answer) == 16
    assert await queued_inputs(client) == 0
    assert client.server.app[RUNTIME].in_flight == 0
    assert (await client.post(path, json=body)).status == 200


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
