#!/usr/bin/env python3
"""A server pod's way to Ready on the devcluster's node, timed from the pod's own conditions.

Starts its own devcluster, installs the CRD, runs the operator, applies the tests' small MiniLM
EmbeddingService (one replica, two shapes) and deletes its pod ROUNDS times; for each new pod it
reads, from `status.conditions` (whole seconds) and the server's /ready report: scheduled ->
containers ready (the startup probe passed: the server loaded and warmed) -> Ready (the
operator verified the warmup report and opened the gate), and the server's own warmup seconds.

    .venv/bin/python bench/devcluster/pod_ready.py [--rounds 4]

The comparison with the node that ran pods as host processes (docs/benchmarks.md) came from
this script as of commit ddf4656, run on a worktree of commit 3679ba2; this version reads the
API through the Kubernetes client and takes the server port from the contract, which that
commit does not have.
"""

from __future__ import annotations

import argparse
import calendar
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

from warmgate_contract.names import SERVER_PORT
from warmgate_devcluster import kubeapi
from warmgate_devcluster.cluster import DevCluster
from warmgate_devcluster.pytest_plugin import DevClusterHandle, isolated_config, reserve_slot
from warmgate_devcluster.testkit import OperatorProcess, install_crd, tiny_minilm, wait_until


def epoch(timestamp: str) -> float:
    return float(calendar.timegm(time.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ")))


def condition_time(pod: dict, kind: str) -> float | None:
    for item in pod["status"].get("conditions") or []:
        if item["type"] == kind and item["status"] == "True":
            return epoch(item["lastTransitionTime"])
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-pod-ready-"))
    cluster = DevCluster(isolated_config(work / "state", reserve_slot()))
    rows = []
    operator = None
    try:
        cluster.up(log=lambda *_: None)
        handle = DevClusterHandle.of(cluster)
        install_crd(handle)
        namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "bench"}}
        kubeapi.call(handle.api, "POST", kubeapi.resource_path("v1", "namespaces"), namespace)
        operator = OperatorProcess(
            handle, work / "operator.log", "--namespace=bench", "--log-format=text"
        ).start()
        handle.kubectl("apply", "-n", "bench", "-f", "-", input=yaml.safe_dump(tiny_minilm("m")))

        def ready_pod(exclude: set[str]) -> dict | None:
            pods = kubeapi.call(handle.api, "GET", kubeapi.resource_path("v1", "pods", "bench"))
            for pod in pods["items"]:
                name = pod["metadata"]["name"]
                if name not in exclude and condition_time(pod, "Ready") is not None:
                    return pod
            return None

        seen: set[str] = set()
        for _ in range(args.rounds):
            pod = wait_until(lambda: ready_pod(seen), 600, "a Ready pod", every=0.5)
            name = pod["metadata"]["name"]
            seen.add(name)
            ready_url = f"http://{pod['status']['podIP']}:{SERVER_PORT}/ready"
            with urllib.request.urlopen(ready_url) as answer:
                warmup = json.load(answer)["warmup_seconds"]
            scheduled = condition_time(pod, "PodScheduled")
            rows.append(
                {
                    "pod": name,
                    "scheduled_to_containers_ready": condition_time(pod, "ContainersReady")
                    - scheduled,
                    "scheduled_to_ready": condition_time(pod, "Ready") - scheduled,
                    "server_warmup_seconds": warmup,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
            kubeapi.call(handle.api, "DELETE", kubeapi.resource_path("v1", "pods", "bench", name))
    finally:
        if operator is not None:
            operator.stop()
        cluster.down(log=lambda *_: None)
    for key in ("scheduled_to_containers_ready", "scheduled_to_ready", "server_warmup_seconds"):
        values = [row[key] for row in rows]
        print(f"{key}: median {statistics.median(values):.1f}, max {max(values):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
