"""Serving and standby pods (spec.standbyReplicas).

The Deployment runs serving + standby pods of the current template; every one of them passes the
warm gate and turns Ready. Which Ready pods take traffic is a label the operator gives each one,
`warmgate.dev/role`: with a standby pool the Service selects `serving` pods only, and so does the
scale subresource's selector, which the HPA averages its metrics over. So a scale-out promotes a
warm, verified pod by changing one label (no start, no load, no warmup), and the Deployment
then starts a pod to refill the pool behind it; a scale-in demotes the surplus serving pods
(they close their keep-alive connections: draining.py's rules) before the ReplicaSet deletes
any, and the deletion cost makes it delete standby pods first.

Why standby pods are Ready and not gate-closed: a pod that is not Ready is unavailable to the
Deployment, so a rollout could never complete (`kubectl rollout status` would wait forever, and
maxUnavailable would count the pool as missing capacity). Their gate verified them; the label
keeps them out of the Service.

`assign` is pure (which pod gets which role); `RoleKeeper` writes the labels and tells each
server its role.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from warmgate_contract.names import (
    DELETION_COST_ANNOTATION,
    ROLE_LABEL,
    ROLE_PATH,
    ROLE_SERVING,
    ROLE_STANDBY,
    SPEC_HASH_ANNOTATION,
)
from warmgate_kube.objects import condition, parse_time

from .gate import expectation_for, restart_count
from .podclient import ERRORS, PodClient

logger = logging.getLogger(__name__)

DELETION_COST = {ROLE_SERVING: "100", ROLE_STANDBY: "0"}
"""A ReplicaSet scaling down deletes Ready pods of lower cost first: standby before serving."""


@dataclass(frozen=True)
class Member:
    """What the assignment reads of one pod."""

    name: str
    uid: str
    role: str | None
    """Its ROLE_LABEL now (None: never given one)."""
    ready: bool
    """Ready (containers ready, warm gate passed) and not terminating."""
    current: bool
    """It runs the template the spec asks for now (not a rollout's old one)."""
    ready_since: float
    restarts: int = 0

    @property
    def process(self) -> str:
        """This pod's current server process (a restarted one must be told again)."""
        return f"{self.uid}/{self.restarts}"

    @classmethod
    def of(cls, pod: Mapping[str, Any], current_hash: str | None) -> Member:
        meta = pod.get("metadata") or {}
        ready = condition(pod, "Ready") or {}
        is_ready = ready.get("status") == "True" and not meta.get("deletionTimestamp")
        annotations = meta.get("annotations") or {}
        return cls(
            name=str(meta.get("name")),
            uid=str(meta.get("uid")),
            role=(meta.get("labels") or {}).get(ROLE_LABEL),
            ready=is_ready,
            current=current_hash is None or annotations.get(SPEC_HASH_ANNOTATION) == current_hash,
            ready_since=parse_time(ready.get("lastTransitionTime")) or math.inf,
            restarts=restart_count(pod),
        )


def assign(members: Iterable[Member], serving: int) -> dict[str, str]:
    """The role of every Ready pod: the first `serving` of them serve, the rest stand by.

    Ranked by: the current template first (a rollout's new pods take traffic as they pass the
    gate, the old ones step back before the Deployment deletes them); then pods already serving
    (no churn: a promotion never swaps one serving pod for another); then the longest Ready.
    Pods that are not Ready keep whatever label they have: they take no traffic either way, and
    a restarted pod is ranked again once its gate has re-verified it.
    """
    eligible = [m for m in members if m.ready]
    ranked = sorted(
        eligible, key=lambda m: (not m.current, m.role != ROLE_SERVING, m.ready_since, m.name)
    )
    return {m.name: ROLE_SERVING if i < serving else ROLE_STANDBY for i, m in enumerate(ranked)}


@dataclass(frozen=True)
class Counts:
    serving: int
    """Ready pods that take traffic."""
    standby: int
    """Ready pods of the current template in the standby pool."""


def count(members: Iterable[Member], pool: bool) -> Counts:
    """Serving and standby pods as the Service sees them: without a pool, every Ready pod
    serves whatever its label says."""
    members = [m for m in members if m.ready]
    if not pool:
        return Counts(serving=len(members), standby=0)
    return Counts(
        serving=sum(1 for m in members if m.role == ROLE_SERVING),
        standby=sum(1 for m in members if m.role == ROLE_STANDBY and m.current),
    )


def managed(members: Iterable[Member], pool: bool) -> bool:
    """Whether roles are given at all: with a pool, or while a pod still carries one (a pool
    set back to 0: its standby pods serve again, and their servers are told)."""
    return pool or any(m.role is not None for m in members)


def role_patch(role: str, resource_version: str | None) -> dict[str, Any]:
    """A strategic-merge patch for `pods/<name>/status` (which may change the pod's labels and
    annotations; the operator needs no write on pods themselves): the role and the deletion
    cost; the resourceVersion makes a stale write fail with 409."""
    meta: dict[str, Any] = {
        "labels": {ROLE_LABEL: role},
        "annotations": {DELETION_COST_ANNOTATION: DELETION_COST[role]},
    }
    if resource_version:
        meta["resourceVersion"] = resource_version
    return {"metadata": meta}


@dataclass
class RoleKeeper:
    """Writes roles and tells servers theirs. What each pod's server was last told is kept in
    memory: after an operator restart every Ready pod with a role is told again (idempotent)."""

    writer: Any
    """Has `async patch_status(namespace, name, body)` (runtime.PodStatusWriter)."""
    pods: PodClient
    told: dict[tuple[str, str], dict[str, str]] = field(default_factory=dict)
    """(namespace, EmbeddingService) -> {pod process: role told}."""

    async def apply(
        self,
        key: tuple[str, str],
        pods: Iterable[Mapping[str, Any]],
        serving: int,
        pool: bool,
        current_hash: str | None,
    ) -> list[tuple[str, str]]:
        """Give every Ready pod its role; the (pod, role) changes made, promotions first."""
        pods = list(pods)
        members = [Member.of(p, current_hash) for p in pods]
        told = self.told.setdefault(key, {})
        for process in set(told) - {m.process for m in members}:
            del told[process]
        if not managed(members, pool):
            return []
        wanted = assign(members, serving if pool else len(members))
        by_name = {str((p.get("metadata") or {}).get("name")): p for p in pods}
        changes = sorted(
            ((m, wanted[m.name]) for m in members if m.name in wanted and m.role != wanted[m.name]),
            key=lambda change: change[1] != ROLE_SERVING,
        )
        made = []
        for member, role in changes:
            pod = by_name[member.name]
            if role == ROLE_SERVING:  # its server stops closing connections before traffic comes
                await self.tell(told, pod, member, role)
            meta = pod.get("metadata") or {}
            try:
                await self.writer.patch_status(
                    str(meta.get("namespace")),
                    member.name,
                    role_patch(role, meta.get("resourceVersion")),
                )
            except Exception as error:  # the pod's next event reconciles it again
                logger.info("role %s of pod %s not written: %s", role, member.name, error)
                continue
            if role == ROLE_STANDBY:  # out of the Service first, then its clients move
                await self.tell(told, pod, member, role)
            made.append((member.name, role))
        for member in members:  # a restarted operator, or a server restarted since
            role = member.role
            if role is not None and role == wanted.get(member.name) != told.get(member.process):
                await self.tell(told, by_name[member.name], member, role)
        return made

    def forget(self, key: tuple[str, str]) -> None:
        self.told.pop(key, None)

    async def tell(
        self, told: dict[str, str], pod: Mapping[str, Any], member: Member, role: str
    ) -> None:
        host = (pod.get("status") or {}).get("podIP")
        expected = expectation_for(pod)
        if not host or expected is None:
            return
        try:
            status, _ = await self.pods.post_json(host, expected.port, ROLE_PATH, {"role": role})
        except ERRORS as error:
            logger.info("could not tell pod %s its role %s: %s", member.name, role, error)
            return
        if status == 200:
            told[member.process] = role
        else:
            logger.info("pod %s answered %d to its role %s", member.name, status, role)
