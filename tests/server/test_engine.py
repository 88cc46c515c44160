"""Cold hits are measured: zero after warmup for planned shapes, visible without warmup."""

from __future__ import annotations

import re

from warmgate_testkit.process import wait_for_phase

# "hello " * n is n + 2 tokens with [CLS] and [SEP]: these land in buckets 16, 32 and 64.
BUCKET_TEXTS = {16: "hello " * 10, 32: "hello " * 25, 64: "hello " * 50}


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, name
    return float(match.group(1))


async def test_no_cold_hit_for_any_planned_shape_after_ready(start_server) -> None:
    client = await start_server("--warmup")
    for seq_len, text in BUCKET_TEXTS.items():
        for count in (1, 3):  # batch 1, and 3 padded to the planned 4
            response = await client.post("/v1/embeddings", json={"input": [text] * count})
            assert response.status == 200
            assert response.headers["X-Warmgate-Cold"] == "0", (count, seq_len)
    metrics = await (await client.get("/metrics")).text()
    assert metric(metrics, "warmgate_cold_hits_total") == 0
    assert metric(metrics, 'warmgate_batches_total{phase="warm"}') == 6
    profile = await (await client.get("/warmup/profile")).json()
    served = {(s["batch_size"], s["seq_len"]) for s in profile["shapes"]}
    assert served == {(b, s) for b in (1, 4) for s in (16, 32, 64)}


async def test_without_warmup_the_first_request_of_a_shape_is_cold(start_server) -> None:
    client = await start_server("--no-warmup")
    report = await (await client.get("/ready")).json()
    assert report["warmed_shapes"] == [] and report["progress"] == {"done": 0, "total": 6}
    first = await client.post("/embed", json={"inputs": BUCKET_TEXTS[32]})
    second = await client.post("/embed", json={"inputs": BUCKET_TEXTS[32]})
    assert (first.headers["X-Warmgate-Cold"], second.headers["X-Warmgate-Cold"]) == ("1", "0")
    metrics = await (await client.get("/metrics")).text()
    assert metric(metrics, "warmgate_cold_hits_total") == 1
    cold = 'warmgate_embedding_request_duration_seconds_count{endpoint="/embed",phase="cold"}'
    assert metric(metrics, cold) == 1
    assert (
        metric(metrics, 'warmgate_inference_duration_seconds_count{phase="cold",shape="1x32"}') == 1
    )


async def test_profile_file_shapes_are_warmed_too(start_server, tmp_path) -> None:
    profile = tmp_path / "profile.json"
    profile.write_text('{"shapes": [{"batch_size": 2, "seq_len": 32, "count": 9}]}')
    client = await start_server("--warmup", "--warmup-profile", str(profile))
    report = await (await client.get("/ready")).json()
    assert {"batch_size": 2, "seq_len": 32} in report["planned_shapes"]
    # two inputs now pad to the profile's batch size 2 rather than 4, and it is warm
    response = await client.post("/embed", json={"inputs": [BUCKET_TEXTS[32]] * 2})
    assert response.headers["X-Warmgate-Cold"] == "0"
    served = await (await client.get("/warmup/profile")).json()
    assert served["shapes"] == [{"batch_size": 2, "seq_len": 32, "count": 1}]


async def test_the_engine_is_built_off_the_event_loop(start_server, monkeypatch) -> None:
    """Building the Engine reads the model's files and may load tiktoken (a third of a second):
    it runs in the model thread, and /healthz and /ready answer meanwhile. The build is held
    for real (the token-id loader waits) until the probes have answered."""
    import asyncio
    import threading

    from warmgate_server.openai_ids import OpenAITokenIds

    loop_thread = threading.get_ident()  # the app runs on the test's event loop
    entered, release = threading.Event(), threading.Event()
    built_in: list[int] = []
    original = OpenAITokenIds.load.__func__

    def held(cls, kind):
        built_in.append(threading.get_ident())
        entered.set()
        release.wait(10)
        return original(cls, kind)

    monkeypatch.setattr(OpenAITokenIds, "load", classmethod(held))
    client = await start_server(wait=False)
    try:
        assert await asyncio.to_thread(entered.wait, 10)
        healthz, ready = await client.get("/healthz"), await client.get("/ready")
        assert healthz.status == 200
        assert ready.status == 503 and (await ready.json())["phase"] == "loading"
    finally:
        release.set()
    assert built_in and built_in[0] != loop_thread
    report = await wait_for_phase(client, {"ready", "failed"})
    assert report["phase"] == "ready", report


async def test_shapes_after_the_first_warm_with_one_layer_and_nothing_after_ready_is_cold(
    start_server, caplog
) -> None:
    """On a CPU every shape after the first (which the warm gate times: whole passes) warms
    with the packed pass's first layer only (all layers run the same kernels on the same
    shapes): the log says so, its steady latency is scaled to all six layers, and every
    planned shape is still warm after /ready."""
    import logging

    with caplog.at_level(logging.INFO, logger="warmgate_server.warming"):
        client = await start_server("--warmup")
    shortened = [r.getMessage() for r in caplog.records if "1 layer a run" in r.getMessage()]
    assert len(shortened) == 5, [r.getMessage() for r in caplog.records]  # all but the first
    report = await (await client.get("/ready")).json()
    steady = {(s["batch_size"], s["seq_len"]): s["steady_ms"] for s in report["warmed_shapes"]}
    assert len(steady) == 6 and all(ms > 0 for ms in steady.values())
    for seq_len, text in BUCKET_TEXTS.items():
        for count in (1, 3):
            response = await client.post("/v1/embeddings", json={"input": [text] * count})
            assert response.status == 200
            assert response.headers["X-Warmgate-Cold"] == "0", (count, seq_len)
