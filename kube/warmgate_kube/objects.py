"""Reading Kubernetes objects as plain dicts, in one place: conditions and timestamps."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any


def condition(obj: Mapping[str, Any] | None, condition_type: str) -> dict[str, Any] | None:
    """The object's `status.conditions` entry of `condition_type` (a copy), or None."""
    status = (obj or {}).get("status") or {}
    for item in status.get("conditions") or []:
        if item.get("type") == condition_type:
            return dict(item)
    return None


def parse_time(stamp: Any) -> float | None:
    """A Kubernetes timestamp (RFC 3339 in UTC: `Time`, or `MicroTime` with its fraction) as
    Unix time; None when it is not one."""
    if not isinstance(stamp, str) or not stamp.endswith("Z"):
        return None
    try:
        return datetime.fromisoformat(stamp[:-1]).replace(tzinfo=UTC).timestamp()
    except ValueError:
        return None


def rfc3339(moment: datetime | None = None) -> str:
    """`Time` as the API writes it (seconds): conditions, Events. Now, unless given."""
    return (moment or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")


def micro_time(moment: datetime | None = None) -> str:
    """`MicroTime` (a Lease's renewTime and acquireTime). Now, unless given."""
    return (moment or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
