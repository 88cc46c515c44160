"""How long a request for a service with no warm pod is held, from how long the service takes to
warm as the operator measured it: `status.scaleToZero.wakeSeconds` (its last wake from zero, or
its first start), else `status.startupSeconds` (its slowest pod's load and warmup).

A held request goes out the moment a pod is warm, so a long hold costs nothing when the pod is
quick; a short one turns a slow wake into 503s. So the hold is never shorter than
--hold-seconds, and a measured service is held 1.5 times its time to warm plus 30 s, counted
from the start of the wake under way, up to --max-hold-seconds and the client's own timeout
(the OpenAI SDK sends it: X-Stainless-Read-Timeout). A service expected to take longer than
that gets a 503 at once, with Retry-After saying when it should be warm.

Pure: the clock, the service and the client's timeout are arguments.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from warmgate_contract.names import (
    AWAKE_AT_FIELD,
    STARTUP_SECONDS_FIELD,
    WAKE_SECONDS_FIELD,
    WAKE_STATUS,
    WOKE_AT_FIELD,
)

HOLD_FACTOR = 1.5
"""A wake may take this many times the measured one (another node, a busier registry)."""
HOLD_MARGIN_SECONDS = 30.0
"""...plus this: scheduling, the warm gate's verdict, the EndpointSlice reaching the router."""
CLIENT_TIMEOUT_HEADER = "X-Stainless-Read-Timeout"
"""The OpenAI SDK's (and LangChain's and LlamaIndex's, through it) read timeout, in seconds."""
CLIENT_SLACK_SECONDS = 1.0
"""A hold bounded by the client's timeout ends this long before it, so that the client reads
the 503 and its Retry-After instead of timing out."""
DEFAULT_RETRY_AFTER = 5
"""Retry-After when no wake is measured, or the one under way is already late (and for the
router's other 503s: a replica stopping, no pod taking a connection)."""


@dataclass(frozen=True)
class Measured:
    """A service's time to warm, and which status field says so."""

    seconds: float
    field: str
    """`status.scaleToZero.wakeSeconds` or `status.startupSeconds`, for messages."""


def _seconds(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and value >= 0 else None


def time_to_warm(service: Mapping[str, Any]) -> Measured | None:
    """How long `service` took to warm, as its status says; None: not measured yet."""
    status = service.get("status") or {}
    wake = _seconds((status.get(WAKE_STATUS) or {}).get(WAKE_SECONDS_FIELD))
    if wake is not None:
        return Measured(wake, f"status.{WAKE_STATUS}.{WAKE_SECONDS_FIELD}")
    startup = _seconds(status.get(STARTUP_SECONDS_FIELD))
    if startup is not None:
        return Measured(startup, f"status.{STARTUP_SECONDS_FIELD}")
    return None


def _unix(stamp: Any) -> float | None:
    if not isinstance(stamp, str):
        return None
    try:
        moment = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment.timestamp() if moment.tzinfo is not None else None


def waking_for(service: Mapping[str, Any], now: float) -> float | None:
    """Seconds since the wake under way began (spec.replicas left 0 and no pod has served
    since, as the operator recorded it); None when none is under way. `now`: Unix time."""
    replicas = (service.get("spec") or {}).get("replicas")
    if not isinstance(replicas, int) or replicas < 1:
        return None  # at zero: a recorded wake without awakeAt is one that never finished
    history = (service.get("status") or {}).get(WAKE_STATUS) or {}
    began = _unix(history.get(WOKE_AT_FIELD))
    if began is None or history.get(AWAKE_AT_FIELD):
        return None
    return max(0.0, now - began)


def client_timeout(value: str | None) -> float | None:
    """The client's own read timeout, from its CLIENT_TIMEOUT_HEADER (seconds); None when it
    sends none, or nonsense."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds > 0 else None


@dataclass(frozen=True)
class Hold:
    """How long one request may be held, from its arrival."""

    seconds: float
    bound: str
    """What set `seconds`, for messages: a flag, the measured time, or the client."""
    measured: Measured | None = None
    expected: float | None = None
    """Seconds from the arrival until a pod should be warm (the measured time less what the
    wake under way has taken already); None: not measured."""
    waking: bool = False
    """The service is at zero (this request wakes it) or a wake from zero is under way."""

    @property
    def hopeless(self) -> bool:
        """A pod is expected only after the hold ends: answer at once, with Retry-After."""
        return self.expected is not None and self.expected > self.seconds

    def retry_after(self, elapsed: float = 0.0) -> int:
        """Retry-After `elapsed` seconds after the arrival: when a pod should be warm."""
        if self.expected is None or self.expected - elapsed <= 0:
            return DEFAULT_RETRY_AFTER
        return max(1, math.ceil(self.expected - elapsed))


def plan_hold(
    service: Mapping[str, Any],
    hold_seconds: float,
    ceiling: float,
    now: float,
    client_seconds: float | None = None,
) -> Hold:
    """The hold of a request arriving at `now` (Unix time) for `service`, which has no warm
    pod: --hold-seconds while its time to warm is not measured; else HOLD_FACTOR times that
    plus HOLD_MARGIN_SECONDS, less what the wake under way has taken, never less than
    --hold-seconds nor more than `ceiling` (--max-hold-seconds); and never past the client's
    own timeout (`client_seconds`), less CLIENT_SLACK_SECONDS. --hold-seconds 0 holds
    nothing, measured or not."""
    measured = time_to_warm(service)
    woken = waking_for(service, now)
    waking = woken is not None or (service.get("spec") or {}).get("replicas") == 0
    seconds, bound = hold_seconds, f"--hold-seconds {hold_seconds:g}"
    expected = None
    if measured is not None:
        elapsed = woken or 0.0
        expected = max(0.0, measured.seconds - elapsed)
        wanted = HOLD_FACTOR * measured.seconds + HOLD_MARGIN_SECONDS - elapsed
        if wanted > hold_seconds > 0:
            seconds = wanted
            bound = (
                f"{HOLD_FACTOR:g} x its {measured.seconds:.0f} s to warm "
                f"+ {HOLD_MARGIN_SECONDS:.0f} s"
            )
    if seconds > ceiling:
        seconds, bound = ceiling, f"--max-hold-seconds {ceiling:g}"
    if client_seconds is not None and client_seconds - CLIENT_SLACK_SECONDS < seconds:
        seconds = max(0.0, client_seconds - CLIENT_SLACK_SECONDS)
        bound = f"the client's own timeout, {CLIENT_TIMEOUT_HEADER} {client_seconds:g}"
    return Hold(seconds, bound, measured, expected, waking)
