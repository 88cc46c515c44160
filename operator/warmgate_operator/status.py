"""The status reducer: observed children in, `EmbeddingService.status` out. Pure.

Gather (reconcile reads the Deployment and the pods), evaluate (this module), compare and write
only when different (reconcile). `lastTransitionTime` is kept while a condition's status holds,
so computing the same status twice gives equal dicts and no write.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from .builders import (
    MODEL_ID_ANNOTATION,
    MODEL_REVISION_ANNOTATION,
    SERVER_CONTAINER,
    WARMED_CONDITION,
    selector_string,
)
from .spec import EmbeddingServiceSpec

# Waiting reasons that will not fix themselves: a person should look.
FAILING_WAIT_REASONS = frozenset(
    {
        "CrashLoopBackOff",
        "ImagePullBackOff",
        "ErrImagePull",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
    }
)
# Fields other writers own (the observed-traffic timer); the reducer carries them over.
CARRIED_FIELDS = ("observedShapes", "warmupSeconds")


@dataclass(frozen=True)
class Problem:
    """Something reconcile could not do, surfaced as Degraded (and Ready=False if blocking)."""

    reason: str
    message: str
    blocking: bool = False


@dataclass(frozen=True)
class Condition:
    type: str
    status: str
    reason: str
    message: str


def _get(obj: Mapping[str, Any] | None, *path: str, default: Any = None) -> Any:
    value: Any = obj
    for key in path:
        if not isinstance(value, Mapping):
            return default
        value = value.get(key)
    return default if value is None else value


def _condition(obj: Mapping[str, Any] | None, type_: str) -> Mapping[str, Any] | None:
    for cond in _get(obj, "status", "conditions", default=[]):
        if cond.get("type") == type_:
            return cond
    return None


def is_pod_warmed(pod: Mapping[str, Any]) -> bool:
    cond = _condition(pod, WARMED_CONDITION)
    return cond is not None and cond.get("status") == "True"


def is_pod_ready(pod: Mapping[str, Any]) -> bool:
    cond = _condition(pod, "Ready")
    return cond is not None and cond.get("status") == "True"


def _epoch(timestamp: Any) -> float | None:
    try:
        moment = datetime.strptime(str(timestamp), "%Y-%m-%dT%H:%M:%SZ")
    except ValueError:
        return None
    return moment.replace(tzinfo=UTC).timestamp()


def startup_seconds(pod: Mapping[str, Any]) -> float | None:
    """How long the pod's server took from its container's start to its probe passing
    (loading and warming): what the startup probe's budget must cover. None until it has."""
    ready = _condition(pod, "ContainersReady")
    if ready is None or ready.get("status") != "True":
        return None
    for status in _get(pod, "status", "containerStatuses", default=[]):
        if status.get("name") == SERVER_CONTAINER:
            started = _epoch(_get(status, "state", "running", "startedAt"))
            became_ready = _epoch(ready.get("lastTransitionTime"))
            if started is not None and became_ready is not None and became_ready >= started:
                return became_ready - started
    return None


def slowest_startup(pods: Iterable[Mapping[str, Any]]) -> float | None:
    measured = [s for s in map(startup_seconds, pods) if s is not None]
    return max(measured) if measured else None


def _live(pods: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [p for p in pods if not _get(p, "metadata", "deletionTimestamp")]


def _failing_pod(pods: Sequence[Mapping[str, Any]]) -> str | None:
    for pod in pods:
        gate = _condition(pod, WARMED_CONDITION)
        if (
            gate is not None
            and gate.get("status") == "False"
            and gate.get("reason")
            in (
                "WarmupFailed",
                "ModelMismatch",
                "RevisionMismatch",
            )
        ):
            name = _get(pod, "metadata", "name", default="?")
            return f"pod {name}: {gate['reason']}: {gate.get('message') or ''}".strip()
        for cs in _get(pod, "status", "containerStatuses", default=[]):
            waiting = _get(cs, "state", "waiting")
            if waiting and waiting.get("reason") in FAILING_WAIT_REASONS:
                detail = waiting.get("message") or ""
                name = _get(pod, "metadata", "name", default="?")
                reason = waiting["reason"]
                return f"pod {name}: container {cs.get('name')} {reason} {detail}".strip()
    return None


def _serving_model(pods: Sequence[Mapping[str, Any]]) -> dict[str, str] | None:
    """The model most ready pods serve, read from their template annotations."""
    counts = Counter(
        (
            _get(p, "metadata", "annotations", MODEL_ID_ANNOTATION),
            _get(p, "metadata", "annotations", MODEL_REVISION_ANNOTATION),
        )
        for p in pods
        if is_pod_ready(p)
    )
    counts.pop((None, None), None)
    if not counts:
        return None
    (model_id, revision), _ = counts.most_common(1)[0]
    return {"id": model_id or "", "revision": revision or ""}


def evaluate(
    spec: EmbeddingServiceSpec | None,
    name: str,
    deployment: Mapping[str, Any] | None,
    pods: Iterable[Mapping[str, Any]],
    problem: Problem | None = None,
) -> tuple[dict[str, Any], list[Condition]]:
    """Counts and conditions, without times or generations."""
    live = _live(pods)
    dep_status = _get(deployment, "status", default={})
    if deployment is not None and _get(deployment, "spec", "replicas") is not None:
        desired = int(deployment["spec"]["replicas"])
    else:
        desired = spec.replicas if spec is not None else 0
    replicas = int(dep_status.get("replicas") or 0)
    ready = int(dep_status.get("readyReplicas") or 0)
    updated = int(dep_status.get("updatedReplicas") or 0)
    available = int(dep_status.get("availableReplicas") or 0)
    warmed = sum(1 for p in live if is_pod_warmed(p))
    gate_on = spec.rollout.warm_gate if spec is not None else True

    counts: dict[str, Any] = {
        "replicas": replicas,
        "desiredReplicas": desired,
        "readyReplicas": ready,
        "updatedReplicas": updated,
        "availableReplicas": available,
        "warmedReplicas": warmed,
        "readySummary": f"{ready}/{desired}",
        "selector": selector_string(name),
    }
    model = _serving_model(live)
    if model is not None:
        counts["model"] = model

    dep_current = deployment is not None and int(dep_status.get("observedGeneration") or 0) >= int(
        _get(deployment, "metadata", "generation", default=0)
    )
    dep_progressing = _condition(deployment, "Progressing")
    deadline_exceeded = (
        dep_progressing is not None
        and dep_progressing.get("status") == "False"
        and dep_progressing.get("reason") == "ProgressDeadlineExceeded"
    )
    replica_failure = _condition(deployment, "ReplicaFailure")
    rollout_done = (
        dep_current
        and updated >= desired
        and replicas <= updated
        and available >= updated
        and ready >= desired
    )
    failing = _failing_pod(live)

    # Degraded: something a person should act on.
    if problem is not None:
        degraded = Condition("Degraded", "True", problem.reason, problem.message)
    elif deadline_exceeded:
        degraded = Condition(
            "Degraded",
            "True",
            "ProgressDeadlineExceeded",
            dep_progressing.get("message") or "the rollout stopped making progress",
        )
    elif replica_failure is not None and replica_failure.get("status") == "True":
        degraded = Condition(
            "Degraded", "True", "ReplicaFailure", replica_failure.get("message") or ""
        )
    elif failing is not None:
        degraded = Condition("Degraded", "True", "PodsFailing", failing)
    else:
        degraded = Condition("Degraded", "False", "AsExpected", "")

    # Progressing: is the Deployment moving towards the spec?
    if deployment is None:
        progressing = Condition("Progressing", "True", "Creating", "creating the Deployment")
    elif deadline_exceeded:
        progressing = Condition(
            "Progressing",
            "False",
            "ProgressDeadlineExceeded",
            f"{updated}/{desired} pods updated, {ready} ready; old pods keep serving",
        )
    elif rollout_done:
        progressing = Condition(
            "Progressing", "False", "RolloutComplete", f"{ready}/{desired} pods updated and ready"
        )
    else:
        progressing = Condition(
            "Progressing",
            "True",
            "RolloutInProgress",
            f"{updated}/{desired} pods updated, {ready} ready, {warmed} warmed",
        )

    # Warmed: have the pods' warmups been verified by the gate?
    if not gate_on:
        warmed_cond = Condition(
            "Warmed", "Unknown", "WarmGateDisabled", "spec.rollout.warmGate is false"
        )
    elif desired == 0:
        warmed_cond = Condition("Warmed", "True", "ScaledToZero", "no pods are wanted")
    elif warmed >= desired:
        warmed_cond = Condition(
            "Warmed", "True", "AllReplicasWarmed", f"{warmed}/{desired} pods warmed"
        )
    else:
        warmed_cond = Condition(
            "Warmed", "False", "WaitingForWarmup", f"{warmed}/{desired} pods warmed"
        )

    # Ready: the current spec is fully served.
    if problem is not None and problem.blocking:
        ready_cond = Condition("Ready", "False", problem.reason, problem.message)
    elif deployment is None:
        ready_cond = Condition("Ready", "False", "Creating", "creating the Deployment")
    elif desired == 0 and rollout_done:
        ready_cond = Condition("Ready", "True", "ScaledToZero", "no pods are wanted")
    elif rollout_done:
        ready_cond = Condition("Ready", "True", "AllReplicasReady", f"{ready}/{desired} pods ready")
    elif deadline_exceeded:
        ready_cond = Condition("Ready", "False", "ProgressDeadlineExceeded", progressing.message)
    elif failing is not None:
        ready_cond = Condition("Ready", "False", "PodsFailing", failing)
    elif gate_on and warmed < desired and len(live) > 0:
        ready_cond = Condition(
            "Ready",
            "False",
            "WaitingForWarmup",
            f"{ready}/{desired} pods ready, {warmed} warmed, {updated} updated",
        )
    else:
        ready_cond = Condition(
            "Ready",
            "False",
            "RolloutInProgress" if ready >= desired else "ReplicasNotReady",
            f"{ready}/{desired} pods ready, {updated} updated",
        )
    return counts, [ready_cond, progressing, warmed_cond, degraded]


def merge_conditions(
    previous: Iterable[Mapping[str, Any]],
    conditions: Iterable[Condition],
    generation: int,
    now: str,
) -> list[dict[str, Any]]:
    """API-convention conditions; `lastTransitionTime` moves only when `status` changes."""
    before = {c.get("type"): c for c in previous}
    out = []
    for cond in conditions:
        old = before.get(cond.type)
        changed = old is None or old.get("status") != cond.status
        out.append(
            {
                "type": cond.type,
                "status": cond.status,
                "reason": cond.reason,
                "message": cond.message,
                "observedGeneration": generation,
                "lastTransitionTime": now if changed else old.get("lastTransitionTime", now),
            }
        )
    return out


def compute_status(
    spec: EmbeddingServiceSpec | None,
    body: Mapping[str, Any],
    deployment: Mapping[str, Any] | None,
    pods: Iterable[Mapping[str, Any]],
    now: str,
    problem: Problem | None = None,
) -> dict[str, Any]:
    """The whole `status` for `body` (the EmbeddingService as last seen)."""
    meta = body["metadata"]
    previous = body.get("status") or {}
    generation = int(meta.get("generation") or 0)
    pods = list(pods)
    counts, conditions = evaluate(spec, meta["name"], deployment, pods, problem)
    status: dict[str, Any] = {"observedGeneration": generation, **counts}
    for key in CARRIED_FIELDS:
        if key in previous:
            status[key] = previous[key]
    # The slowest start of the pods there now; the last one measured while none has started.
    slowest = slowest_startup(pods)
    if slowest is not None:
        status["startupSeconds"] = int(slowest)
    elif "startupSeconds" in previous:
        status["startupSeconds"] = previous["startupSeconds"]
    status["conditions"] = merge_conditions(
        previous.get("conditions") or [], conditions, generation, now
    )
    return status


def newly_degraded(
    previous: Mapping[str, Any], status: Mapping[str, Any]
) -> Mapping[str, Any] | None:
    """The Degraded condition when it has just turned True or changed its reason, else None:
    the moment a person should get an Event, once, not on every reconcile."""
    now = next((c for c in status.get("conditions") or [] if c["type"] == "Degraded"), None)
    if now is None or now.get("status") != "True":
        return None
    before = _condition({"status": previous}, "Degraded")
    if before is not None and before.get("status") == "True":
        return None if before.get("reason") == now.get("reason") else now
    return now
