"""Warm gate benchmark at scale: a 200-replica gated rollout among 10,000 unrelated pods.

Starts a devcluster (or uses --kubeconfig), installs the CRD and runs the operator as a process
watching one namespace, which also holds `--unrelated` pods of another workload. Then one
EmbeddingService with `--replicas` pods rolls out, and for each pod the benchmark measures the
time from its containers becoming ready to its `warmgate.dev/warmed` condition turning True.
It reports the operator's peak RSS, its API requests per gated pod, and that latency at p50 and
p99. Targets (issue 14): RSS under the chart's 256 MiB limit with a margin (200 MiB), gate
latency p99 under 2 s.

What is not real here, because two cores cannot run these pods: no pod runs. The unrelated pods
carry a scheduling gate (the scheduler leaves them alone); the EmbeddingService's pods select a
node label no node has (they stay Pending). The benchmark writes what kubelet would: each gated
pod's status (running container, ContainersReady, pod IP 127.0.0.1), a batch at a time; and
one local process on the server port of 127.0.0.1 answers every pod's `GET /ready` with the
report a warm server of that template gives. The operator, the apiserver, the watches and the
gate's writes are the real ones. The benchmark talks to the API through the Kubernetes Python
client, as the operator does.

    python bench/operator/bench_gate.py [--unrelated 10000] [--replicas 200] [--rate 40]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from bench_operator import (
    FIELD_MANAGER,
    delete_namespace,
    fresh_namespace,
    install_crd,
    peak_rss_mib,
    read_stats,
    run_and_report,
)
from kubernetes import client as k8s
from kubernetes import watch
from kubernetes.client import ApiClient

from warmgate_contract.names import (
    API_VERSION,
    KIND,
    PLURAL,
    SERVER_CONTAINER,
    SERVER_PORT,
    SERVICE_LABEL,
    WARMED_CONDITION,
)
from warmgate_contract.report import READY, ReadyReport, WarmedShape
from warmgate_devcluster import kubeapi
from warmgate_devcluster.testkit import UNMAPPED_IMAGE

ROOT = Path(__file__).resolve().parents[2]
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
NAMESPACE = "bench-gate"
SERVICE = "gated"
TARGETS = {"peak_rss_mib": 200.0, "gate_p99_seconds": 2.0}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--unrelated", type=int, default=10_000, help="pods of another workload")
    parser.add_argument("--replicas", type=int, default=200, help="gated pods to roll out")
    parser.add_argument("--rate", type=float, default=40.0, help="pods made ready per second")
    parser.add_argument("--kubeconfig", help="use this cluster instead of starting a devcluster")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--results-dir", type=Path, default=ROOT / "bench" / "results")
    return parser.parse_args()


# ----------------------------------------------------------------- the pods' /ready answers
class Reports:
    """One local process standing in for every gated pod's server: the /ready report a warm
    server of the pods' template gives (its plan, read from a pod's flags by the operator's
    own code, all warmed)."""

    def __init__(self) -> None:
        self.body = b"{}"
        self.served = 0

    def prepare(self, pod: dict[str, Any]) -> None:
        from warmgate_operator import gate

        expected = gate.expectation_for(pod)
        assert expected is not None, "the gated pod's flags do not parse"
        shapes = tuple(sorted(expected.required_shapes))
        report = ReadyReport(
            phase=READY,
            model_id=expected.model_id,
            revision=expected.revision,
            served_name=expected.model_id.rsplit("/", 1)[-1],
            device="cpu",
            dtype="float32",
            planned=shapes,
            warmed=tuple(WarmedShape(shape, 2.0, 3) for shape in shapes),
            warmup_seconds=4.0,
            pid=1,
        )
        self.body = json.dumps(report.to_json()).encode()

    def serve(self) -> ThreadingHTTPServer:
        reports = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                reports.served += 1
                body = reports.body if self.path == "/ready" else b'{"shapes": []}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                return

        server = ThreadingHTTPServer(("127.0.0.1", SERVER_PORT), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server


# ----------------------------------------------------------------- objects
def unrelated_pod(index: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"other-{index:05d}", "labels": {"app": "other-workload"}},
        "spec": {
            "schedulingGates": [{"name": "bench.warmgate.dev/never"}],
            "containers": [{"name": "app", "image": UNMAPPED_IMAGE}],
        },
    }


def embedding_service(replicas: int) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": SERVICE, "namespace": NAMESPACE},
        "spec": {
            "model": {"id": "sentence-transformers/all-MiniLM-L6-v2"},
            "image": UNMAPPED_IMAGE,
            "replicas": replicas,
            "warmup": {"batchSizes": [1, 8], "sequenceBuckets": [32, 64, 128]},
            # No node has this label: the pods stay Pending, the benchmark plays kubelet.
            "nodeSelector": {"bench.warmgate.dev/no-such-node": "true"},
            "disruptionBudget": {"enabled": False},
        },
    }


def running_status(now: str) -> dict[str, Any]:
    """What kubelet writes once the server container runs and its readiness probe passed."""
    return {
        "status": {
            "phase": "Running",
            "podIP": "127.0.0.1",
            "podIPs": [{"ip": "127.0.0.1"}],
            "startTime": now,
            "conditions": [
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
                {"type": "Initialized", "status": "True", "lastTransitionTime": now},
                {"type": "ContainersReady", "status": "True", "lastTransitionTime": now},
            ],
            "containerStatuses": [
                {
                    "name": SERVER_CONTAINER,
                    "ready": True,
                    "started": True,
                    "restartCount": 0,
                    "image": UNMAPPED_IMAGE,
                    "imageID": "",
                    "state": {"running": {"startedAt": now}},
                }
            ],
        }
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


# ----------------------------------------------------------------- the run
def run(args: argparse.Namespace, kubeconfig: str, api: ApiClient, work: Path) -> dict[str, Any]:
    env = dict(os.environ, KUBECONFIG=kubeconfig)
    install_crd(api)
    fresh_namespace(api, NAMESPACE, 300)
    pods_path = kubeapi.resource_path("v1", "pods", NAMESPACE)
    selector = f"{SERVICE_LABEL}={SERVICE}"

    print(f"creating {args.unrelated} unrelated pods ...", flush=True)
    started = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        list(
            pool.map(
                lambda i: kubeapi.call(api, "POST", pods_path, unrelated_pod(i)),
                range(args.unrelated),
            )
        )
    unrelated_seconds = time.monotonic() - started

    reports = Reports()
    server = reports.serve()
    stats_file = work / "operator-stats.json"
    log_file = (work / "operator.log").open("wb")
    operator = subprocess.Popen(
        [
            sys.executable, "-m", "warmgate_operator", "--namespace", NAMESPACE,
            "--stats-file", str(stats_file), "--log-format", "json", "--log-level", "WARNING",
        ],
        env=env, stdout=log_file, stderr=subprocess.STDOUT, cwd=str(ROOT),
    )  # fmt: skip
    ready_at: dict[str, float] = {}
    warmed_at: dict[str, float] = {}
    stop = threading.Event()

    def watch_gates() -> None:
        core = k8s.CoreV1Api(api)
        stream = watch.Watch()
        while not stop.is_set():
            for event in stream.stream(
                core.list_namespaced_pod, NAMESPACE, label_selector=selector, timeout_seconds=5
            ):
                pod = event["object"]
                for condition in pod.status.conditions or []:
                    if condition.type == WARMED_CONDITION and condition.status == "True":
                        warmed_at.setdefault(pod.metadata.name, time.monotonic())
                if stop.is_set():
                    break

    watcher = threading.Thread(target=watch_gates, daemon=True)
    try:
        at_start = read_stats(stats_file)
        watcher.start()
        service_path = kubeapi.resource_path(API_VERSION, PLURAL, NAMESPACE, SERVICE)
        kubeapi.apply(api, service_path, embedding_service(args.replicas), FIELD_MANAGER)

        def pods() -> list[dict[str, Any]]:
            return kubeapi.call(api, "GET", pods_path, query={"labelSelector": selector})["items"]

        deadline = time.monotonic() + args.timeout
        while len(current := pods()) < args.replicas:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {len(current)} gated pods after {args.timeout}s")
            time.sleep(1.0)
        reports.prepare(current[0])
        names = sorted(pod["metadata"]["name"] for pod in current)
        print(f"{len(names)} gated pods: making them ready at {args.rate}/s ...", flush=True)
        rollout_started = time.monotonic()
        interval = 1.0 / args.rate
        for name in names:
            now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            kubeapi.call(
                api,
                "PATCH",
                kubeapi.resource_path("v1", "pods", NAMESPACE, name, "status"),
                running_status(now),
                content_type=STRATEGIC_MERGE_PATCH,
            )
            ready_at[name] = time.monotonic()
            time.sleep(max(0.0, ready_at[name] + interval - time.monotonic()))
        while len(warmed_at) < len(names):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(warmed_at)}/{len(names)} gates open in time")
            time.sleep(0.2)
        rollout_seconds = time.monotonic() - rollout_started
        time.sleep(2.5)  # the operator rewrites its stats file once a second
        at_end = read_stats(stats_file)
        rss = peak_rss_mib(operator.pid)
    finally:
        stop.set()
        server.shutdown()
        if operator.poll() is None:
            operator.send_signal(signal.SIGTERM)
            try:
                operator.wait(30)
            except subprocess.TimeoutExpired:
                operator.kill()
                operator.wait()
        log_file.close()
        delete_namespace(api, NAMESPACE)

    latencies = [warmed_at[name] - ready_at[name] for name in names]
    requests = {
        key: at_end["requests"].get(key, 0) - at_start["requests"].get(key, 0)
        for key in at_end["requests"]
    }
    count = len(names)
    return {
        "unrelated_pods": args.unrelated,
        "gated_pods": count,
        "ready_rate_per_second": args.rate,
        "unrelated_create_seconds": round(unrelated_seconds, 1),
        "rollout_seconds": round(rollout_seconds, 1),
        "gate_latency_p50_seconds": round(statistics.median(latencies), 3),
        "gate_latency_p99_seconds": round(percentile(latencies, 99), 3),
        "gate_latency_max_seconds": round(max(latencies), 3),
        "peak_rss_mib": round(rss, 1),
        "api_requests_per_gated_pod": round(sum(requests.values()) / count, 2),
        "api_requests_by_kind": {key: value for key, value in requests.items() if value},
        "ready_reports_served": reports.served,
    }


def main() -> int:
    def checks(result: dict[str, Any]) -> dict[str, bool]:
        return {
            "peak_rss_mib": result["peak_rss_mib"] <= TARGETS["peak_rss_mib"],
            "gate_p99_seconds": result["gate_latency_p99_seconds"] <= TARGETS["gate_p99_seconds"],
        }

    return run_and_report(parse_args(), run, "gate", TARGETS, checks)


if __name__ == "__main__":
    sys.exit(main())
