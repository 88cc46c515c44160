"""Real `python -m warmgate_server` processes with the real model: the whole lifecycle."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from warmgate_testkit.process import SERVER_ROOT, ServerProcess

pytestmark = pytest.mark.slow


def in_flight(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    return float(re.search(r"^warmgate_requests_in_flight (\S+)$", text, re.MULTILINE).group(1))


def test_lifecycle_probes_cold_hits_and_sigterm_drain(minilm_dir: Path) -> None:
    args = [
        "--model", str(minilm_dir), "--model-revision", "r1",
        "--sequence-buckets", "16,32,64,128", "--warmup-batch-sizes", "1,8",
        "--max-batch-size", "8", "--drain-seconds", "60",
    ]  # fmt: skip
    with ServerProcess(args, env={"POD_NAME": "pod-a"}) as server:
        server.wait_for_port(120)
        phases: list[str] = []
        healthz_seconds: list[float] = []
        refused_early = None
        deadline = time.monotonic() + 300
        while True:
            started = time.monotonic()
            status, _body = server.get_json("/healthz", timeout=5.0)
            assert status == 200
            healthz_seconds.append(time.monotonic() - started)
            status, report = server.get_json("/ready", timeout=5.0)
            if not phases or phases[-1] != report["phase"]:
                phases.append(report["phase"])
            if report["phase"] == "ready":
                assert status == 200
                break
            assert status == 503 and report["phase"] in ("loading", "warming"), report
            if refused_early is None:
                request = urllib.request.Request(
                    server.url + "/v1/embeddings", data=b'{"input": "hi"}', method="POST"
                )
                try:
                    urllib.request.urlopen(request, timeout=5)
                except urllib.error.HTTPError as error:
                    refused_early = error.code
            assert time.monotonic() < deadline, phases
            time.sleep(0.05)
        assert phases == ["loading", "warming", "ready"]
        # Liveness answers within the kubelet's 1 s probe timeout while the model loads and
        # warms (the 95th percentile: a shared CI machine can stall any process once).
        healthz_seconds.sort()
        assert healthz_seconds[int(0.95 * (len(healthz_seconds) - 1))] < 1.0, healthz_seconds
        assert refused_early == 503  # no request ever lands on a cold model
        planned = report["planned_shapes"]
        assert len(planned) == 8 and len(report["warmed_shapes"]) == 8
        assert report["warmup_seconds"] > 0 and report["model"]["revision"] == "r1"
        # Warmup went through the HTTP layer too (its own requests to its own port), and none
        # of that shows as traffic: no request counted, no served shape in the profile.
        assert "HTTP path warm: 3 requests through http://127.0.0.1:" in server.log()
        assert "HTTP warmup" not in server.log()  # no request of it failed
        status, profile = server.get_json("/warmup/profile")
        assert status == 200 and profile == {"shapes": []}
        # A request aiohttp cannot parse (two Content-Lengths) is answered 400 and logged as one
        # WARNING line naming the fault, not as an ERROR with aiohttp's parser traceback.
        with socket.create_connection((server.host, server.port), timeout=5) as sock:
            sock.sendall(
                b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n"
                b"Content-Length: 2\r\n\r\nab"
            )
            assert re.match(rb"HTTP/1\.[01] 400 ", sock.recv(64))
        line = "WARNING aiohttp.server: malformed request from 127.0.0.1 answered 400: Duplicate"
        deadline = time.monotonic() + 10
        while line not in server.log():
            assert time.monotonic() < deadline, server.log()[-2000:]
            time.sleep(0.05)
        assert "Error handling request" not in server.log()
        with urllib.request.urlopen(server.url + "/metrics", timeout=5) as response:
            exposition = response.read().decode()
        # (The 503 answered to this test's request while loading is counted: it was traffic.)
        assert 'warmgate_http_requests_total{endpoint="/v1/embeddings",status="200"}' not in (
            exposition
        )
        assert 'endpoint="/embed"' not in exposition

        async def traffic() -> tuple[list[tuple[int, str]], tuple[int, str], list[int]]:
            async with aiohttp.ClientSession(server.url) as session:
                cold_flags = []
                for tokens in (10, 25, 50, 100):
                    for count in (1, 8):
                        payload = {"input": ["hello " * tokens] * count}
                        async with session.post("/v1/embeddings", json=payload) as response:
                            assert response.headers["X-Warmgate-Pod"] == "pod-a"
                            assert response.headers["X-Warmgate-Revision"] == "r1"
                            cold_flags.append(
                                (response.status, response.headers["X-Warmgate-Cold"])
                            )

                async def long_request() -> int:
                    payload = {"input": ["hello " * 100] * 8}
                    async with session.post("/v1/embeddings", json=payload) as response:
                        await response.read()
                        return response.status

                pending = [asyncio.create_task(long_request()) for _ in range(8)]
                deadline = time.monotonic() + 60
                while await asyncio.to_thread(in_flight, server.url) < 4:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.01)
                server.terminate()
                async with session.get("/ready") as response:
                    draining = (response.status, (await response.json())["phase"])
                statuses = await asyncio.gather(*pending)
                return cold_flags, draining, statuses

        cold_flags, draining, statuses = asyncio.run(traffic())
        assert cold_flags == [(200, "0")] * 8  # every planned shape is warm after /ready
        assert draining == (503, "draining")
        assert statuses == [200] * 8  # in-flight and queued requests finish
        assert server.wait(timeout=60) == 0
        assert "drained cleanly" in server.log()


def test_unknown_model_fails_fast_with_a_clear_error(tmp_path: Path) -> None:
    started = time.monotonic()
    termination_log = tmp_path / "termination-log"
    termination_log.write_text("")
    env = {"HF_HOME": str(tmp_path), "WARMGATE_TERMINATION_LOG": str(termination_log)}
    with ServerProcess(["--model", "no-such-org/no-such-model"], env=env) as server:
        code = server.wait(timeout=120)
    assert code != 0 and time.monotonic() - started < 120
    assert "not in the Hugging Face cache" in server.log()
    assert "no-such-org/no-such-model" in termination_log.read_text()  # kubectl describe shows it


def test_sigterm_while_loading_exits_zero(minilm_dir: Path) -> None:
    with ServerProcess(["--model", str(minilm_dir)]) as server:
        server.wait_for_port(120)
        status, report = server.get_json("/ready")
        assert status == 503 and report["phase"] == "loading"
        server.terminate()
        assert server.wait(timeout=30) == 0


def test_model_id_resolves_from_the_offline_hugging_face_cache(
    minilm_dir: Path, tmp_path: Path
) -> None:
    """`--model org/name` finds the snapshot that refs/main names under $HF_HOME/hub, offline,
    and names its commit."""
    repo = tmp_path / "hub" / "models--sentence-transformers--all-MiniLM-L6-v2"
    snapshot = repo / "snapshots" / "0123456789abcdef"
    snapshot.mkdir(parents=True)
    for item in minilm_dir.iterdir():
        (snapshot / item.name).symlink_to(item)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123456789abcdef")
    script = (
        "from warmgate_server.source import locate; "
        "s = locate('sentence-transformers/all-MiniLM-L6-v2', 'main'); "
        "print(s.folder); print(s.commit)"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        env={
            **os.environ,
            "HF_HOME": str(tmp_path),
            "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": os.pathsep.join((str(SERVER_ROOT), str(SERVER_ROOT.parent / "contract"))),
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    folder, commit = result.stdout.split()
    assert Path(folder) == snapshot and commit == "0123456789abcdef"


def test_onnxruntime_backend_exports_during_warmup_and_serves_warm(
    minilm_dir: Path, tmp_path: Path
) -> None:
    """--backend onnxruntime: the export and ONNX Runtime's sessions are the warmup's first
    step (counted in warmup_seconds, before /ready), every planned shape runs through them
    before /ready, so each first request of a planned shape is warm, and the vectors are the
    torch pass's. With --compile-cache the export is stored, and a restart opens it instead
    of exporting again (the same vectors, still warm)."""
    plan = ["--sequence-buckets", "16,64", "--warmup-batch-sizes", "1,4", "--max-batch-size", "4"]
    texts = ["hello world", "샘플 문장입니다", "a longer sentence " * 8]
    cache = tmp_path / "compiled"
    answers = {}
    for run, backend, expect_cache in (
        ("exported", "onnxruntime", "miss"),
        ("restarted", "onnxruntime", "hit"),
        ("torch", "torch", None),
    ):
        args = ["--model", str(minilm_dir), *plan, "--backend", backend]
        if expect_cache:
            args += ["--compile-cache", str(cache)]
        with ServerProcess(args) as server:
            report = server.wait_ready(300)
            forward = report["forward"]
            assert forward["backend"] == backend
            if backend == "onnxruntime":
                assert forward["pass"] == "padded"
                onnx = forward["onnxruntime"]
                assert 0 < onnx["export_seconds"] < report["warmup_seconds"], report
                assert onnx["cache"] == expect_cache, onnx
                entry = Path(onnx["cache_entry"])
                assert entry.parent == cache and (entry / "model.onnx").is_file(), onnx
                exported = "exported BertModel to ONNX" in server.log()
                assert exported == (expect_cache == "miss"), server.log()[-2000:]
            cold = []
            for batch in ([texts[0]], texts, [texts[2]] * 4):
                request = urllib.request.Request(
                    server.url + "/v1/embeddings",
                    data=json.dumps({"input": batch}).encode(),
                    headers={"Content-Type": "application/json"},
                )
                with urllib.request.urlopen(request, timeout=30) as response:
                    cold.append(response.headers["X-Warmgate-Cold"])
                    answers.setdefault(run, []).append(json.load(response)["data"])
            assert cold == ["0", "0", "0"], (run, cold)
    assert [path.name for path in cache.iterdir()] == [entry.name]  # no temporary folder left
    for run in ("exported", "restarted"):
        for got, want in zip(answers[run], answers["torch"], strict=True):
            for a, b in zip(got, want, strict=True):
                u, v = np.array(a["embedding"]), np.array(b["embedding"])
                assert u @ v / (np.linalg.norm(u) * np.linalg.norm(v)) >= 0.9999
    assert answers["restarted"] == answers["exported"]
