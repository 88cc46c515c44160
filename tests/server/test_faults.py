"""A sick server leaves the rotation: a real server process whose forward pass is made to fail
for real (WARMGATE_FAULT_INJECTION=1 and POST /debug/faults wrap the model's forward pass in the
model thread), seen from outside as kubelet and clients see it."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from warmgate_testkit.process import ServerProcess

BASE = [
    "--device", "cpu", "--sequence-buckets", "16,32", "--warmup-batch-sizes", "1,4",
    "--max-batch-size", "4", "--model-workers", "1",
]  # fmt: skip
ENV = {"WARMGATE_FAULT_INJECTION": "1"}


def post(server: ServerProcess, path: str, body: object) -> tuple[int, dict, float]:
    started = time.monotonic()
    request = urllib.request.Request(
        server.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read()), time.monotonic() - started
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), time.monotonic() - started


def until(check: Callable[[], object], within: float, what: str) -> object:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"not within {within}s: {what}")


def faults(server: ServerProcess, **body: object) -> None:
    status, state, _ = post(server, "/debug/faults", body)
    assert status == 200 and state["mode"] == body["mode"], state


def test_failing_forward_passes_take_ready_then_liveness_and_recovery_brings_both_back(
    minilm_dir: Path,
) -> None:
    args = ["--model", str(minilm_dir), *BASE, "--fault-threshold", "2"]
    args += ["--fault-restart-seconds", "3"]
    with ServerProcess(args, env=ENV) as server:
        server.wait_ready(300)
        faults(server, mode="raise")
        # A client is told to go elsewhere, with the cause, not a bare 500; /embed_all's
        # forward passes fail and count like every other's.
        status, body, _ = post(server, "/v1/embeddings", {"input": "hello"})
        assert status == 503 and body["error"]["code"] == "model_fault", body
        assert "illegal memory access" in body["error"]["message"]
        status, body, _ = post(server, "/embed_all", {"inputs": "hello"})
        assert status == 503 and body["error_type"] == "Backend", body
        assert "illegal memory access" in body["error"]
        status, report = server.get_json("/ready")
        assert status == 503 and report["phase"] == "unhealthy", report
        assert "2 forward passes in a row" in report["error"]
        assert server.get_json("/healthz")[0] == 200  # not yet: a restart is the last resort
        started = time.monotonic()
        until(lambda: server.get_json("/healthz")[0] == 503, 15, "/healthz 503")
        assert time.monotonic() - started < 10
        status, health = server.get_json("/healthz")
        assert health["status"] == "unhealthy" and "illegal memory access" in health["error"]
        with urllib.request.urlopen(server.url + "/metrics", timeout=5) as response:
            exposition = response.read().decode()
        # The health probe kept trying (one a second) and kept failing.
        assert 'warmgate_model_faults_total{kind="raised"}' in exposition

        faults(server, mode="off")  # the device recovers: the probe finds out on its own
        until(lambda: server.get_json("/ready")[0] == 200, 10, "/ready 200 again")
        assert server.get_json("/healthz")[0] == 200
        status, body, _ = post(server, "/v1/embeddings", {"input": "hello"})
        assert status == 200 and len(body["data"][0]["embedding"]) == 384
        assert "health probe succeeded" in server.log()


def test_a_hung_forward_pass_answers_504_and_a_stuck_queue_times_out(minilm_dir: Path) -> None:
    args = ["--model", str(minilm_dir), *BASE, "--fault-threshold", "1"]
    args += ["--forward-timeout", "1", "--request-timeout", "3"]
    with ServerProcess(args, env=ENV) as server:
        server.wait_ready(300)
        faults(server, mode="hang", hang_seconds=60)
        status, body, waited = post(server, "/embed", {"inputs": "hello"})
        assert status == 504 and body["error_type"] == "Backend", body
        assert "still running after 1s" in body["error"] and 0.9 <= waited < 10
        assert server.get_json("/ready")[1]["phase"] == "unhealthy"
        # The one worker is still inside the hung pass: the next request waits in the queue
        # until its own deadline, then gets 504 instead of waiting forever.
        status, body, waited = post(server, "/v1/embeddings", {"input": "hello"})
        assert status == 504 and body["error"]["code"] == "timeout", body
        assert 2.9 <= waited < 15
        faults(server, mode="off")  # the hung pass returns; the probe succeeds
        until(lambda: server.get_json("/ready")[0] == 200, 10, "/ready 200 again")
        status, body, _ = post(server, "/v1/embeddings", {"input": "hello"})
        assert status == 200


def test_no_fault_route_without_the_variable(minilm_dir: Path) -> None:
    with ServerProcess(["--model", str(minilm_dir), *BASE]) as server:
        server.wait_for_port(120)
        with pytest.raises(urllib.error.HTTPError) as raised:
            urllib.request.urlopen(server.url + "/debug/faults", timeout=5)
        assert raised.value.code in (404, 405)
