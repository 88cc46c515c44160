#!/usr/bin/env python3
"""`make bench-scaleout`: decision to capacity, with and without a standby pod, side by side.

Starts its own devcluster (real control plane, a real node: server containers on kubelet),
installs the CRD, runs the operator, and for each model and each pool size (0 and 1 standby
pods) deploys a 1-pod EmbeddingService, sends RATE requests a second through the Service's node
port (a fresh connection each, like many independent clients), runs `kubectl scale --replicas 2`
and measures:

- decision to capacity: from the scale command to the first request answered by a pod that
  was not serving before (the client's view, through kube-proxy);
- the operator's own record: `status.lastScaleOut.seconds` (decision seen to pod serving);
- failed and cold requests over the whole run;
- what the standby pod costs while idle: its CPU and memory from the metrics API
  (metrics-server, kubelet's cgroup figures), after the pool has idled.

Models: MiniLM with the tests' small warmup plan, and MiniLM with a long plan (6 batch sizes x
5 sequence buckets up to 256 tokens: a model that takes much longer to start, as a bigger model
or GPU would). The target: at most 2 s from the decision to the first request served by the
added capacity with a standby pod, whatever the model's start time.

Results: bench/results/scaleout.json and a markdown table on stdout (copied into
docs/benchmarks.md by hand, with the machine it ran on).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import yaml

from warmgate_contract.names import ROLE_LABEL
from warmgate_devcluster import kubeapi
from warmgate_devcluster.cluster import DevCluster
from warmgate_devcluster.loadgen import ConstantRateLoad
from warmgate_devcluster.pytest_plugin import DevClusterHandle, isolated_config, reserve_slot
from warmgate_devcluster.testkit import (
    Kube,
    NamespacedOperator,
    embedding_service,
    install_crd,
    service_url,
    wait_ready,
    wait_until,
)

ROOT = Path(__file__).resolve().parents[2]

MODELS = {
    "minilm-small-plan": {},
    "minilm-long-plan": {
        "batching": {"maxBatchSize": 32, "maxBatchTokens": 8192, "maxWaitMilliseconds": 2},
        "warmup": {"batchSizes": [1, 2, 4, 8, 16, 32], "sequenceBuckets": [16, 32, 64, 128, 256]},
        "probes": {"startupTimeoutSeconds": 600, "periodSeconds": 1},
    },
}


def live_pods(kube: Kube, name: str) -> list[dict]:
    return [p for p in kube.pods(name) if not p["metadata"].get("deletionTimestamp")]


def parse_quantity(value: str) -> float:
    """CPU in cores or memory in bytes from a metrics API quantity."""
    units = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    for suffix, factor in units.items():
        if value.endswith(suffix):
            return float(value[: -len(suffix)]) * factor
    return float(value)


def pod_usage(kube: Kube, pod: str) -> dict | None:
    path = f"/apis/metrics.k8s.io/v1beta1/namespaces/{kube.namespace}/pods/{pod}"
    try:
        found = kubeapi.read(kube.api, path)
    except (kubeapi.ApiError, *kubeapi.UNANSWERED):
        return None
    (container,) = [c for c in found["containers"] if c["name"] == "server"]
    return {
        "cpu_millicores": round(parse_quantity(container["usage"]["cpu"]) * 1000, 1),
        "memory_mib": round(parse_quantity(container["usage"]["memory"]) / 2**20, 1),
    }


def run_scaleout(kube: Kube, name: str, model: str, standby: int, rate: float) -> dict:
    overrides = dict(MODELS[model])
    overrides["resources"] = {"requests": {"cpu": "300m", "memory": "1536Mi"}}
    kube.apply(embedding_service(name, "v1", replicas=1, standbyReplicas=standby, **overrides))
    started = time.monotonic()
    wait_ready(kube, name, "v1", replicas=1 + standby, timeout=900)
    ready_seconds = time.monotonic() - started
    if standby:
        wait_until(
            lambda: (
                ((kube.get("embeddingservice", name) or {}).get("status") or {}).get(
                    "standbyReplicas"
                )
                == standby
            ),
            120,
            "the pool",
        )
    before = {p["metadata"]["name"] for p in live_pods(kube, name)}
    serving_before = {
        p["metadata"]["name"]
        for p in live_pods(kube, name)
        if not standby or (p["metadata"].get("labels") or {}).get(ROLE_LABEL) == "serving"
    }
    idle_cost = None
    if standby:
        time.sleep(30)  # the pool idles; metrics-server's window is 15-30 s
        (spare,) = sorted(before - serving_before)
        idle_cost = pod_usage(kube, spare)
    with ConstantRateLoad(
        service_url(kube, name), rate=rate, networks=kube.devcluster.networks
    ) as load:
        wait_until(lambda: load.elapsed() >= 5, 30, "5 s of steady traffic", every=0.1)
        decided = load.elapsed()
        kube.run("scale", f"embeddingservice/{name}", "--replicas=2")

        def first_new() -> float | None:
            served = [
                s.started
                for s in list(load.report.samples)
                if s.ok and s.pod and s.pod not in serving_before and s.started >= decided
            ]
            return min(served) if served else None

        first = wait_until(first_new, 900, "a request answered by the added capacity", every=0.1)
        end = load.elapsed()
        wait_until(lambda: load.elapsed() >= end + 3, 30, "3 s more", every=0.1)

    def recorded() -> dict | None:
        emb = kube.get("embeddingservice", name) or {}
        return emb if (emb.get("status") or {}).get("lastScaleOut") else None

    emb = wait_until(recorded, 600, "status.lastScaleOut")
    report = load.report
    kube.run("delete", "embeddingservice", name, "--wait=true")
    wait_until(lambda: not kube.pods(name), 180, f"{name}'s pods to be gone")
    return {
        "model": model,
        "standby_replicas": standby,
        "rate_per_s": rate,
        "start_to_ready_seconds": round(ready_seconds, 1),
        "decision_to_first_request_seconds": round(first - decided, 2),
        "operator_scale_out": emb["status"]["lastScaleOut"],
        "requests": len(report.samples),
        "failed": len(report.failed),
        "cold": len(report.cold),
        "standby_idle": idle_cost,
    }


def markdown(results: list[dict]) -> str:
    lines = [
        "| model | standby pods | start to Ready (s) | decision to first request on the added "
        "capacity (s) | operator's lastScaleOut (s) | requests | failed | cold | standby pod "
        "idle: CPU, memory |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        idle = r["standby_idle"]
        cost = f"{idle['cpu_millicores']}m, {idle['memory_mib']} MiB" if idle else "-"
        lines.append(
            f"| {r['model']} | {r['standby_replicas']} | {r['start_to_ready_seconds']} | "
            f"{r['decision_to_first_request_seconds']} | {r['operator_scale_out']['seconds']} | "
            f"{r['requests']} | {r['failed']} | {r['cold']} | {cost} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=10.0)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-scaleout-"))
    cluster = DevCluster(isolated_config(work / "devcluster", reserve_slot()))
    operator = None
    results: list[dict] = []
    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt))
    try:
        cluster.up(log=lambda *_: None)
        handle = DevClusterHandle.of(cluster)
        install_crd(handle)
        namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "bench"}}
        kubeapi.call(handle.api, "POST", kubeapi.resource_path("v1", "namespaces"), namespace)
        kube = Kube(handle, "bench")
        operator = NamespacedOperator(handle, "bench", work / "operator.log")
        operator.start()
        for model in args.models.split(","):
            for standby in (0, 1):  # side by side, one after the other on the same node
                name = f"{model.split('-')[-2]}-{standby}"
                results.append(run_scaleout(kube, name, model, standby, args.rate))
                print(json.dumps(results[-1]), flush=True)
    finally:
        if operator is not None:
            operator.stop()
        cluster.down(log=lambda *_: None)
        signal.signal(signal.SIGTERM, previous)
    machine = {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
    }
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "scaleout.json").write_text(json.dumps({"machine": machine, "runs": results}, indent=2))
    print(markdown(results))
    print(yaml.safe_dump({"machine": machine}))
    shutil.rmtree(work, ignore_errors=True)
    return 1 if any(r["failed"] or r["cold"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
