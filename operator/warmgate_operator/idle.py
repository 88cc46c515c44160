"""Scale to zero (`autoscaling.scaleToZero`), the operator's half: when an EmbeddingService
has seen no activity for `idleSeconds`, reconcile sets its spec.replicas to 0; warmgate-router
sets it back to 1 for the next request and holds that request until a pod is warm.

Activity is the latest of: the last request warmgate-router forwarded (the annotation it
writes, at most every few seconds), the service's last wake from zero, the moment a pod first
served after its creation or that wake, and the service's creation. While it is starting (no
pod has served since its creation or its last wake) a service is never idle, unless its pods
are failing: a first pod may take longer to load and warm than idleSeconds, and the router
holds the requests that woke it meanwhile; a service whose pods cannot start is not kept up.

Pure: the clock is an argument. The status fields that record a wake live here too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from warmgate_contract.names import (
    AWAKE_AT_FIELD,
    LAST_REQUEST_ANNOTATION,
    ROUTER_NAME,
    WAKE_SECONDS_FIELD,
    WAKE_STATUS,
    WOKE_AT_FIELD,
)
from warmgate_kube.objects import condition, parse_time, rfc3339


def parse_stamp(value: Any) -> float | None:
    """An RFC 3339 time as Unix time: `Z` (as the API and warmgate-router write it) or an
    explicit offset; None when it is not one."""
    found = parse_time(value)
    if found is not None or not isinstance(value, str):
        return found
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        return None
    return moment.timestamp() if moment.tzinfo is not None else None


def stamp(now: float) -> str:
    return rfc3339(datetime.fromtimestamp(now, UTC))


@dataclass(frozen=True)
class Activity:
    """The moments that count as use of one EmbeddingService (Unix time; None: never)."""

    last_request: float | None = None
    woke: float | None = None
    awake: float | None = None
    created: float | None = None
    starting: bool = False
    """No pod has served since the service's creation or its last wake."""

    @property
    def latest(self) -> float | None:
        moments = [m for m in (self.last_request, self.woke, self.awake, self.created) if m]
        return max(moments) if moments else None

    @classmethod
    def of(cls, body: Mapping[str, Any]) -> Activity:
        """From the EmbeddingService with the status this reconcile computed (`zero_status`
        has recorded a wake, or a first pod serving, already)."""
        meta = body.get("metadata") or {}
        status = body.get("status") or {}
        history = status.get(WAKE_STATUS) or {}
        return cls(
            last_request=parse_stamp((meta.get("annotations") or {}).get(LAST_REQUEST_ANNOTATION)),
            woke=parse_stamp(history.get(WOKE_AT_FIELD)),
            awake=parse_stamp(history.get(AWAKE_AT_FIELD)),
            created=parse_stamp(meta.get("creationTimestamp")),
            starting=not history.get(AWAKE_AT_FIELD),
        )


@dataclass(frozen=True)
class IdleDecision:
    scale_to_zero: bool
    idle_seconds: float
    """How long the service has been idle (0 when it is not counted)."""
    recheck_after: float | None
    """When the idle window would end if nothing happens (reconcile again then); None when no
    clock runs (no scaleToZero, at zero already, or starting: a pod serving or failing changes
    the status, and that reconciles again)."""


def decide(
    idle_limit: int | None, at_zero: bool, activity: Activity, now: float, failing: bool = False
) -> IdleDecision:
    """Whether to scale to zero now. `idle_limit`: autoscaling.scaleToZero.idleSeconds (None:
    no scale to zero); `at_zero`: spec.replicas is 0 already; `failing`: its pods will not get
    better on their own (the status says Degraded)."""
    if idle_limit is None or at_zero:
        return IdleDecision(False, 0.0, None)
    latest = activity.latest
    idle = 0.0 if latest is None else max(0.0, now - latest)
    if activity.starting and not failing:
        return IdleDecision(False, idle, None)
    if idle >= idle_limit:
        return IdleDecision(True, idle, None)
    return IdleDecision(False, idle, idle_limit - idle)


def scaled_event_message(idle_seconds: float, idle_limit: int) -> str:
    return (
        f"no request for {idle_seconds:.0f} s (autoscaling.scaleToZero.idleSeconds "
        f"{idle_limit}): spec.replicas set to 0; a request through {ROUTER_NAME} scales it "
        f"back to 1"
    )


def asleep_message(previous: Mapping[str, Any], activity: Activity, now: float) -> str:
    """The Ready condition's message while at zero: stable from one reconcile to the next
    (both times it is computed from are recorded), so it costs no status write."""
    since = parse_stamp(previous.get("scaledToZeroAt")) or now
    idle = max(0.0, since - (activity.latest or since))
    return (
        f"scaled to zero after {idle:.0f} s without requests; a request through {ROUTER_NAME} "
        f"scales it back to 1"
    )


def zero_status(
    previous: Mapping[str, Any],
    configured: bool,
    at_zero: bool,
    serving: int,
    now: float,
    first_pod_created: float | None = None,
) -> dict[str, Any]:
    """The status fields of scale to zero: `scaledToZeroAt` while at zero (when first seen
    there), and `scaleToZero` with the last wake (`lastWokeAt`, when spec.replicas left 0),
    `awakeAt` (when a pod first served after the creation or that wake) and `wakeSeconds`
    (how long the last wake took: what warmgate-router sizes its hold from). Nothing without
    scaleToZero.

    `first_pod_created`: when the oldest Ready pod was created. A service's first start is
    timed from it, but only when this reconcile sees the service go from no serving pod to
    one (the previous status says 0): a service that served before scaleToZero was set has
    old pods, whose age is no time to warm."""
    if not configured:
        return {}
    history = dict(previous.get(WAKE_STATUS) or {})
    fields: dict[str, Any] = {}
    if at_zero:
        fields["scaledToZeroAt"] = previous.get("scaledToZeroAt") or stamp(now)
    else:
        if previous.get("scaledToZeroAt"):
            # A new wake: its own times; the last one measured stands until it is over.
            measured = {k: v for k, v in history.items() if k == WAKE_SECONDS_FIELD}
            history = {WOKE_AT_FIELD: stamp(now), **measured}
        if not history.get(AWAKE_AT_FIELD) and serving > 0:
            history[AWAKE_AT_FIELD] = stamp(now)
            began = parse_stamp(history.get(WOKE_AT_FIELD))
            if began is None and previous.get("servingReplicas") == 0:
                began = first_pod_created
            awake = parse_stamp(history[AWAKE_AT_FIELD])
            if began is not None and awake is not None:
                history[WAKE_SECONDS_FIELD] = max(0, round(awake - began))
    if history:
        fields[WAKE_STATUS] = history
    return fields


def first_pod_created(pods: Iterable[Mapping[str, Any]]) -> float | None:
    """When the oldest Ready, not terminating pod was created (Unix time; None: none is)."""
    created = [
        parse_stamp((pod.get("metadata") or {}).get("creationTimestamp"))
        for pod in pods
        if not (pod.get("metadata") or {}).get("deletionTimestamp")
        and (condition(pod, "Ready") or {}).get("status") == "True"
    ]
    found = [moment for moment in created if moment is not None]
    return min(found) if found else None
