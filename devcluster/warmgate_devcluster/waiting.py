"""Waiting on a cluster with a deadline, never a bare sleep: the tests and benchmarks share it."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def wait_until(
    probe: Callable[[], T | None], timeout: float = 60.0, what: str = "", every: float = 0.5
) -> T:
    """Call `probe` every `every` seconds until it returns something truthy, and return that;
    fail naming `what` (and the last value seen) once `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(
        f"timed out after {timeout:.0f}s waiting for {what or probe} (last: {last!r})"
    )
