"""Model faults: what counts as one, and a test-only way to cause them for real.

A fault is a forward pass that raised (a CUDA error, an out-of-memory) or ran past
`--forward-timeout`. The scheduler reports each to the lifecycle, which turns `/ready` 503 after
`--fault-threshold` in a row and `/healthz` 503 once that lasts `--fault-restart-seconds`.

`FaultInjector` wraps the model's forward pass: with `--fault-injection` (or its twin
`WARMGATE_FAULT_INJECTION=1`, which an EmbeddingService's env may set) the server serves
`POST /debug/faults`, which makes every following forward pass
raise, run out of GPU memory (`torch.cuda.OutOfMemoryError`, which a CPU never raises), or
sleep, until it is switched off. Without it there is no such route and the injector
does nothing. Tests and chaos drills use it; nothing else should.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from warmgate_contract.shapes import Shape

MODES = ("off", "raise", "oom", "hang")


class InjectedFault(RuntimeError):
    """What an injected `raise` fault raises in the model thread."""


@dataclass
class FaultInjector:
    mode: str = "off"
    hang_seconds: float = 3600.0
    remaining: int | None = None
    """Faults left before the injector switches itself off (None: until switched off)."""
    shape: Shape | None = None
    """Only forward passes of this shape fault (None: every one)."""
    injected: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _released: threading.Event = field(default_factory=threading.Event)

    def set(
        self,
        mode: str,
        count: int | None = None,
        hang_seconds: float | None = None,
        shape: Shape | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}")
        with self._lock:
            self.mode = mode
            self.remaining = count
            self.shape = shape
            if hang_seconds is not None:
                self.hang_seconds = hang_seconds
            # Switching off (or to another mode) lets passes hanging now return.
            self._released.set()
            self._released = threading.Event()

    def state(self) -> dict[str, object]:
        return {
            "mode": self.mode,
            "remaining": self.remaining,
            "hang_seconds": self.hang_seconds,
            "shape": None if self.shape is None else self.shape.key,
            "injected": self.injected,
        }

    def before_forward(self, shape: Shape) -> None:
        """Called in the model thread before each forward pass, of `shape`."""
        with self._lock:
            mode = self.mode
            if mode == "off" or self.shape not in (None, shape):
                return
            self.injected += 1
            if self.remaining is not None:
                self.remaining -= 1
                if self.remaining <= 0:
                    self.mode, self.remaining = "off", None
            released, seconds = self._released, self.hang_seconds
        if mode == "raise":
            raise InjectedFault(
                "injected fault: CUDA error: an illegal memory access was encountered"
            )
        if mode == "oom":  # the class a CUDA allocation raises, which warmup tells apart
            import torch

            raise torch.cuda.OutOfMemoryError(
                f"injected fault: CUDA out of memory running shape {shape.key}. "
                "Tried to allocate 2.00 GiB"
            )
        released.wait(seconds)
