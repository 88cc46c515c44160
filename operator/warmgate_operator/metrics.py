"""The operator's own Prometheus metrics and its HTTP endpoint (/metrics, /healthz).

The endpoint runs in a thread from process start, before leader election, so that a standby
replica answers its liveness probe and reports `warmgate_operator_leader 0`.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily

log = logging.getLogger("warmgate.metrics")

REGISTRY = CollectorRegistry()
RECONCILES = Counter(
    "warmgate_operator_reconciles",
    "EmbeddingService reconciles, by result (ok, error).",
    ["result"],
    registry=REGISTRY,
)
RECONCILE_SECONDS = Histogram(
    "warmgate_operator_reconcile_duration_seconds",
    "Time of one reconcile.",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
    registry=REGISTRY,
)
GATE_VERIFICATIONS = Counter(
    "warmgate_operator_gate_verifications",
    "Warm gate verdicts written to pods, by reason (WarmupVerified, ReportNotReady, ...).",
    ["reason"],
    registry=REGISTRY,
)
GATE_LATENCY = Histogram(
    "warmgate_operator_gate_latency_seconds",
    "From a pod's containers being ready to its warm gate opening.",
    buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
    registry=REGISTRY,
)
POD_CALLS = Counter(
    "warmgate_operator_pod_calls",
    "Calls to server pods (/ready, /warmup/profile, verification), by path and result.",
    ["path", "result"],
    registry=REGISTRY,
)
WATCH_EVENTS = Counter(
    "warmgate_operator_watch_events",
    "Watch events received, by resource.",
    ["resource"],
    registry=REGISTRY,
)
WATCH_RESTARTS = Counter(
    "warmgate_operator_watch_restarts",
    "Watch streams that ended and were started again (kopf's), by resource.",
    ["resource"],
    registry=REGISTRY,
)
LEADER = Gauge(
    "warmgate_operator_leader",
    "1 while this replica holds the leader Lease (or runs without leader election).",
    registry=REGISTRY,
)


class ApiRequests:
    """A collector over a KubeClient's request counts (method and resource)."""

    def __init__(self) -> None:
        self.source: Callable[[], dict[str, int]] | None = None

    def collect(self):
        family = CounterMetricFamily(
            "warmgate_operator_api_requests",
            "Kubernetes API requests, by method and resource.",
            labels=["method", "resource"],
        )
        for key, count in sorted((self.source() if self.source else {}).items()):
            method, _, resource = key.partition(" ")
            family.add_metric([method, resource], count)
        yield family


API_REQUESTS = ApiRequests()
REGISTRY.register(API_REQUESTS)


class _WatchRestarts(logging.Handler):
    """Counts kopf's watch-stream restarts per resource from its debug log (kopf has no hook):
    `Restarting the watch-stream for R` (a 410: the stream lists everything again) and
    `Watch-stream for R ... is inactive, reconnecting`. Records at or above the root logger's
    level are passed on as usual."""

    _RESTART = re.compile(r"^(?:Restarting the watch-stream for|Watch-stream for) (\S+)")

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)

    def emit(self, record: logging.LogRecord) -> None:
        match = self._RESTART.match(record.getMessage())
        if match:
            resource = match.group(1)
            WATCH_RESTARTS.labels(resource=resource).inc()
            for hook in WATCH_RESTART_HOOKS:
                hook(resource)
        root = logging.getLogger()
        if record.levelno >= root.getEffectiveLevel():
            for handler in root.handlers:
                if record.levelno >= handler.level:
                    handler.handle(record)


WATCH_RESTART_HOOKS: list[Callable[[str], None]] = []
"""Called with the resource (kopf's name, e.g. `pods.v1`) each time its watch restarts."""


def count_watch_restarts() -> None:
    watching = logging.getLogger("kopf._cogs.clients.watching")
    watching.setLevel(logging.DEBUG)
    watching.propagate = False
    if not any(isinstance(handler, _WatchRestarts) for handler in watching.handlers):
        watching.addHandler(_WatchRestarts())


class Heartbeat:
    """The operator's event loop beats while it operates; /healthz fails when it stops."""

    def __init__(self, stale_after: float = 60.0) -> None:
        self.stale_after = stale_after
        self.last: float | None = None

    def beat(self) -> None:
        self.last = time.monotonic()

    def healthy(self) -> bool:
        return self.last is None or time.monotonic() - self.last < self.stale_after


HEARTBEAT = Heartbeat()


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path.split("?")[0] == "/metrics":
            body, status, kind = generate_latest(REGISTRY), 200, CONTENT_TYPE_LATEST
        elif self.path.split("?")[0] in ("/healthz", "/livez"):
            healthy = HEARTBEAT.healthy()
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


def serve(host: str, port: int) -> ThreadingHTTPServer:
    """Serve /metrics and /healthz in a daemon thread; returns the server (its address)."""
    server = ThreadingHTTPServer((host, port), _Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="operator-http", daemon=True).start()
    log.info("serving /metrics and /healthz on %s:%d", *server.server_address[:2])
    return server
