#!/usr/bin/env python3
"""`make bench-rollout`: a model reload under constant load, measured.

Starts its own devcluster (real control plane, a real node: server containers on kubelet),
installs the CRD, runs the operator, deploys a 2-replica MiniLM EmbeddingService, sends RATE
requests a second through the Service's node port (kube-proxy on the node's address), changes
`spec.model.revision`, and reports for the reload: failed requests,
cold responses, p50/p99 latency before, during and after the rollout, seconds from the spec change
to the rollout's end, and each new pod's warmup seconds (from its /ready report). Runs the same
reload with the warm gate and warmup off as the control, side by side.

Each pod requests 500m CPU (the operator's default request) with the same limit, so that the
two serving pods and the surge pod of the rollout (1.5 CPUs) fit the 2-CPU node beside its
add-ons; the scheduler refuses more. The first service is deleted before the control runs.
`--cpu-limit ''` leaves the pods without a CPU limit (as examples/minilm.yaml does): a warming
pod may then take the node's idle cores, and `--compare-pace` runs the gated reload again with
`warmup.pace: request` (the warmup held to the pod's CPU request while the node is busy) beside
the default (`none`).
`--default-plan` warms the operator's default plan (12 shapes) instead of the 4-shape one.

Results: bench/results/rollout.json and a markdown table on stdout (copied into
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
import threading
import urllib.request
from pathlib import Path

import yaml
from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from warmgate_contract.names import GROUP, PLURAL, SERVER_PORT, VERSION
from warmgate_devcluster import kubeapi
from warmgate_devcluster.cluster import DevCluster
from warmgate_devcluster.loadgen import ConstantRateLoad, LoadReport
from warmgate_devcluster.pytest_plugin import DevClusterHandle, isolated_config, reserve_slot
from warmgate_devcluster.testkit import (
    Kube,
    NamespacedOperator,
    condition,
    embedding_service,
    install_crd,
    service_url,
    wait_ready,
    wait_until,
)

ROOT = Path(__file__).resolve().parents[2]


class StatusWatch:
    """The latest EmbeddingService object, from a watch (the Kubernetes client's).

    The rollout is observed through a watch, not by polling: polling twice a second during the
    rollout, and only then, would add its own load to the phase being measured.
    """

    def __init__(self, handle: DevClusterHandle, namespace: str, name: str) -> None:
        self.latest: dict | None = None
        self._custom = client.CustomObjectsApi(handle.api)
        self._namespace, self._name = namespace, name
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        version = None  # where the last stream ended: the next one goes on from there
        while not self._stop.is_set():
            since = {"resource_version": version} if version else {}
            try:
                # A short server-side timeout, so that `close` is never longer than that away.
                for event in watch.Watch().stream(
                    self._custom.list_namespaced_custom_object,
                    GROUP,
                    VERSION,
                    self._namespace,
                    PLURAL,
                    field_selector=f"metadata.name={self._name}",
                    timeout_seconds=5,
                    **since,
                ):
                    version = event["raw_object"]["metadata"]["resourceVersion"]
                    if event["type"] in ("ADDED", "MODIFIED"):
                        self.latest = event["raw_object"]
                    if self._stop.is_set():
                        break
            except ApiException as error:
                if error.status != 410:
                    raise
                version = None  # too old to go on from: start with the object as it is

    def rolled_out(self, revision: str, replicas: int) -> bool:
        """The rollout to `revision` is complete, by Deployment rules: every pod that is not
        terminating is updated and ready, and the EmbeddingService is Ready."""
        emb = self.latest
        if emb is None:
            return False
        status = emb.get("status") or {}
        return (
            status.get("observedGeneration") == emb["metadata"]["generation"]
            and emb["spec"]["model"].get("revision") == revision
            and condition(emb, "Ready").get("status") == "True"
            and status.get("replicas") == status.get("updatedReplicas") == replicas
            and status.get("readyReplicas") == replicas
        )

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def pod_warmups(kube: Kube, name: str) -> dict[str, float | None]:
    result = {}
    for pod in kube.pods(name):
        if pod["metadata"].get("deletionTimestamp"):
            continue
        ip = pod["status"].get("podIP")
        try:
            with urllib.request.urlopen(f"http://{ip}:{SERVER_PORT}/ready", timeout=5) as response:
                result[pod["metadata"]["name"]] = json.load(response).get("warmup_seconds")
        except OSError:
            result[pod["metadata"]["name"]] = None
    return result


def phase_stats(report: LoadReport, start: float, end: float) -> dict:
    samples = report.between(start, end)
    return {
        "requests": len(samples),
        "failed": sum(1 for s in samples if not s.ok),
        "cold": sum(1 for s in samples if s.cold),
        "p50_ms": _round(LoadReport.percentile(samples, 50)),
        "p99_ms": _round(LoadReport.percentile(samples, 99)),
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def run_reload(
    kube: Kube,
    name: str,
    rate: float,
    gate: bool,
    cpu: str,
    cpu_limit: str | None = None,
    default_plan: bool = False,
    pace: str = "none",
) -> dict:
    overrides: dict = (
        {"warmup": {"pace": pace}}
        if gate
        else {"warmup": {"enabled": False}, "rollout": {"warmGate": False}}
    )
    limit = cpu if cpu_limit is None else cpu_limit
    if cpu or limit:  # each pod gets `cpu` CPUs and may use `limit` ('': no limit)
        overrides["resources"] = {
            **({"requests": {"cpu": cpu}} if cpu else {}),
            **({"limits": {"cpu": limit}} if limit else {}),
        }
    service = embedding_service(name, "v1", **overrides)
    if default_plan:  # the operator's default plan and batching, not the e2e tests' small one
        for key in ("batchSizes", "sequenceBuckets"):
            service["spec"]["warmup"].pop(key)
        service["spec"].pop("batching")
    kube.apply(service)
    wait_ready(kube, name, "v1", replicas=2, timeout=600)
    url = service_url(kube, name)
    watch = StatusWatch(kube.devcluster, kube.namespace, name)
    try:
        wait_until(lambda: watch.rolled_out("v1", 2), 60, "the status watch to start")
        with ConstantRateLoad(url, rate=rate, networks=kube.devcluster.networks) as load:
            wait_until(lambda: load.elapsed() >= 15, 60, "15 s of steady traffic", every=0.1)
            changed = load.elapsed()
            kube.patch("embeddingservice", name, {"spec": {"model": {"revision": "v2"}}})
            wait_until(lambda: watch.rolled_out("v2", 2), 600, "the rollout to v2", every=0.1)
            done = load.elapsed()
            wait_until(lambda: load.elapsed() >= done + 15, 60, "15 s after the rollout", every=0.1)
            end = load.elapsed()
    finally:
        watch.close()
    wait_ready(kube, name, "v2", replicas=2, timeout=60)  # and by the e2e tests' rule
    warmups = pod_warmups(kube, name)
    pacing = {
        pod: [line for line in kube.run("logs", pod).stdout.splitlines() if "warmup paced" in line]
        for pod in warmups
    }
    # Its pods' CPU goes back to the node before the next run is scheduled.
    kube.run("delete", "embeddingservice", name, "--wait=true")
    wait_until(lambda: not kube.pods(name), 120, f"{name}'s pods to be gone")
    report = load.report
    return {
        "warm_gate_and_warmup": gate,
        "pace": pace if gate else None,
        "rate_per_s": rate,
        "pod_cpu": cpu or None,
        "pod_cpu_limit": limit or None,
        "default_plan": default_plan,
        "rollout_seconds": round(done - changed, 1),
        "before": phase_stats(report, 0, changed),
        "during": phase_stats(report, changed, done),
        "after": phase_stats(report, done, end + 60),
        "total_failed": len(report.failed),
        "total_cold": len(report.cold),
        "errors": sorted({s.error or str(s.status) for s in report.failed})[:5],
        "new_pod_warmup_seconds": warmups,
        "new_pod_pacing": pacing,
        # The slowest requests, with their time from the spec change: where the tail comes from.
        "slowest": [
            {
                "at_s": round(sample.started - changed, 2),
                "ms": round(sample.latency_ms, 1),
                "server_ms": None if sample.server_ms is None else round(sample.server_ms, 1),
                "server_timing": sample.server_timing,
                "pod": sample.pod,
                "revision": sample.revision,
            }
            for sample in sorted(report.samples, key=lambda s: -s.latency_ms)[:15]
        ],
    }


def markdown(results: list[dict]) -> str:
    lines = [
        "| gate + warmup | warmup.pace | phase | requests | failed | cold | p50 ms | p99 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        for phase in ("before", "during", "after"):
            stats = result[phase]
            lines.append(
                f"| {'on' if result['warm_gate_and_warmup'] else 'off'} | "
                f"{result['pace'] or ''} | {phase} | "
                f"{stats['requests']} | {stats['failed']} | {stats['cold']} | "
                f"{stats['p50_ms']} | {stats['p99_ms']} |"
            )
    lines.append("")
    for result in results:
        ratio = (
            result["during"]["p99_ms"] / result["before"]["p99_ms"]
            if result["during"]["p99_ms"] and result["before"]["p99_ms"]
            else None
        )
        lines.append(
            f"- gate {'on' if result['warm_gate_and_warmup'] else 'off'}"
            f"{', pace ' + result['pace'] if result['pace'] else ''}: p99 during / before "
            f"{'?' if ratio is None else f'{ratio:.2f}'}x; rollout "
            f"{result['rollout_seconds']} s from spec change to done; new pods' warmup seconds "
            f"{result['new_pod_warmup_seconds']}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--no-control", action="store_true", help="skip the gate-off control")
    parser.add_argument(
        "--cpu", default="500m", help="each pod's CPU request and limit ('': the default)"
    )
    parser.add_argument(
        "--cpu-limit",
        default=None,
        help="each pod's CPU limit, if not --cpu's ('': none, as in examples/minilm.yaml: the pod "
        "may take the node's idle cores)",
    )
    parser.add_argument(
        "--compare-pace",
        action="store_true",
        help="also run the gated reload with warmup.pace: request (held to the pod's CPU request)",
    )
    parser.add_argument(
        "--default-plan",
        action="store_true",
        help="the operator's default warmup plan and batching (12 shapes), not the 4-shape plan",
    )
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-rollout-"))
    cluster = DevCluster(isolated_config(work / "devcluster", reserve_slot()))
    operator = None
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
        shared = {"cpu": args.cpu, "cpu_limit": args.cpu_limit, "default_plan": args.default_plan}
        results = [run_reload(kube, "gated", args.rate, gate=True, **shared)]
        if args.compare_pace:
            results.append(run_reload(kube, "paced", args.rate, True, pace="request", **shared))
        if not args.no_control:
            results.append(run_reload(kube, "plain", args.rate, gate=False, **shared))
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
    (out / "rollout.json").write_text(json.dumps({"machine": machine, "runs": results}, indent=2))
    print(markdown(results))
    print(yaml.safe_dump({"machine": machine}))
    shutil.rmtree(work, ignore_errors=True)
    failed = results[0]["total_failed"] or results[0]["total_cold"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
