"""One idempotent reconcile of an EmbeddingService from current state.

The same function runs for a new object, a spec change, an operator restart, a child's change
and the periodic resync; it never asks what changed. Build the desired children, make each match
(writing only differences), read what is there, compute the status, write it if different.
What is there is read from the watch cache: a reconcile that changes nothing makes no request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from warmgate_contract.names import REASON_SCALED_TO_ZERO, SPEC_HASH_ANNOTATION
from warmgate_kube.client import ApiError, KubeClient
from warmgate_kube.kinds import CONFIGMAP, DEPLOYMENT, EMBEDDING_SERVICE, HPA, PDB, POD, SERVICE
from warmgate_kube.objects import micro_time, parse_time, rfc3339

from . import aliases, apply, idle
from .builders import Owner, build_children, configmap_name
from .config import OperatorConfig
from .events import EventRecorder
from .metrics import Metrics
from .roles import RoleKeeper
from .spec import ParsedSpecs, SpecError
from .status import (
    APPLY_FAILED_REASON,
    CONFLICT_REASON,
    INVALID_SPEC_REASON,
    Problem,
    compute_status,
    newly_degraded,
)
from .watch import Cache

logger = logging.getLogger(__name__)

# Retry delay after a failed write; the controller backs off further on repeated failures.
RETRY_SECONDS = 5.0


@dataclass(frozen=True)
class Reconciler:
    client: KubeClient
    config: OperatorConfig
    recorder: EventRecorder
    cache: Cache
    roles: RoleKeeper | None = None
    """None: roles are not given (a reconciler without pods to talk to, in unit tests)."""
    metrics: Metrics | None = None
    specs: ParsedSpecs = field(default_factory=ParsedSpecs)
    clock: Callable[[], str] = field(default=rfc3339)
    now: Callable[[], float] = field(default=time.time)
    evict: Callable[[Mapping[str, Any]], None] = field(default=lambda body: None)
    """Forget an EmbeddingService the apiserver no longer has (Operator.evict)."""

    async def __call__(self, body: Mapping[str, Any]) -> ReconcileResult:
        return await reconcile(self, body)


@dataclass(frozen=True)
class ReconcileResult:
    requeue_after: float | None = None
    """Retry after a failure (the controller backs off further on repeated ones)."""
    recheck_after: float | None = None
    """Nothing failed, but reconcile again then: when an idle window ends (scale to zero)."""


class OwnerGone(Exception):
    """The EmbeddingService being reconciled no longer exists (or is a new one of its name)."""


async def _confirm_owner(ctx: Reconciler, owner: Owner) -> None:
    """Before a child is created, one GET of its owner: an EmbeddingService deleted while the
    watches were away, and not yet known to be gone (feed.py), must not have its children made
    again. Children that exist are updated without it: the owner deleted, garbage collection
    takes them whatever is written."""
    live = await ctx.client.get(EMBEDDING_SERVICE, owner.namespace, owner.name)
    if live is None or (live.get("metadata") or {}).get("uid") != owner.uid:
        raise OwnerGone(f"{owner.namespace}/{owner.name}")


async def _apply_children(
    ctx: Reconciler, body: Mapping[str, Any], spec: Any, owner: Owner
) -> tuple[dict[str, Any] | None, list[apply.ApplyOutcome]]:
    status = body.get("status") or {}
    # The startup budget the live Deployment's pods run with decides whether a new measurement
    # changes the template (builders.startup_budget).
    live = ctx.cache.child(DEPLOYMENT, owner.namespace, owner.name)
    desired = build_children(
        spec,
        owner,
        ctx.config.default_image,
        status.get("observedShapes") or [],
        image_pull_secrets=ctx.config.server_image_pull_secrets,
        startup_seconds=status.get("startupSeconds"),
        live_deployment=live,
        hub_endpoint=ctx.config.hub_endpoint,
        default_pull_policy=ctx.config.server_image_pull_policy,
    )
    wanted = (
        (CONFIGMAP, configmap_name(owner.name), desired.configmap),
        (SERVICE, owner.name, desired.service),
        (DEPLOYMENT, owner.name, desired.deployment),
        (HPA, owner.name, desired.hpa),
        (PDB, owner.name, desired.pdb),
    )
    if any(
        child is not None and ctx.cache.child(kind, owner.namespace, name) is None
        for kind, name, child in wanted
    ):
        await _confirm_owner(ctx, owner)
    # Roles before the Deployment's size: a scale-in demotes the surplus serving pods (and
    # makes them the cheapest to delete) before the ReplicaSet picks which pods to delete; and
    # before the Service, whose selector names the serving role once there is a pool.
    if ctx.roles is not None:
        template = desired.deployment["spec"]["template"]
        await ctx.roles.apply(
            (owner.namespace, owner.name),
            ctx.cache.owned(POD, owner.namespace, owner.name),
            spec.serving_replicas,
            spec.standby_replicas > 0,
            template["metadata"]["annotations"].get(SPEC_HASH_ANNOTATION),
        )
    outcomes = []
    # The ConfigMap first (new pods mount it).
    for kind, name, child in wanted:
        current = ctx.cache.child(kind, owner.namespace, name)
        if child is None:
            outcome = await apply.ensure_absent(
                ctx.client, kind, owner.namespace, name, owner.uid, current
            )
        else:
            outcome = await apply.ensure(ctx.client, kind, child, current)
        if outcome.action == "deleted":
            ctx.cache.forget(kind, outcome.obj)
        elif outcome.wrote:
            ctx.cache.record(kind, outcome.obj)
        outcomes.append(outcome)
    deployment = next(o.obj for o in outcomes if o.kind == DEPLOYMENT.kind)
    return deployment, outcomes


async def _record_changes(
    ctx: Reconciler, body: Mapping[str, Any], outcomes: list[apply.ApplyOutcome]
) -> None:
    """One event per kind of change (Created, Updated, Deleted), naming every child touched."""
    by_action: dict[str, list[str]] = {}
    for outcome in outcomes:
        if outcome.wrote:
            by_action.setdefault(outcome.action, []).append(f"{outcome.kind} {outcome.name}")
    for action, children in by_action.items():
        await ctx.recorder.record(
            body, "Normal", action.capitalize(), f"{action} {', '.join(children)}"
        )


async def reconcile(ctx: Reconciler, body: Mapping[str, Any]) -> ReconcileResult:
    seen = ctx.now()  # when this reconcile saw the spec (a scale-out's decision, if it is one)
    meta = body["metadata"]
    if meta.get("deletionTimestamp"):
        # Children go with their owner through garbage collection; nothing to do.
        return ReconcileResult()
    owner = Owner.from_body(body)
    problem: Problem | None = None
    requeue: float | None = None
    deployment: dict[str, Any] | None = None
    applied = False
    spec = None
    try:
        spec = ctx.specs.of(body)
    except SpecError as error:
        problem = Problem(INVALID_SPEC_REASON, str(error), blocking=True)
        await ctx.recorder.record(body, "Warning", problem.reason, problem.message)

    if spec is not None and await _adopt_hpa_replicas(ctx, body, spec, owner):
        return ReconcileResult()  # the scale write's own event reconciles again
    if spec is not None:
        try:
            deployment, outcomes = await _apply_children(ctx, body, spec, owner)
            applied = True
            await _record_changes(ctx, body, outcomes)
        except OwnerGone:
            ctx.evict(body)
            return ReconcileResult()
        except apply.ChildConflict as error:
            problem = Problem(CONFLICT_REASON, str(error), blocking=True)
            await ctx.recorder.record(body, "Warning", problem.reason, problem.message)
            requeue = RETRY_SECONDS * 6
        except ApiError as error:
            problem = Problem(APPLY_FAILED_REASON, str(error))
            await ctx.recorder.record(body, "Warning", problem.reason, problem.message)
            requeue = RETRY_SECONDS

    if not applied:
        deployment = ctx.cache.child(DEPLOYMENT, owner.namespace, owner.name)
    pods = ctx.cache.owned(POD, owner.namespace, owner.name)
    previous = body.get("status") or {}
    asleep = None
    if spec is not None and spec.scaled_to_zero:
        asleep = idle.asleep_message(previous, idle.Activity.of(body), seen)
    conflict = aliases.name_conflict(body, ctx.cache.aliases.get(owner.namespace, owner.name))
    status = compute_status(spec, body, deployment, pods, ctx.clock(), problem, asleep, conflict)
    if spec is not None:
        status.update(
            idle.zero_status(
                previous,
                spec.autoscaling.scale_to_zero is not None,
                spec.scaled_to_zero,
                int(status.get("servingReplicas") or 0),
                seen,
                idle.first_pod_created(pods),
            )
        )
        scale_out = track_scale_out(
            body.get("status") or {}, spec.serving_replicas, status, ctx.now(), seen
        )
        status.update(scale_out)
        done = scale_out.get("lastScaleOut") or {}
        if (
            ctx.metrics is not None
            and done.get("seconds") is not None
            and done != (body.get("status") or {}).get("lastScaleOut")
        ):
            ctx.metrics.scale_out_seconds.labels(
                standby="true" if done.get("standbyPromoted") else "false"
            ).observe(done["seconds"])
    degraded = newly_degraded(body.get("status") or {}, status)
    if degraded is not None and problem is None:  # a problem above already has its Event
        await ctx.recorder.record(body, "Warning", degraded["reason"], degraded["message"])
    resource_version = (body.get("metadata") or {}).get("resourceVersion")
    if status != body.get("status"):
        written = await write_status(ctx.client, owner, status, resource_version)
        # Its watch event then changes nothing and reconciles nothing again.
        ctx.cache.record(EMBEDDING_SERVICE, written)
        if written is None:
            return ReconcileResult(requeue_after=requeue)  # the newer object reconciles again
        resource_version = written["metadata"].get("resourceVersion")
    recheck = None
    if spec is not None and spec.autoscaling.scale_to_zero is not None:
        recheck = await _idle(ctx, body, spec, owner, status, resource_version, seen)
    return ReconcileResult(requeue_after=requeue, recheck_after=recheck)


async def _idle(
    ctx: Reconciler,
    body: Mapping[str, Any],
    spec: Any,
    owner: Owner,
    status: Mapping[str, Any],
    resource_version: str | None,
    now: float,
) -> float | None:
    """Scale to zero, decided from the status just computed (a wake, or a first pod serving,
    is recorded there) once the children and the status are written; the scale write's own
    event reconciles again. Otherwise: when to look again."""
    degraded = next((c for c in status.get("conditions") or [] if c["type"] == "Degraded"), {})
    decision = idle.decide(
        spec.autoscaling.scale_to_zero.idle_seconds,
        spec.serving_replicas == 0,
        idle.Activity.of({**body, "status": status}),
        now,
        failing=degraded.get("status") == "True",
    )
    if decision.scale_to_zero:
        await _scale_to_zero(ctx, body, owner, decision, spec, resource_version)
        return None
    return decision.recheck_after


async def _scale_to_zero(
    ctx: Reconciler,
    body: Mapping[str, Any],
    owner: Owner,
    decision: idle.IdleDecision,
    spec: Any,
    resource_version: str | None,
) -> bool:
    """Set spec.replicas to 0 through the scale subresource (as the HPA and kubectl scale
    do), only if the object is still the one the decision was made from (`resource_version`:
    as read, or as this reconcile's status write left it): a request annotation
    warmgate-router wrote meanwhile fails the test, and its own event reconciles again. True
    when it wrote."""
    operations = [
        {"op": "test", "path": "/metadata/uid", "value": owner.uid},
        {"op": "test", "path": "/metadata/resourceVersion", "value": resource_version},
        {"op": "replace", "path": "/spec/replicas", "value": 0},
    ]
    try:
        await ctx.client.json_patch(
            EMBEDDING_SERVICE, owner.namespace, owner.name, operations, subresource="scale"
        )
    except ApiError as error:
        logger.info("%s/%s not scaled to zero: %s", owner.namespace, owner.name, error)
        return False
    message = idle.scaled_event_message(
        decision.idle_seconds, spec.autoscaling.scale_to_zero.idle_seconds
    )
    await ctx.recorder.record(body, "Normal", REASON_SCALED_TO_ZERO, message)
    if ctx.metrics is not None:
        ctx.metrics.scaled_to_zero.inc()
    return True


async def _adopt_hpa_replicas(
    ctx: Reconciler, body: Mapping[str, Any], spec: Any, owner: Owner
) -> bool:
    """An HPA made by an operator before standby pods scaled the Deployment itself; the new one
    scales the EmbeddingService. Before it is replaced, its latest decision (the Deployment's
    replicas) is written to spec.replicas, so the switch neither scales in nor out. True when
    it wrote (the write's own event reconciles again)."""
    if not spec.autoscaling.enabled:
        return False
    hpa = ctx.cache.child(HPA, owner.namespace, owner.name) or {}
    target = ((hpa.get("spec") or {}).get("scaleTargetRef") or {}).get("kind")
    live = ctx.cache.child(DEPLOYMENT, owner.namespace, owner.name) or {}
    replicas = (live.get("spec") or {}).get("replicas")
    if target != "Deployment" or replicas is None or replicas == spec.replicas:
        return False
    operations = [
        {"op": "test", "path": "/metadata/uid", "value": owner.uid},
        {"op": "replace", "path": "/spec/replicas", "value": int(replicas)},
    ]
    try:
        await ctx.client.json_patch(
            EMBEDDING_SERVICE, owner.namespace, owner.name, operations, subresource="scale"
        )
    except ApiError as error:
        logger.info("replicas of %s/%s not adopted: %s", owner.namespace, owner.name, error)
        return False
    logger.info(
        "%s/%s: spec.replicas %d adopted from the Deployment its old HPA scaled",
        owner.namespace,
        owner.name,
        replicas,
    )
    return True


def track_scale_out(
    previous: Mapping[str, Any],
    wanted: int,
    status: Mapping[str, Any],
    now: float,
    seen: float | None = None,
) -> dict[str, Any]:
    """The status fields that time each scale-out from the decision (the operator seeing more
    serving pods wanted, at `seen`: the HPA's write or a `kubectl scale`) to the capacity (that
    many pods serving, as of `now`): `desiredServingReplicas`, `scaleOut` while one is under
    way, `lastScaleOut` once done. `standbyPromoted`: whether the pool had a pod for each one
    added."""
    fields: dict[str, Any] = {"desiredServingReplicas": wanted}
    if previous.get("lastScaleOut"):
        fields["lastScaleOut"] = previous["lastScaleOut"]
    pending = previous.get("scaleOut")
    before = previous.get("desiredServingReplicas")
    if isinstance(before, int) and wanted > before:
        pending = {
            "fromReplicas": before,
            "toReplicas": wanted,
            "decidedAt": micro_time(datetime.fromtimestamp(now if seen is None else seen, UTC)),
            "standbyPromoted": int(previous.get("standbyReplicas") or 0) >= wanted - before,
        }
    if not pending:
        return fields
    serving = int(status.get("servingReplicas") or 0)
    if serving >= min(int(pending["toReplicas"]), wanted):
        decided = parse_time(pending["decidedAt"]) or now
        fields["lastScaleOut"] = {
            **pending,
            "capacityAt": micro_time(datetime.fromtimestamp(now, UTC)),
            "seconds": round(max(0.0, now - decided), 3),
        }
    else:
        fields["scaleOut"] = pending
    return fields


async def write_status(
    client: KubeClient,
    owner: Owner,
    status: Mapping[str, Any],
    resource_version: str | None = None,
) -> dict[str, Any] | None:
    """Replace the whole status (a merge patch would keep stale keys and merge conditions),
    only if the object is still the `resource_version` the status was computed from: the
    status carries fields other writers set (the traffic observer's observedShapes), which a
    write from an older read would put back."""
    operations: list[dict[str, Any]] = [{"op": "test", "path": "/metadata/uid", "value": owner.uid}]
    if resource_version is not None:
        operations.append(
            {"op": "test", "path": "/metadata/resourceVersion", "value": resource_version}
        )
    operations.append({"op": "add", "path": "/status", "value": dict(status)})
    try:
        return await client.json_patch(
            EMBEDDING_SERVICE, owner.namespace, owner.name, operations, subresource="status"
        )
    except ApiError as error:
        if error.status in (404, 409, 422):
            # Gone, replaced by a new object of the same name, or changed since it was read
            # (the change's own watch event reconciles it again).
            logger.info("status of %s/%s not written: %s", owner.namespace, owner.name, error)
            return None
        raise
