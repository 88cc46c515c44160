"""What the cluster tests and benchmarks share: waiting with a deadline (never a bare sleep),
reading objects as JSON through kubectl, and finding a condition."""

from __future__ import annotations

import json
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


def get_json(cluster: Any, *args: str) -> dict[str, Any] | None:
    """`kubectl get ARGS -o json` through `cluster.kubectl`; None when the object is not found."""
    result = cluster.kubectl("get", *args, "-o", "json", check=False)
    if result.returncode != 0:
        if "NotFound" in result.stderr:
            return None
        raise AssertionError(f"kubectl get {' '.join(args)}: {result.stderr}")
    return json.loads(result.stdout)


def condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    """The status condition of type `kind` ({} when absent)."""
    for item in ((obj or {}).get("status") or {}).get("conditions") or []:
        if item.get("type") == kind:
            return item
    return {}
