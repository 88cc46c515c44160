"""The server's lifecycle: phase, warmup progress and the /ready report (docs/contract.md)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from warmgate_contract.report import DRAINING, FAILED, LOADING, READY, ReadyReport
from warmgate_contract.report import WarmedShape as ReportedShape
from warmgate_contract.shapes import Shape


@dataclass(frozen=True)
class WarmedShape:
    shape: Shape
    steady_ms: float
    runs: int
    seconds: float
    """Wall time spent warming this shape, first (cold) run included."""


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
    """Pooling, normalisation and prompts as chosen at load (modelconfig.ModelSettings)."""
    commit: str | None = None
    """The hub commit of the files loaded (None: a plain folder)."""
    weights_digest: str | None = None
    download: dict[str, int] | None = None
    """Bytes done and in all while the model downloads (kept afterwards)."""
    phase: str = LOADING
    error: str | None = None
    warmed: dict[Shape, WarmedShape] = field(default_factory=dict)
    warmup_seconds: float | None = None
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    pid: int = field(default_factory=os.getpid)
    failed_event: asyncio.Event = field(default_factory=asyncio.Event)
    started_monotonic: float = field(default_factory=time.monotonic)
    on_phase: Callable[[str], None] | None = None

    @property
    def is_ready(self) -> bool:
        return self.phase == READY

    @property
    def accepts_embeddings(self) -> bool:
        """Serving continues while draining: in-flight clients and late arrivals get answers."""
        return self.phase in (READY, DRAINING)

    def enter(self, phase: str) -> None:
        self.phase = phase
        if self.on_phase is not None:
            self.on_phase(phase)

    def fail(self, error: str) -> None:
        self.error = error
        self.enter(FAILED)
        self.failed_event.set()

    def begin_drain(self) -> None:
        if self.phase != FAILED:
            self.enter(DRAINING)

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
            warmed=tuple(
                ReportedShape(done.shape, done.steady_ms, done.runs)
                for done in self.warmed.values()
            ),
            warmup_seconds=self.warmup_seconds,
            error=self.error,
            started_at=self.started_at.strftime("%Y-%m-%dT%H:%M:%SZ"),
            pid=self.pid,
            workers=self.workers,
            torch_threads=self.torch_threads,
            model_settings=self.model_settings,
            commit=self.commit,
            weights_digest=self.weights_digest,
            download=self.download,
        ).to_json()
