"""The operator's own Prometheus metrics and its HTTP endpoint (/metrics, /healthz).

One `Metrics` per process, built in `__main__` and handed to what records into it. The endpoint
runs in a thread from process start, before leader election, so that a standby replica answers
its liveness probe and reports `warmgate_operator_leader 0`: the operator's only /healthz (kopf's
own liveness endpoint starts after its startup handlers, that is after the election).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, Metric

log = logging.getLogger("warmgate.metrics")


class Heartbeat:
    """The operator's event loop beats while it operates; /healthz fails when it stops."""

    def __init__(self, stale_after: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.stale_after = stale_after
        self._clock = clock
        self.last: float | None = None

    def beat(self) -> None:
        self.last = self._clock()

    def healthy(self) -> bool:
        return self.last is None or self._clock() - self.last < self.stale_after


class _ApiRequests:
    """A collector over a KubeClient's request counts (verb and resource)."""

    def __init__(self, counts: Callable[[], dict[str, int]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "warmgate_operator_api_requests",
            "Kubernetes API requests, by verb (GET, LIST, WATCH, PATCH...) and resource.",
            labels=["method", "resource"],
        )
        for key, count in sorted(self._counts().items()):
            method, _, resource = key.partition(" ")
            family.add_metric([method, resource], count)
        yield family


class Metrics:
    """Every metric of one operator process, in a registry of its own."""

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        self.heartbeat = Heartbeat()
        self.reconciles = Counter(
            "warmgate_operator_reconciles",
            "EmbeddingService reconciles, by result (ok, error).",
            ["result"],
            registry=registry,
        )
        self.reconcile_seconds = Histogram(
            "warmgate_operator_reconcile_duration_seconds",
            "Time of one reconcile.",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=registry,
        )
        self.gate_verifications = Counter(
            "warmgate_operator_gate_verifications",
            "Warm gate verdicts written to pods, by reason (WarmupVerified, ReportNotReady, ...).",
            ["reason"],
            registry=registry,
        )
        self.gate_latency = Histogram(
            "warmgate_operator_gate_latency_seconds",
            "From a pod's containers being ready to its warm gate opening.",
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
            registry=registry,
        )
        self.scale_out_seconds = Histogram(
            "warmgate_operator_scale_out_seconds",
            "From a scale-out's decision (more serving pods wanted) to that many pods serving, "
            "by whether the standby pool had a pod for each one added (standby true/false).",
            ["standby"],
            buckets=(0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600),
            registry=registry,
        )
        self.scaled_to_zero = Counter(
            "warmgate_operator_scaled_to_zero",
            "EmbeddingServices scaled to zero after autoscaling.scaleToZero.idleSeconds "
            "without a request.",
            registry=registry,
        )
        self.alias_status_writes = Counter(
            "warmgate_operator_alias_status_writes",
            "EmbeddingAlias statuses written, by the Ready condition's reason.",
            ["reason"],
            registry=registry,
        )
        self.pod_calls = Counter(
            "warmgate_operator_pod_calls",
            "Calls to server pods (/ready, /warmup/profile, verification), by path and result.",
            ["path", "result"],
            registry=registry,
        )
        self.watch_events = Counter(
            "warmgate_operator_watch_events",
            "Watch events that changed the operator's cache, by resource.",
            ["resource"],
            registry=registry,
        )
        self.relists = Counter(
            "warmgate_operator_watch_relists",
            "Listings after a watch gap (an expired resource version, a watch error), by resource.",
            ["resource"],
            registry=registry,
        )
        self.leader = Gauge(
            "warmgate_operator_leader",
            "1 while this replica holds the leader Lease (or runs without leader election).",
            registry=registry,
        )

    def count_api_requests(self, counts: Callable[[], dict[str, int]]) -> None:
        """Export a KubeClient's request counts (`KubeClient.requests`)."""
        self.registry.register(_ApiRequests(counts))

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """A sample's value (0 when absent), for tests and benchmarks."""
        return self.registry.get_sample_value(name, labels or {}) or 0.0

    def serve(self, host: str, port: int) -> ThreadingHTTPServer:
        """Serve /metrics and /healthz in a daemon thread; returns the server (its address)."""
        metrics = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                if path == "/metrics":
                    body, status = generate_latest(metrics.registry), 200
                    kind = CONTENT_TYPE_LATEST
                elif path in ("/healthz", "/livez"):
                    healthy = metrics.heartbeat.healthy()
                    body = b"ok\n" if healthy else b"the operator's event loop stopped beating\n"
                    status, kind = (200 if healthy else 503), "text/plain"
                else:
                    body, status, kind = b"not found\n", 404, "text/plain"
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                return

        server = ThreadingHTTPServer((host, port), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, name="operator-http", daemon=True).start()
        log.info("serving /metrics and /healthz on %s:%d", *server.server_address[:2])
        return server
