"""The status reducer: observed children in, `EmbeddingService.status` out. Pure.

Gather (reconcile reads the Deployment and the pods), evaluate (this module), compare and write
only when different (reconcile). `lastTransitionTime` is kept while a condition's status holds,
so computing the same status twice gives equal dicts and no write.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from warmgate_contract.names import (
    MODEL_ID_ANNOTATION,
    MODEL_REVISION_ANNOTATION,
    REASON_FAILED,
    REASON_MEMORY_EXCEEDED,
    REASON_MODEL_MISMATCH,
    REASON_NAME_CONFLICT,
    REASON_REVISION_MISMATCH,
    REASON_SCALED_TO_ZERO,
    SERVER_CONTAINER,
    SPEC_HASH_ANNOTATION,
    WARMED_CONDITION,
)
from warmgate_kube.objects import condition, parse_time

from .builders import selector_string
from .gate import loaded_state, measured_memory
from .roles import Member, count
from .spec import EmbeddingServiceSpec

# Waiting reasons that will not fix themselves: a person should look.
FAILING_WAIT_REASONS = frozenset(
    {
        "CrashLoopBackOff",
        "ImagePullBackOff",
        "ErrImagePull",
        "ErrImageNeverPull",  # imagePullPolicy Never and the image is not on the node
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
    }
)
# Warm-gate verdicts that retrying will not change: the pod is failing, not warming.
PERMANENT_GATE_REASONS = frozenset(
    {REASON_FAILED, REASON_MEMORY_EXCEEDED, REASON_MODEL_MISMATCH, REASON_REVISION_MISMATCH}
)
LOW_HEADROOM = 0.10
"""Below this share of the limit left over the warmup's measured peak, MemoryPressure is True."""
# Fields other writers own (the observed-traffic timer); the reducer carries them over.
CARRIED_FIELDS = ("observedShapes", "warmupSeconds")


# Reasons of the problems reconcile reports (Degraded, Ready when blocking, and an Event).
INVALID_SPEC_REASON = "InvalidSpec"
CONFLICT_REASON = "ChildConflict"
APPLY_FAILED_REASON = "ApplyFailed"


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


def is_pod_warmed(pod: Mapping[str, Any]) -> bool:
    cond = condition(pod, WARMED_CONDITION)
    return cond is not None and cond.get("status") == "True"


def is_pod_ready(pod: Mapping[str, Any]) -> bool:
    cond = condition(pod, "Ready")
    return cond is not None and cond.get("status") == "True"


def startup_seconds(pod: Mapping[str, Any]) -> float | None:
    """How long the pod's server took from its container's start to its probe passing
    (loading and warming): what the startup probe's budget must cover. None until it has."""
    ready = condition(pod, "ContainersReady")
    if ready is None or ready.get("status") != "True":
        return None
    for status in _get(pod, "status", "containerStatuses", default=[]):
        if status.get("name") == SERVER_CONTAINER:
            started = parse_time(_get(status, "state", "running", "startedAt"))
            became_ready = parse_time(ready.get("lastTransitionTime"))
            if started is not None and became_ready is not None and became_ready >= started:
                return became_ready - started
    return None


def slowest_startup(pods: Iterable[Mapping[str, Any]]) -> float | None:
    measured = [s for s in map(startup_seconds, pods) if s is not None]
    return max(measured) if measured else None


def _live(pods: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [p for p in pods if not _get(p, "metadata", "deletionTimestamp")]


@dataclass(frozen=True)
class Failing:
    """A pod that will not get better on its own: why (a gate verdict's reason, or a waiting
    container's), and what a person reads."""

    reason: str
    message: str

    @property
    def status_reason(self) -> str:
        """The EmbeddingService's reason for it: a plan too big for memory says so, the rest
        is PodsFailing."""
        return self.reason if self.reason == REASON_MEMORY_EXCEEDED else "PodsFailing"


def _failing_pod(pods: Sequence[Mapping[str, Any]]) -> Failing | None:
    for pod in pods:
        name = _get(pod, "metadata", "name", default="?")
        gate = condition(pod, WARMED_CONDITION)
        if (
            gate is not None
            and gate.get("status") == "False"
            and gate.get("reason") in PERMANENT_GATE_REASONS
        ):
            message = f"pod {name}: {gate['reason']}: {gate.get('message') or ''}".strip()
            return Failing(gate["reason"], message)
        for cs in _get(pod, "status", "containerStatuses", default=[]):
            waiting = _get(cs, "state", "waiting")
            if waiting and waiting.get("reason") in FAILING_WAIT_REASONS:
                detail = waiting.get("message") or ""
                reason = waiting["reason"]
                message = f"pod {name}: container {cs.get('name')} {reason} {detail}".strip()
                return Failing(reason, message)
    return None


def serving_memory(pods: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """status.memory: of the verified pods, the one whose warmup peaked highest, its limit and
    the headroom between them (what `resources.limits.memory` is sized from)."""
    measured = [m for m in map(measured_memory, pods) if m is not None]
    if not measured:
        return None
    peak, limit = max(measured, key=lambda item: item[0])
    memory: dict[str, Any] = {"peakBytes": peak}
    if limit is not None:
        memory.update(
            limitBytes=limit,
            headroomBytes=limit - peak,
            headroomPercent=round(100.0 * (limit - peak) / limit, 1),
        )
    return memory


def memory_pressure_condition(memory: Mapping[str, Any] | None) -> Condition:
    """MemoryPressure: True when the serving pods' warmup left less than 10% of their memory
    limit free (a bigger request or a new shape could be killed)."""
    if memory is None or "limitBytes" not in memory:
        return Condition(
            "MemoryPressure",
            "Unknown",
            "NotMeasured",
            "no verified pod has measured its peak against a memory limit",
        )
    peak, limit = memory["peakBytes"], memory["limitBytes"]
    numbers = (
        f"the warmup's peak is {peak / 2**20:.0f} MiB of a {limit / 2**20:.0f} MiB limit "
        f"({memory['headroomPercent']}% left)"
    )
    if limit - peak < LOW_HEADROOM * limit:
        return Condition(
            "MemoryPressure",
            "True",
            "LowHeadroom",
            f"{numbers}: raise resources.limits.memory, or lower batching.maxBatchTokens",
        )
    return Condition("MemoryPressure", "False", "EnoughHeadroom", numbers)


def _serving_model(pods: Sequence[Mapping[str, Any]]) -> dict[str, str] | None:
    """The model most ready pods serve: id and revision from their template annotations, the
    commit and weights digest they loaded from the condition the gatekeeper records on each
    (warmgate.dev/warmed with the warm gate on, warmgate.dev/loaded with it off), and what
    those pods' servers do with it (the task their reports gave: embed, rerank, classify)."""
    served = []
    for p in pods:
        if not is_pod_ready(p):
            continue
        state = loaded_state(p)
        key = (
            _get(p, "metadata", "annotations", MODEL_ID_ANNOTATION),
            _get(p, "metadata", "annotations", MODEL_REVISION_ANNOTATION),
            (state.identity if state is not None else None) or (None, None),
        )
        served.append((key, state.task if state is not None else None))
    counts = Counter(key for key, _ in served)
    counts.pop((None, None, (None, None)), None)
    if not counts:
        return None
    top, _ = counts.most_common(1)[0]
    model_id, revision, (commit, digest) = top
    model = {"id": model_id or "", "revision": revision or ""}
    if commit:
        model["commit"] = commit
    if digest:
        model["weightsDigest"] = digest
    tasks = Counter(task for key, task in served if key == top and task)
    if tasks:
        model["task"] = tasks.most_common(1)[0][0]
    return model


@dataclass(frozen=True)
class Facts:
    """What the conditions are judged from: the Deployment's counts and conditions and the
    pods, gathered once."""

    deployment_exists: bool
    desired: int
    replicas: int
    ready: int
    updated: int
    available: int
    warmed: int
    live_pods: int
    gate_on: bool
    deployment_current: bool
    deadline_exceeded: bool
    deadline_message: str
    replica_failure: str | None
    failing: Failing | None
    problem: Problem | None
    asleep: str | None = None
    """Scaled to zero by autoscaling.scaleToZero: why, and how it wakes (idle.asleep_message)."""
    name_conflict: str | None = None
    """An older EmbeddingAlias holds this EmbeddingService's name: the message naming both."""

    @property
    def rollout_done(self) -> bool:
        return (
            self.deployment_current
            and self.updated >= self.desired
            and self.replicas <= self.updated
            and self.available >= self.updated
            and self.ready >= self.desired
        )

    @classmethod
    def gather(
        cls,
        spec: EmbeddingServiceSpec | None,
        deployment: Mapping[str, Any] | None,
        live: Sequence[Mapping[str, Any]],
        problem: Problem | None,
        asleep: str | None = None,
        name_conflict: str | None = None,
    ) -> Facts:
        dep_status = _get(deployment, "status", default={})
        if deployment is not None and _get(deployment, "spec", "replicas") is not None:
            desired = int(deployment["spec"]["replicas"])
        else:
            desired = spec.replicas if spec is not None else 0
        progressing = condition(deployment, "Progressing") or {}
        replica_failure = condition(deployment, "ReplicaFailure") or {}
        return cls(
            deployment_exists=deployment is not None,
            desired=desired,
            replicas=int(dep_status.get("replicas") or 0),
            ready=int(dep_status.get("readyReplicas") or 0),
            updated=int(dep_status.get("updatedReplicas") or 0),
            available=int(dep_status.get("availableReplicas") or 0),
            warmed=sum(1 for p in live if is_pod_warmed(p)),
            live_pods=len(live),
            gate_on=spec.rollout.warm_gate if spec is not None else True,
            deployment_current=deployment is not None
            and int(dep_status.get("observedGeneration") or 0)
            >= int(_get(deployment, "metadata", "generation", default=0)),
            deadline_exceeded=progressing.get("status") == "False"
            and progressing.get("reason") == "ProgressDeadlineExceeded",
            deadline_message=progressing.get("message") or "the rollout stopped making progress",
            replica_failure=(
                replica_failure.get("message") or ""
                if replica_failure.get("status") == "True"
                else None
            ),
            failing=_failing_pod(live),
            problem=problem,
            asleep=asleep,
            name_conflict=name_conflict,
        )


def degraded_condition(facts: Facts) -> Condition:
    """Degraded: something a person should act on."""
    if facts.problem is not None:
        return Condition("Degraded", "True", facts.problem.reason, facts.problem.message)
    if facts.asleep is not None:  # what the last pods did no longer matters
        return Condition("Degraded", "False", REASON_SCALED_TO_ZERO, "no pods are wanted")
    if facts.deadline_exceeded:
        return Condition("Degraded", "True", "ProgressDeadlineExceeded", facts.deadline_message)
    if facts.replica_failure is not None:
        return Condition("Degraded", "True", "ReplicaFailure", facts.replica_failure)
    if facts.failing is not None:
        return Condition("Degraded", "True", facts.failing.status_reason, facts.failing.message)
    return Condition("Degraded", "False", "AsExpected", "")


def conflict_condition(facts: Facts) -> Condition:
    """Conflict: an object of a child's name exists that this EmbeddingService does not own
    (another owner's, or nobody's); warmgate never takes it over. Or an older EmbeddingAlias
    holds its name: it serves through its own Service, but warmgate-router sends that name to
    the alias's target."""
    if facts.problem is not None and facts.problem.reason == CONFLICT_REASON:
        return Condition("Conflict", "True", "ChildExists", facts.problem.message)
    if facts.name_conflict is not None:
        return Condition("Conflict", "True", REASON_NAME_CONFLICT, facts.name_conflict)
    return Condition("Conflict", "False", "NoConflict", "")


def progressing_condition(facts: Facts) -> Condition:
    """Progressing: is the Deployment moving towards the spec?"""
    f = facts
    if not f.deployment_exists:
        return Condition("Progressing", "True", "Creating", "creating the Deployment")
    if f.asleep is not None:  # towards zero: no rollout can fail
        if f.replicas > 0:
            return Condition("Progressing", "True", "ScalingToZero", f"{f.replicas} pods stopping")
        return Condition("Progressing", "False", REASON_SCALED_TO_ZERO, "no pods are wanted")
    if f.deadline_exceeded:
        return Condition(
            "Progressing",
            "False",
            "ProgressDeadlineExceeded",
            f"{f.updated}/{f.desired} pods updated, {f.ready} ready; old pods keep serving",
        )
    if f.rollout_done:
        return Condition(
            "Progressing",
            "False",
            "RolloutComplete",
            f"{f.ready}/{f.desired} pods updated and ready",
        )
    return Condition(
        "Progressing",
        "True",
        "RolloutInProgress",
        f"{f.updated}/{f.desired} pods updated, {f.ready} ready, {f.warmed} warmed",
    )


def warmed_condition(facts: Facts) -> Condition:
    """Warmed: have the pods' warmups been verified by the gate?"""
    f = facts
    if not f.gate_on:
        return Condition("Warmed", "Unknown", "WarmGateDisabled", "spec.rollout.warmGate is false")
    if f.desired == 0:
        return Condition("Warmed", "True", "ScaledToZero", "no pods are wanted")
    if f.warmed >= f.desired:
        return Condition(
            "Warmed", "True", "AllReplicasWarmed", f"{f.warmed}/{f.desired} pods warmed"
        )
    return Condition("Warmed", "False", "WaitingForWarmup", f"{f.warmed}/{f.desired} pods warmed")


def ready_condition(facts: Facts) -> Condition:
    """Ready: the current spec is fully served."""
    f = facts
    if f.problem is not None and f.problem.blocking:
        return Condition("Ready", "False", f.problem.reason, f.problem.message)
    if f.asleep is not None:
        return Condition("Ready", "False", REASON_SCALED_TO_ZERO, f.asleep)
    if not f.deployment_exists:
        return Condition("Ready", "False", "Creating", "creating the Deployment")
    if f.desired == 0 and f.rollout_done:
        return Condition("Ready", "True", "ScaledToZero", "no pods are wanted")
    if f.rollout_done:
        return Condition("Ready", "True", "AllReplicasReady", f"{f.ready}/{f.desired} pods ready")
    if f.deadline_exceeded:
        return Condition(
            "Ready", "False", "ProgressDeadlineExceeded", progressing_condition(f).message
        )
    if f.failing is not None:
        return Condition("Ready", "False", f.failing.status_reason, f.failing.message)
    if f.gate_on and f.warmed < f.desired and f.live_pods > 0:
        return Condition(
            "Ready",
            "False",
            "WaitingForWarmup",
            f"{f.ready}/{f.desired} pods ready, {f.warmed} warmed, {f.updated} updated",
        )
    return Condition(
        "Ready",
        "False",
        "RolloutInProgress" if f.ready >= f.desired else "ReplicasNotReady",
        f"{f.ready}/{f.desired} pods ready, {f.updated} updated",
    )


def evaluate(
    spec: EmbeddingServiceSpec | None,
    name: str,
    deployment: Mapping[str, Any] | None,
    pods: Iterable[Mapping[str, Any]],
    problem: Problem | None = None,
    asleep: str | None = None,
    name_conflict: str | None = None,
) -> tuple[dict[str, Any], list[Condition]]:
    """Counts and conditions, without times or generations."""
    live = _live(pods)
    facts = Facts.gather(spec, deployment, live, problem, asleep, name_conflict)
    pool = spec is not None and spec.standby_replicas > 0
    template = _get(deployment, "spec", "template", "metadata", "annotations", default={})
    roles = count([Member.of(p, template.get(SPEC_HASH_ANNOTATION)) for p in live], pool)
    counts: dict[str, Any] = {
        "replicas": facts.replicas,
        "servingReplicas": roles.serving,
        "standbyReplicas": roles.standby,
        "desiredReplicas": facts.desired,
        "readyReplicas": facts.ready,
        "updatedReplicas": facts.updated,
        "availableReplicas": facts.available,
        "warmedReplicas": facts.warmed,
        "readySummary": f"{facts.ready}/{facts.desired}",
        "selector": selector_string(name, pool),
    }
    model = _serving_model(live)
    if model is not None:
        counts["model"] = model
    memory = serving_memory(live)
    if memory is not None:
        counts["memory"] = memory
    conditions = [
        ready_condition(facts),
        progressing_condition(facts),
        warmed_condition(facts),
        degraded_condition(facts),
        conflict_condition(facts),
        memory_pressure_condition(memory),
    ]
    return counts, conditions


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
    asleep: str | None = None,
    name_conflict: str | None = None,
) -> dict[str, Any]:
    """The whole `status` for `body` (the EmbeddingService as last seen). `asleep`: the Ready
    message while autoscaling.scaleToZero holds it at zero; `name_conflict`: why an older
    EmbeddingAlias holds its name (aliases.name_conflict)."""
    meta = body["metadata"]
    previous = body.get("status") or {}
    generation = int(meta.get("generation") or 0)
    pods = list(pods)
    counts, conditions = evaluate(
        spec, meta["name"], deployment, pods, problem, asleep, name_conflict
    )
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
    before = condition({"status": previous}, "Degraded")
    if before is not None and before.get("status") == "True":
        return None if before.get("reason") == now.get("reason") else now
    return now
