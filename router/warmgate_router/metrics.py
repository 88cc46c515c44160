"""The router's Prometheus metrics."""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
HOLD_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # process_cpu_seconds_total and memory: the router's own cost per request.
        ProcessCollector(registry=r)
        self.requests = Counter(
            "warmgate_router_requests",
            "Requests answered, by model name asked, EmbeddingService (namespace/name) and status",
            ["model", "service", "code"],
            registry=r,
        )
        self.latency = Histogram(
            "warmgate_router_request_seconds",
            "Time from a request's arrival to its answer, held time included",
            ["service"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.held = Gauge(
            "warmgate_router_held_requests",
            "Requests waiting for a warm pod (a service at zero, or with none Ready)",
            ["service"],
            registry=r,
        )
        self.hold_seconds = Histogram(
            "warmgate_router_hold_seconds",
            "How long a held request waited for a warm pod",
            ["service", "outcome"],
            buckets=HOLD_BUCKETS,
            registry=r,
        )
        self.cold_starts = Counter(
            "warmgate_router_cold_starts_from_zero",
            "Times this router scaled an EmbeddingService from zero to one for a request",
            ["service"],
            registry=r,
        )
        self.retries = Counter(
            "warmgate_router_connect_retries",
            "Requests sent to another pod because a pod refused the connection",
            ["service"],
            registry=r,
        )
        self.in_flight = Gauge(
            "warmgate_router_in_flight",
            "Requests forwarded and not yet answered",
            ["service"],
            registry=r,
        )
        self.endpoints = Gauge(
            "warmgate_router_ready_endpoints",
            "Ready (gate-verified, serving) pods per service",
            ["service"],
            registry=r,
        )

        # Labelled children looked up once (labels() validates and locks on every call).
        self._per_service: dict[str, tuple[Any, Any]] = {}
        self._answered: dict[tuple[str, str, str], Any] = {}

    def for_service(self, service: str) -> tuple[Any, Any]:
        """`service`'s children of in_flight and latency."""
        found = self._per_service.get(service)
        if found is None:
            found = (self.in_flight.labels(service=service), self.latency.labels(service=service))
            self._per_service[service] = found
        return found

    def answered(self, model: str, service: str, code: int) -> None:
        """One request answered (requests_total)."""
        key = (model, service, str(code))
        child = self._answered.get(key)
        if child is None:
            child = self._answered[key] = self.requests.labels(*key)
        child.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
