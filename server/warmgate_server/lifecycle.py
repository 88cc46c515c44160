"""The server's lifecycle: phase, warmup progress and the /ready report (docs/contract.md)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from warmgate_contract.flags import DEFAULTS
from warmgate_contract.report import (
    DOWNLOADING,
    DRAINING,
    FAILED,
    LOADING,
    READY,
    UNHEALTHY,
    WARMING,
    MemoryReport,
    ReadyReport,
    WarmedShape,
)
from warmgate_contract.shapes import Shape


@dataclass
class Lifecycle:
    """Mutable state, touched only on the event loop."""

    model_id: str
    revision: str
    served_name: str
    device: str
    dtype: str
    planned: tuple[Shape, ...]
    workers: int | None = None
    """Model workers (forward passes at once); known once the model is loaded."""
    torch_threads: int | None = None
    """torch threads per worker."""
    model_settings: dict[str, object] | None = None
    """Pooling, normalisation and prompts as chosen at load (model_folder.ModelSettings)."""
    forward: Callable[[], dict[str, object]] | None = None
    """How forward passes run (Workers.forward_report), once the model is loaded."""
    commit: str | None = None
    """The hub commit of the files loaded (None: a plain folder)."""
    weights_digest: str | None = None
    download: dict[str, int] | None = None
    """Bytes done and in all while the model downloads (kept afterwards)."""
    phase: str = LOADING
    error: str | None = None
    failure_reason: str | None = None
    """With phase failed, the reason the operator tells apart (WarmupMemoryExceeded)."""
    memory: MemoryReport | None = None
    """What the warmup measured of memory (and what it cut), once it began."""
    warmed: dict[Shape, WarmedShape] = field(default_factory=dict)
    warmup_seconds: float | None = None
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    pid: int = field(default_factory=os.getpid)
    failed_event: asyncio.Event = field(default_factory=asyncio.Event)
    started_monotonic: float = field(default_factory=time.monotonic)
    on_phase: Callable[[str], None] | None = None
    fault_threshold: int = DEFAULTS["fault_threshold"]
    """Model faults in a row that make a ready server unhealthy (--fault-threshold)."""
    fault_restart_seconds: float = DEFAULTS["fault_restart_seconds"]
    """How long unhealthy may last before liveness fails (--fault-restart-seconds)."""
    fault_streak: int = 0
    unhealthy_since: float | None = None

    @property
    def is_ready(self) -> bool:
        return self.phase == READY

    @property
    def accepts_embeddings(self) -> bool:
        """Serving continues while draining (in-flight clients and late arrivals get answers)
        and while unhealthy (the next forward pass may well succeed; kubelet takes the pod out
        of the endpoints meanwhile)."""
        return self.phase in (READY, UNHEALTHY, DRAINING)

    @property
    def live(self) -> bool:
        """False once the model has been unhealthy for --fault-restart-seconds: /healthz fails
        and kubelet restarts the container (a fresh process, a fresh CUDA context)."""
        if self.unhealthy_since is None:
            return True
        return time.monotonic() - self.unhealthy_since < self.fault_restart_seconds

    def model_fault(self, error: str, hung: bool = False) -> None:
        """A forward pass for traffic (or the health probe) raised or hung."""
        self.fault_streak += 1
        if self.fault_streak >= self.fault_threshold and self.phase == READY:
            self.unhealthy_since = time.monotonic()
            self.error = (
                f"model faults: {self.fault_streak} forward passes in a row failed or hung; "
                f"the last: {error}"
            )
            self.enter(UNHEALTHY)

    def model_ok(self) -> None:
        """A forward pass succeeded: the streak ends, an unhealthy server is ready again."""
        self.fault_streak = 0
        if self.unhealthy_since is not None:
            self.unhealthy_since = None
            if self.phase == UNHEALTHY:
                self.error = None
                self.enter(READY)

    def enter(self, phase: str) -> None:
        self.phase = phase
        if self.on_phase is not None:
            self.on_phase(phase)

    @property
    def started(self) -> bool:
        """The start has ended: loaded and warmed, or failed (the startup probe's answer)."""
        return self.phase not in (DOWNLOADING, LOADING, WARMING)

    def fail(self, error: str, reason: str | None = None, restartable: bool = True) -> None:
        """The start failed. `restartable`: the process exits (its container restarts, and may
        do better: a download that broke); else it stays up, reporting why on /ready and
        started on /started, so its pod is not restarted into the same failure over and over
        (a plan that does not fit in memory)."""
        self.error = error
        self.failure_reason = reason
        self.enter(FAILED)
        if restartable:
            self.failed_event.set()

    def begin_drain(self) -> None:
        if self.phase != FAILED:
            self.enter(DRAINING)
            self.unhealthy_since = None  # draining: a restart would gain nothing

    def report(self) -> dict[str, object]:
        """The /ready body (the contract's ReadyReport): the same keys in every phase."""
        return ReadyReport(
            phase=self.phase,
            model_id=self.model_id,
            revision=self.revision,
            served_name=self.served_name,
            device=self.device,
            dtype=self.dtype,
            planned=self.planned,
            warmed=tuple(self.warmed.values()),
            warmup_seconds=self.warmup_seconds,
            error=self.error,
            started_at=self.started_at.strftime("%Y-%m-%dT%H:%M:%SZ"),
            pid=self.pid,
            workers=self.workers,
            torch_threads=self.torch_threads,
            model_settings=self.model_settings,
            forward=None if self.forward is None else self.forward(),
            commit=self.commit,
            weights_digest=self.weights_digest,
            download=self.download,
            memory=self.memory,
            failure_reason=self.failure_reason,
        ).to_json()
