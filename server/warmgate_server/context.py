"""What one app holds at run time, under one AppKey."""

from __future__ import annotations

import asyncio
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from aiohttp import web

from warmgate_contract.report import WARMING
from warmgate_contract.shapes import Shape

from .config import ServerConfig
from .draining import ConnectionActivity
from .engine import Engine
from .errors import Refused
from .faults import FaultInjector
from .lifecycle import Lifecycle
from .metrics import Metrics


@dataclass
class Runtime:
    config: ServerConfig
    lifecycle: Lifecycle
    metrics: Metrics
    plan: tuple[Shape, ...]
    pod_name: str
    engine: Engine | None = None
    model_threads: list[ThreadPoolExecutor] = field(default_factory=list)
    tokenizer_pool: ThreadPoolExecutor | None = None
    tokenization_workers: int = 1
    """Threads in `tokenizer_pool` (one until the model is loaded)."""
    in_flight: int = 0
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    self_url: str | None = None
    """Where this process listens, as a loopback URL (set once the port is bound): warmup sends
    a few requests there, so the HTTP layer's first uses are paid before /ready too."""
    connections: ConnectionActivity = field(default_factory=ConnectionActivity)
    """Each connection's requests, for closing idle keep-alive connections while draining."""
    standby: bool = False
    """The operator made this pod a standby (outside the Service): every response closes its
    connection and idle keep-alive connections are closed, so pooled clients reconnect through
    the Service to serving pods. Requests that still come are served as usual."""
    http_server: web.Server | None = None
    """The listening server (its open connections), once bound."""
    standby_closer: asyncio.Task[bool] | None = None
    faults: FaultInjector | None = None
    """Test-only fault injection (WARMGATE_FAULT_INJECTION=1); None otherwise."""
    warmup_token: str = field(default_factory=lambda: secrets.token_hex(16))
    """The `X-Warmgate-Warmup` value of those requests: they are served while warming and kept
    out of the metrics and the served-shape profile. Nobody else knows it."""

    def is_warmup(self, request: web.Request) -> bool:
        return secrets.compare_digest(request.headers.get(WARMUP_HEADER, ""), self.warmup_token)

    @property
    def idle(self) -> bool:
        return self.in_flight == 0 and (self.engine is None or self.engine.idle)

    def admit(self, warmup: bool = False) -> Engine:
        """Let one embedding request in, or refuse it at once (503 not ready, 429 overloaded).
        The server's own warmup requests are let in while it warms."""
        lifecycle = self.lifecycle
        accepts = lifecycle.accepts_embeddings or (warmup and lifecycle.phase == WARMING)
        if not accepts or self.engine is None:
            self.metrics.rejected.labels(reason="not_ready").inc()
            detail = f": {lifecycle.error}" if lifecycle.error else ""
            progress = f" ({len(lifecycle.warmed)}/{len(lifecycle.planned)} shapes warm)"
            raise Refused(
                503,
                f"the model is not ready to serve (phase {lifecycle.phase}{progress}{detail}); "
                "retry when GET /ready answers 200",
                "unhealthy",
                "not_ready",
            )
        if self.in_flight >= self.config.max_concurrent_requests:
            self.metrics.rejected.labels(reason="overloaded").inc()
            raise Refused(
                429,
                f"overloaded: {self.in_flight} requests in flight, the limit is "
                f"{self.config.max_concurrent_requests}; retry later",
                "overloaded",
                "overloaded",
            )
        self.in_flight += 1
        self.metrics.in_flight.set(self.in_flight)
        return self.engine

    def release(self) -> None:
        self.in_flight -= 1
        self.metrics.in_flight.set(self.in_flight)


RUNTIME = web.AppKey("runtime", Runtime)
WARMUP_HEADER = "X-Warmgate-Warmup"
