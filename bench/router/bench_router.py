#!/usr/bin/env python3
"""`make bench-router`: warmgate-router against the Service directly, one run, alternating.

Starts its own devcluster (real control plane and node), installs the CRDs, runs the operator,
renders the chart's router templates (two replicas, from the router image) and deploys one
MiniLM EmbeddingService (one pod). Then, through the node ports, with one pooled aiohttp client
(keep-alive connections, as an application holds them), alternating direct and router rounds:

- one sentence at concurrency 1: p50 and p99 (what the router adds to each request);
- one sentence at concurrency 32: requests/s (target: the router at least 95% of direct);
- the router's CPU per 1,000 requests (process_cpu_seconds_total of both replicas);
- scale from zero: an EmbeddingService with autoscaling.scaleToZero idle for 10 s is scaled to
  zero by the operator; one request through the router is held until the new pod passes the
  warm gate: the hold time (X-Warmgate-Held-Ms) next to the pod's creation-to-Ready time and
  its warmup.

Results: bench/results/router.json and a markdown table on stdout (copied into
docs/benchmarks.md by hand, with the machine it ran on).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp
import yaml

from warmgate_devcluster import kubeapi
from warmgate_devcluster.cluster import DevCluster
from warmgate_devcluster.pytest_plugin import DevClusterHandle, isolated_config, reserve_slot
from warmgate_devcluster.testkit import (
    Kube,
    NamespacedOperator,
    condition,
    embedding_service,
    install_crd,
    node_port,
    render_router,
    wait_ready,
    wait_until,
    warmup_seconds,
)

ROOT = Path(__file__).resolve().parents[2]
TEXT = "Warm caches make fast servers."
CPU_PATTERN = re.compile(r"^process_cpu_seconds_total (\S+)$", re.MULTILINE)
REQUESTS_PATTERN = re.compile(r"^warmgate_router_requests_total\{[^}]*\} (\S+)$", re.MULTILINE)


async def timed_post(session: aiohttp.ClientSession, url: str, body: dict) -> float | None:
    """Seconds to a whole 200 answer; None for any other status."""
    started = time.perf_counter()
    async with session.post(url, json=body) as response:
        await response.read()
        if response.status != 200:
            return None
    return time.perf_counter() - started


async def closed_loop(url: str, model: str | None, concurrency: int, seconds: float) -> dict:
    latencies: list[float] = []
    errors = 0
    body = {"input": TEXT, **({"model": model} if model else {})}
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        end = time.monotonic() + seconds

        async def worker() -> None:
            nonlocal errors
            while time.monotonic() < end:
                taken = await timed_post(session, url, body)
                if taken is None:
                    errors += 1
                else:
                    latencies.append(taken)

        began = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.monotonic() - began
    latencies.sort()
    return {
        "requests": len(latencies),
        "errors": errors,
        "per_second": round(len(latencies) / elapsed, 1),
        "p50_ms": round(statistics.median(latencies) * 1000, 2) if latencies else None,
        "p99_ms": round(latencies[int(len(latencies) * 0.99) - 1] * 1000, 2) if latencies else None,
    }


async def paired_loop(direct: str, router: str, model: str, seconds: float) -> dict:
    """One client at a time, alternating one request direct and one through the router on the
    same pooled session: both sides see the same moment of a noisy shared machine, so the
    median of the pairs' differences is what the router adds."""
    sides: dict[str, list[float]] = {"direct": [], "router": []}
    added: list[float] = []
    errors = 0
    async with aiohttp.ClientSession() as session:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            first = await timed_post(session, direct, {"input": TEXT})
            second = await timed_post(session, router, {"input": TEXT, "model": model})
            if first is None or second is None:
                errors += 1
                continue
            sides["direct"].append(first)
            sides["router"].append(second)
            added.append(second - first)
    return {
        "pairs": len(added),
        "errors": errors,
        "direct_p50_ms": round(statistics.median(sides["direct"]) * 1000, 2),
        "router_p50_ms": round(statistics.median(sides["router"]) * 1000, 2),
        "added_median_ms": round(statistics.median(added) * 1000, 2),
    }


def router_counters(kube: Kube) -> tuple[float, float]:
    """(CPU seconds, requests) summed over the router pods, read from their /metrics through
    the API server's pod proxy."""
    pods = kube.get("pods", selector="app.kubernetes.io/name=warmgate-router")["items"]
    cpu = requests = 0.0
    for pod in pods:
        name = pod["metadata"]["name"]
        path = f"/api/v1/namespaces/{kube.namespace}/pods/{name}:8080/proxy/metrics"
        text = kubeapi.request(kube.api, "GET", path)[1]
        cpu += float(CPU_PATTERN.search(text).group(1))
        requests += sum(float(v) for v in REQUESTS_PATTERN.findall(text))
    return cpu, requests


def parse_time(stamp: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def scale_from_zero(kube: Kube, router_url: str) -> dict:
    kube.apply(
        embedding_service(
            "idle", "v1", replicas=1, service={"type": "ClusterIP"},
            autoscaling={
                "enabled": True, "minReplicas": 0, "maxReplicas": 2,
                "scaleToZero": {"idleSeconds": 10},
            },
        )
    )  # fmt: skip
    wait_ready(kube, "idle", "v1", replicas=1, timeout=600)

    def at_zero() -> bool:
        emb = kube.get("embeddingservice", "idle") or {}
        return emb.get("spec", {}).get("replicas") == 0 and not kube.pods("idle")

    wait_until(at_zero, 300, "the idle service scaled to zero")
    request = urllib.request.Request(
        router_url + "/v1/embeddings",
        data=json.dumps({"model": "idle", "input": TEXT}).encode(),
        headers={"Content-Type": "application/json"},
    )
    sent = time.monotonic()
    with urllib.request.urlopen(request, timeout=600) as response:
        held_ms = int(response.headers["X-Warmgate-Held-Ms"])
        cold = response.headers["X-Warmgate-Cold"]
    answered = time.monotonic() - sent
    pod = kube.pods("idle")[0]
    ready = condition(pod, "Ready").get("lastTransitionTime")
    start = parse_time(pod["metadata"]["creationTimestamp"])
    return {
        "hold_s": held_ms / 1000,
        "answered_s": round(answered, 2),
        "cold": cold,
        "pod_created_to_ready_s": (parse_time(ready) - start).total_seconds() if ready else None,
        "warmup_s": warmup_seconds(pod),  # as the warm gate verified it
    }


def markdown(result: dict) -> str:
    lines = [
        "| load | direct (Service) | router | router / direct |",
        "|---|---|---|---|",
    ]
    if result.get("chart_sets"):
        lines.insert(0, f"Router chart values: `{' '.join(result['chart_sets'])}`\n")
    for point in ("c1", "c32"):
        d, r = result["direct"][point], result["router"][point]
        lines.append(
            f"| one sentence, concurrency {point[1:]} | {d['per_second']} req/s, p50 "
            f"{d['p50_ms']} ms, p99 {d['p99_ms']} ms | {r['per_second']} req/s, p50 "
            f"{r['p50_ms']} ms, p99 {r['p99_ms']} ms | {r['per_second'] / d['per_second']:.2f}x "
            f"req/s, +{r['p50_ms'] - d['p50_ms']:.2f} ms p50 |"
        )
    for run in result.get("paired_c1", []):
        lines.append(
            f"| one sentence, concurrency 1, direct and router requests alternating "
            f"({run['pairs']} pairs) | p50 {run['direct_p50_ms']} ms | p50 "
            f"{run['router_p50_ms']} ms | +{run['added_median_ms']:.2f} ms (median of the "
            "pairs' differences) |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="per round and point")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a chart value for the router (helm --set), e.g. router.resources.requests.cpu=250m",
    )
    parser.add_argument("--skip-scale-from-zero", action="store_true")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-router-"))
    cluster = DevCluster(isolated_config(work / "devcluster", reserve_slot()))
    operator = None
    result: dict = {}
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
        sets = [a for value in args.set for a in ("--set", value)]
        router_service = render_router(kube, "--set", "router.service.type=NodePort", *sets)
        router_url = f"http://{handle.node_ip}:{node_port(kube, router_service)}"
        kube.apply(embedding_service("direct", "v1", replicas=1))
        wait_ready(kube, "direct", "v1", replicas=1, timeout=600)
        direct_url = f"http://{handle.node_ip}:{node_port(kube, 'direct')}/v1/embeddings"
        rounds: dict[str, dict[str, list[dict]]] = {"direct": {}, "router": {}}
        cpu_seconds = routed = 0.0
        for _ in range(args.rounds):
            for point, concurrency in (("c1", 1), ("c32", 32)):
                for side, url, model in (
                    ("direct", direct_url, None),
                    ("router", router_url + "/v1/embeddings", "direct"),
                ):
                    before = router_counters(kube) if side == "router" else None
                    run = asyncio.run(closed_loop(url, model, concurrency, args.seconds))
                    if before is not None:
                        after = router_counters(kube)
                        cpu_seconds += after[0] - before[0]
                        routed += after[1] - before[1]
                    rounds[side].setdefault(point, []).append(run)
                    print(side, point, json.dumps(run), flush=True)
        best = {
            side: {p: max(runs, key=lambda r: r["per_second"]) for p, runs in points.items()}
            for side, points in rounds.items()
        }
        paired = [
            asyncio.run(
                paired_loop(direct_url, router_url + "/v1/embeddings", "direct", args.seconds)
            )
            for _ in range(args.rounds)
        ]
        print("paired", json.dumps(paired), flush=True)
        result = {
            "chart_sets": args.set,
            **best,
            "paired_c1": paired,
            "rounds": rounds,
            "router_cpu_ms_per_1000_requests": round(cpu_seconds / routed * 1e6, 1),
            "scale_from_zero": None
            if args.skip_scale_from_zero
            else scale_from_zero(kube, router_url),
        }
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
    report = json.dumps({"machine": machine, **result}, indent=2)
    (out / "router.json").write_text(report)
    print(markdown(result))
    print(
        json.dumps({k: result[k] for k in ("router_cpu_ms_per_1000_requests", "scale_from_zero")})
    )
    print(yaml.safe_dump({"machine": machine}))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
