"""A GPU out of memory, on the CPU: the forward pass raises torch.cuda.OutOfMemoryError, what a
CUDA allocation past the device's memory raises and a CPU never does, made to happen for real in
the model thread by the test-only fault injector (faults.py, mode "oom", at one shape). While
warming, --memory-policy refuse fails the start naming the shape and stays up, and fit serves
the shapes warmed before it and never forms that one; while serving, the request gets the model
fault answer and the next one is served. The app is the real one (create_app on the shared
MiniLM); the injector is armed before it starts, so the warmup meets the fault at its shape."""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.test_utils import TestClient
from support.server import QUICK_SETTLE, make_config

from warmgate_contract.names import REASON_MEMORY_EXCEEDED
from warmgate_contract.shapes import Shape
from warmgate_server.app import create_app
from warmgate_server.context import RUNTIME
from warmgate_testkit.process import wait_for_phase

# SMALL_PLAN warms 1x16, 1x32, 4x16 and 1x64 (by tokens) before 4x32, then 4x64: every bucket
# keeps a shape when the plan is cut at 4x32.
OUT_OF_MEMORY_AT = Shape(4, 32)
FIT = {(1, 16), (1, 32), (4, 16), (1, 64)}
CUT = {(4, 32), (4, 64)}


def shapes(items: list[dict]) -> set[tuple[int, int]]:
    return {(item["batch_size"], item["seq_len"]) for item in items}


async def start_out_of_memory_at(
    aiohttp_client, monkeypatch, minilm_dir, loaded_minilm, *args: str
) -> tuple[TestClient, dict]:
    """The app, its injector armed to run out of GPU memory at OUT_OF_MEMORY_AT from the first
    pass on; its /ready report once the start has ended."""
    config = make_config(minilm_dir, "--fault-injection", *args)
    app: web.Application = create_app(config, preloaded=loaded_minilm, settle_rule=QUICK_SETTLE)
    injector = app[RUNTIME].faults
    assert injector is not None
    injector.set("oom", shape=OUT_OF_MEMORY_AT)
    client = await aiohttp_client(app)
    return client, await wait_for_phase(client, {"ready", "failed"})


async def test_out_of_memory_while_warming_with_refuse_fails_naming_the_shape_and_stays_up(
    aiohttp_client, monkeypatch, minilm_dir, loaded_minilm
) -> None:
    """The failure is the memory one (WarmupMemoryExceeded, not restartable: a restart would
    run out of memory again), naming the shape and the way out, and the process stays up,
    answering its probes. It was an AttributeError in ModelRunner.release_memory, a
    restartable failure: the process exited, and its container restarted into the same
    out-of-memory."""
    client, report = await start_out_of_memory_at(
        aiohttp_client, monkeypatch, minilm_dir, loaded_minilm
    )
    assert report["phase"] == "failed", report
    assert report["failure_reason"] == REASON_MEMORY_EXCEEDED, report["error"]
    error = report["error"]
    assert "shape 4x32 ran out of device memory" in error and "memoryPolicy: fit" in error
    assert shapes(report["warmed_shapes"]) == FIT
    lifecycle = client.server.app[RUNTIME].lifecycle
    assert not lifecycle.failed_event.is_set()  # what __main__ waits for to exit 1
    await asyncio.sleep(0.5)
    assert (await client.get("/healthz")).status == 200
    assert (await client.get("/started")).status == 200
    assert (await client.get("/ready")).status == 503


async def test_out_of_memory_while_warming_with_fit_serves_the_shapes_before_it_and_no_other(
    aiohttp_client, monkeypatch, minilm_dir, loaded_minilm
) -> None:
    """The plan is cut at the shape that ran out of memory; the server turns ready with the
    shapes warmed before it. The injector stays armed at that shape, so a batch of it would
    fail: requests whose inputs would have made it (4 of bucket 32) and the next one up (4
    of bucket 64) are all served, by the shapes that fit."""
    client, report = await start_out_of_memory_at(
        aiohttp_client, monkeypatch, minilm_dir, loaded_minilm, "--memory-policy", "fit"
    )
    assert report["phase"] == "ready", report["error"]
    cut = report["memory"]["cut"]
    assert cut is not None and shapes(cut["shapes"]) == CUT, report["memory"]
    assert "shape 4x32 ran out of device memory" in cut["reason"]
    assert shapes(report["planned_shapes"]) == shapes(report["warmed_shapes"]) == FIT
    injector = client.server.app[RUNTIME].faults
    assert injector is not None and injector.mode == "oom"
    faults_while_warming = injector.injected
    assert faults_while_warming >= 1
    words = {32: "warm gate " * 10, 64: "warm gate " * 25}  # 22 and 52 tokens
    for bucket, text in words.items():
        for path, body in (
            ("/v1/embeddings", {"input": [f"{n} {text}" for n in range(4)]}),
            ("/embed", {"inputs": [f"{n} {text}" for n in range(4)]}),
        ):
            responses = await asyncio.gather(*(client.post(path, json=body) for _ in range(3)))
            for response in responses:
                assert response.status == 200, (bucket, await response.text())
    served = shapes((await (await client.get("/warmup/profile")).json())["shapes"])
    assert served and served <= FIT and {(1, 32), (1, 64)} <= served, served
    assert injector.injected == faults_while_warming  # no pass of 4x32 since


async def test_out_of_memory_while_serving_fails_that_request_and_the_next_is_served(
    aiohttp_client, monkeypatch, minilm_dir, loaded_minilm
) -> None:
    """Once ready, a pass that runs out of GPU memory fails its requests with the model fault
    answer (503, the cause in the message) in both APIs and counts as a fault; the passes after
    it are served, and the server stays ready."""
    app = create_app(
        make_config(minilm_dir, "--fault-injection"),
        preloaded=loaded_minilm,
        settle_rule=QUICK_SETTLE,
    )
    client = await aiohttp_client(app)
    assert (await wait_for_phase(client, {"ready", "failed"}))["phase"] == "ready"
    armed = await client.post("/debug/faults", json={"mode": "oom", "count": 2})
    assert armed.status == 200 and (await armed.json())["mode"] == "oom"

    response = await client.post("/v1/embeddings", json={"input": "hello"})
    body = await response.json()
    assert response.status == 503 and body["error"]["code"] == "model_fault", body
    assert "OutOfMemoryError" in body["error"]["message"]
    assert "CUDA out of memory" in body["error"]["message"]
    response = await client.post("/embed", json={"inputs": "hello"})
    body = await response.json()
    assert response.status == 503 and body["error_type"] == "Backend", body
    assert "CUDA out of memory" in body["error"]

    response = await client.post("/v1/embeddings", json={"input": "hello"})
    assert response.status == 200
    assert len((await response.json())["data"][0]["embedding"]) == 384
    assert (await client.get("/ready")).status == 200  # 2 faults, below --fault-threshold 3
    assert (await client.get("/healthz")).status == 200
    metrics = await (await client.get("/metrics")).text()
    assert 'warmgate_model_faults_total{kind="raised"} 2.0' in metrics
