"""One idempotent reconcile of an EmbeddingService from current state.

The same function runs for a new object, a spec change, an operator restart, a child's change
and the periodic resync; it never asks what changed. Build the desired children, make each match
(writing only differences), read what is there, compute the status, write it if different.
What is there is read from the watch cache: a reconcile that changes nothing makes no request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import apply
from .builders import Owner, build_children, configmap_name
from .config import OperatorConfig
from .events import EventRecorder
from .kube import (
    CONFIGMAP,
    DEPLOYMENT,
    EMBEDDING_SERVICE,
    HPA,
    PDB,
    POD,
    SERVICE,
    ApiError,
    KubeClient,
)
from .objects import rfc3339
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
    specs: ParsedSpecs = field(default_factory=ParsedSpecs)
    clock: Callable[[], str] = field(default=rfc3339)

    async def __call__(self, body: Mapping[str, Any]) -> ReconcileResult:
        return await reconcile(self, body)


@dataclass(frozen=True)
class ReconcileResult:
    requeue_after: float | None = None


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
    outcomes = []
    # The ConfigMap first (new pods mount it).
    for kind, name, child in (
        (CONFIGMAP, configmap_name(owner.name), desired.configmap),
        (SERVICE, owner.name, desired.service),
        (DEPLOYMENT, owner.name, desired.deployment),
        (HPA, owner.name, desired.hpa),
        (PDB, owner.name, desired.pdb),
    ):
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

    if spec is not None:
        try:
            deployment, outcomes = await _apply_children(ctx, body, spec, owner)
            applied = True
            await _record_changes(ctx, body, outcomes)
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
    status = compute_status(spec, body, deployment, pods, ctx.clock(), problem)
    degraded = newly_degraded(body.get("status") or {}, status)
    if degraded is not None and problem is None:  # a problem above already has its Event
        await ctx.recorder.record(body, "Warning", degraded["reason"], degraded["message"])
    if status != body.get("status"):
        resource_version = (body.get("metadata") or {}).get("resourceVersion")
        written = await write_status(ctx.client, owner, status, resource_version)
        # Its watch event then changes nothing and reconciles nothing again.
        ctx.cache.record(EMBEDDING_SERVICE, written)
    return ReconcileResult(requeue_after=requeue)


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
