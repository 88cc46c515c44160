"""Operator benchmark: reconcile N EmbeddingServices against a real apiserver.

Starts a devcluster (or uses --kubeconfig), installs the CRD, runs the operator as a process,
creates N EmbeddingServices one request after another and reports:

- seconds until every Deployment exists and every status describes its generation,
- the operator's peak RSS,
- API requests (and writes) per EmbeddingService and per reconcile to converge, and reads and
  writes per EmbeddingService per minute over a quiet period with several resyncs, when
  nothing changes.

Targets: converged within 60 s for 200, RSS under 200 MiB (issue 4); no read and no write at
all while nothing changes (issue 23: reconcile reads the watch cache). Pods need not run: the
image is not in the devcluster's node (it cannot pull), or replicas is 0 (--replicas). The
benchmark talks to the API through the Kubernetes Python client, as the operator does.

    python bench/operator/bench_operator.py [--count 200] [--replicas 0] [--quiet-seconds 40]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubernetes.client import ApiClient

from warmgate_contract.names import API_VERSION, KIND, PLURAL
from warmgate_devcluster import kubeapi, testkit
from warmgate_devcluster.testkit import UNMAPPED_IMAGE

ROOT = Path(__file__).resolve().parents[2]

FIELD_MANAGER = "warmgate-bench"
NAMESPACE = "bench-operator"
TARGETS = {
    "converge_seconds": 60.0,
    "peak_rss_mib": 200.0,
    "quiet_reads_per_es_per_minute": 0.0,
    "quiet_writes_per_es_per_minute": 0.0,
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=200, help="EmbeddingServices to create")
    parser.add_argument("--replicas", type=int, default=0, help="spec.replicas of each")
    parser.add_argument("--workers", type=int, default=8, help="operator reconcile workers")
    parser.add_argument("--resync-seconds", type=float, default=15.0)
    parser.add_argument(
        "--quiet-seconds", type=float, default=40.0, help="idle period measured for writes"
    )
    parser.add_argument("--kubeconfig", help="use this cluster instead of starting a devcluster")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--results-dir", type=Path, default=ROOT / "bench" / "results")
    return parser.parse_args()


def install_crd(api: ApiClient) -> None:
    """The CRDs (EmbeddingService, EmbeddingAlias), applied server-side from their manifests,
    Established."""
    for relative in testkit.CRD_FILES:
        manifest = testkit.crd_manifest(relative)
        name = manifest["metadata"]["name"]
        kubeapi.apply(api, testkit.crd_path(name), manifest, FIELD_MANAGER)
        testkit.wait_established(api, name=name)


def fresh_namespace(api: ApiClient, name: str, timeout: float) -> None:
    """`name`, created empty: an earlier run's namespace is deleted first, and waited for."""
    path = kubeapi.resource_path("v1", "namespaces", name=name)
    with contextlib.suppress(kubeapi.ApiError):
        kubeapi.call(api, "DELETE", path)
    testkit.wait_until(lambda: kubeapi.read(api, path) is None, timeout, f"namespace {name} gone")
    body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
    kubeapi.call(api, "POST", kubeapi.resource_path("v1", "namespaces"), body)


def delete_namespace(api: ApiClient, name: str) -> None:
    """Start deleting `name` and return (the namespace controller finishes)."""
    with contextlib.suppress(kubeapi.ApiError, *kubeapi.UNANSWERED):
        kubeapi.call(api, "DELETE", kubeapi.resource_path("v1", "namespaces", name=name))


def embedding_services(count: int, replicas: int) -> list[dict[str, Any]]:
    return [
        {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": {"name": f"bench-{i:03d}", "namespace": NAMESPACE},
            "spec": {
                "model": {"id": "sentence-transformers/all-MiniLM-L6-v2"},
                "image": UNMAPPED_IMAGE,
                "replicas": replicas,
                "warmup": {"batchSizes": [1, 8], "sequenceBuckets": [32, 64, 128]},
            },
        }
        for i in range(count)
    ]


def progress(api: ApiClient) -> tuple[int, int]:
    """(EmbeddingServices whose status describes their generation with every child applied,
    EmbeddingServices that are Ready). Reconcile writes the status only after applying the
    children, so a current status without ApplyFailed means the Deployment exists. Only the
    EmbeddingServices are listed, in one response, to keep the poll's own load on the
    apiserver small."""
    services = kubeapi.call(api, "GET", kubeapi.resource_path(API_VERSION, PLURAL, NAMESPACE))[
        "items"
    ]
    current = ready = 0
    for es in services:
        status = es.get("status") or {}
        if status.get("observedGeneration") != es["metadata"]["generation"]:
            continue
        conditions = {c["type"]: c for c in status.get("conditions", [])}
        if conditions.get("Degraded", {}).get("reason") in ("ApplyFailed", "ChildConflict"):
            continue
        current += 1
        ready += conditions.get("Ready", {}).get("status") == "True"
    return current, ready


def count_deployments(api: ApiClient) -> int:
    path = kubeapi.resource_path("apps/v1", "deployments", NAMESPACE)
    return len(kubeapi.call(api, "GET", path)["items"])


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def read_stats(path: Path) -> dict[str, Any]:
    for _ in range(50):
        try:
            return json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            time.sleep(0.1)
    raise RuntimeError(f"operator wrote no stats to {path}")


def settled(stats_file: Path, still_for: float, timeout: float) -> dict[str, Any]:
    """The operator's stats once its write count has not moved for `still_for` seconds."""
    deadline = time.monotonic() + timeout
    last = read_stats(stats_file)
    since = time.monotonic()
    while time.monotonic() - since < still_for:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the operator kept writing for {timeout:g}s")
        time.sleep(1.0)
        current = read_stats(stats_file)
        if current["writes"] != last["writes"]:
            since = time.monotonic()
        last = current
    return last


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run(args: argparse.Namespace, kubeconfig: str, api: ApiClient, work: Path) -> dict[str, Any]:
    env = dict(os.environ, KUBECONFIG=kubeconfig)
    install_crd(api)
    fresh_namespace(api, NAMESPACE, 120)

    stats_file = work / "operator-stats.json"
    log_file = (work / "operator.log").open("wb")
    operator_env = dict(env, PYTHONPATH=os.pathsep.join([str(ROOT / "operator")]))
    started = time.monotonic()
    operator = subprocess.Popen(
        [
            sys.executable, "-m", "warmgate_operator", "--namespace", NAMESPACE,
            "--resync-seconds", str(args.resync_seconds), "--workers", str(args.workers),
            "--stats-file", str(stats_file), "--log-format", "json", "--log-level", "WARNING",
        ],
        env=operator_env, stdout=log_file, stderr=subprocess.STDOUT, cwd=str(ROOT),
    )  # fmt: skip
    try:
        read_stats(stats_file)
        startup_seconds = time.monotonic() - started
        created_at = time.monotonic()
        path = kubeapi.resource_path(API_VERSION, PLURAL, NAMESPACE)
        for body in embedding_services(args.count, args.replicas):
            kubeapi.call(api, "POST", path, body)
        create_seconds = time.monotonic() - created_at
        converge_seconds = ready_seconds = None
        while ready_seconds is None:
            elapsed = time.monotonic() - created_at
            if elapsed > args.timeout:
                raise RuntimeError(f"not converged after {args.timeout}s")
            if operator.poll() is not None:
                raise RuntimeError("the operator exited; see its log")
            time.sleep(1.0)
            current, ready = progress(api)
            if converge_seconds is None and current == args.count:
                converge_seconds = time.monotonic() - created_at
                at_converge = read_stats(stats_file)
            # Pods with an unmapped image never get Ready; with replicas 0 everything can.
            if converge_seconds is not None and (args.replicas or ready == args.count):
                ready_seconds = time.monotonic() - created_at
        deployments = count_deployments(api)
        if deployments != args.count:
            raise RuntimeError(f"{deployments} Deployments for {args.count} EmbeddingServices")
        converge_cpu = cpu_seconds(operator.pid)
        # Idle begins once the cluster itself is still: the Deployments' own status updates
        # (their controller settles conditions after the pods' counts) are changes the
        # operator must follow. Its writes have stopped for a resync period and more.
        before_quiet = settled(stats_file, args.resync_seconds + 5, args.timeout)
        time.sleep(args.quiet_seconds)
        after_quiet = read_stats(stats_file)
        rss = peak_rss_mib(operator.pid)
    finally:
        if operator.poll() is None:
            operator.send_signal(signal.SIGTERM)
            try:
                operator.wait(30)
            except subprocess.TimeoutExpired:
                operator.kill()
                operator.wait()
        log_file.close()
        delete_namespace(api, NAMESPACE)

    count = args.count
    converge_requests = sum(at_converge["requests"].values())
    quiet_writes = after_quiet["writes"] - before_quiet["writes"]
    quiet_requests = sum(after_quiet["requests"].values()) - sum(before_quiet["requests"].values())
    quiet_reads = reads(after_quiet) - reads(before_quiet)
    per_minute = 60.0 / args.quiet_seconds / count
    return {
        "count": count,
        "replicas": args.replicas,
        "workers": args.workers,
        "resync_seconds": args.resync_seconds,
        "operator_startup_seconds": round(startup_seconds, 2),
        "create_request_seconds": round(create_seconds, 2),
        "converge_seconds": round(converge_seconds, 2),
        "all_ready_seconds": round(ready_seconds, 2) if not args.replicas else None,
        "peak_rss_mib": round(rss, 1),
        "operator_cpu_seconds_to_ready": round(converge_cpu, 1),
        "requests_per_es_to_converge": round(converge_requests / count, 2),
        "writes_per_es_to_converge": round(at_converge["writes"] / count, 2),
        "requests_by_kind_to_converge": at_converge["requests"],
        "reconciles_to_converge": at_converge["reconciles"],
        "requests_per_reconcile_to_converge": round(
            converge_requests / max(1, at_converge["reconciles"]), 2
        ),
        "quiet_seconds": args.quiet_seconds,
        "quiet_writes_per_es": round(quiet_writes / count, 3),
        "quiet_requests_per_es": round(quiet_requests / count, 2),
        "quiet_reads_per_es_per_minute": round(quiet_reads * per_minute, 3),
        "quiet_writes_per_es_per_minute": round(quiet_writes * per_minute, 3),
        "quiet_reconciles": after_quiet["reconciles"] - before_quiet["reconciles"],
        "quiet_requests_by_kind": {
            key: n - before_quiet["requests"].get(key, 0)
            for key, n in after_quiet["requests"].items()
            if n != before_quiet["requests"].get(key, 0)
        },
        "reconciles": after_quiet["reconciles"],
    }


def reads(stats: dict[str, Any]) -> int:
    """GETs and LISTs (a watch's own request, renewed every few minutes per kind and
    namespace whatever the number of EmbeddingServices, is not counted)."""
    return sum(n for key, n in stats["requests"].items() if key.split()[0] in ("GET", "LIST"))


def run_and_report(
    args: argparse.Namespace,
    run: Callable[[argparse.Namespace, str, ApiClient, Path], dict[str, Any]],
    name: str,
    targets: dict[str, float],
    checks_of: Callable[[dict[str, Any]], dict[str, bool]],
) -> int:
    """Run `run(args, kubeconfig, api, work)` on a devcluster of its own (or on
    --kubeconfig), then write the result with its targets to the results folder and print it;
    exit status 1 when a target is missed. Shared by the operator benchmarks."""
    work = Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))
    cluster = None
    if args.kubeconfig:
        kubeconfig = args.kubeconfig
    else:
        from warmgate_devcluster.cluster import DevCluster
        from warmgate_devcluster.pytest_plugin import isolated_config, reserve_slot

        # A pod-IP block and NodePort window no test session or `make up` cluster uses; no
        # pod runs warmgate's images (they carry an image the node does not hold), so the
        # node gets only the cluster's own.
        config = isolated_config(work / "devcluster", reserve_slot(), app_images=False)
        cluster = DevCluster(config)
        print("starting a devcluster ...", flush=True)
        cluster.up(log=lambda *_: None)
        kubeconfig = str(cluster.kubeconfig)
    try:
        with kubeapi.load_client(kubeconfig) as api:
            result = run(args, kubeconfig, api, work)
    finally:
        if cluster is not None:
            cluster.down(log=lambda *_: None)
    checks = checks_of(result)
    result["targets"] = targets
    result["meets_targets"] = checks
    args.results_dir.mkdir(parents=True, exist_ok=True)
    out = args.results_dir / f"{name}-{time.strftime('%Y%m%dT%H%M%S')}.json"
    out.write_text(json.dumps(result, indent=2))
    for key, value in result.items():
        if key not in ("targets", "meets_targets"):
            print(f"{key:32} {value}")
    for key, ok in checks.items():
        print(f"target {key:25} {'met' if ok else 'MISSED'} (<= {targets[key]})")
    print(f"results: {out}  (operator log: {work / 'operator.log'})")
    return 0 if all(checks.values()) else 1


def main() -> int:
    return run_and_report(
        parse_args(),
        run,
        "operator",
        TARGETS,
        lambda result: {key: result[key] <= limit for key, limit in TARGETS.items()},
    )


if __name__ == "__main__":
    sys.exit(main())
