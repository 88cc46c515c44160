"""EmbeddingAlias status: what each alias's name resolves to, by the same rules warmgate-router
forwards by (warmgate_contract.aliases), so that `kubectl get emba` tells a person whether a
name serves and, if not, why.

`namespace_statuses` is pure (gather, evaluate); `AliasKeeper` recomputes a namespace from the
watch cache whenever an alias or an EmbeddingService there changes, and writes only the
statuses that differ (compare, write).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from warmgate_contract.aliases import Resolution, claims_of, resolve
from warmgate_contract.names import ALIAS_KIND, KIND, REASON_NAME_CONFLICT, REASON_RESOLVED
from warmgate_kube.client import ApiError, KubeClient
from warmgate_kube.kinds import EMBEDDING_ALIAS
from warmgate_kube.objects import condition, rfc3339

from .events import EventRecorder
from .metrics import Metrics
from .status import Condition, merge_conditions
from .watch import Cache

logger = logging.getLogger(__name__)

RETRY_SECONDS = 5.0


def alias_status(
    alias: Mapping[str, Any],
    resolution: Resolution,
    services: Mapping[str, Mapping[str, Any]],
    now: str,
) -> dict[str, Any]:
    """The alias's whole status: the EmbeddingService it resolves to and the model revision
    that one serves, and a Ready condition (its lastTransitionTime kept while its status
    holds, so the same inputs give an equal status)."""
    previous = alias.get("status") or {}
    generation = int((alias.get("metadata") or {}).get("generation") or 0)
    status: dict[str, Any] = {"observedGeneration": generation}
    if resolution.service is not None:
        status["service"] = resolution.service
        target = services.get(resolution.service) or {}
        revision = ((target.get("status") or {}).get("model") or {}).get("revision")
        if revision:
            status["revision"] = revision
    ready = Condition(
        "Ready", "True" if resolution.ok else "False", resolution.reason, resolution.message
    )
    status["conditions"] = merge_conditions(
        previous.get("conditions") or [], [ready], generation, now
    )
    return status


@dataclass(frozen=True)
class Verdict:
    """One namespace's names, resolved: each alias with the status it should have, and the
    EmbeddingServices whose own name an older alias holds."""

    aliases: list[tuple[dict[str, Any], dict[str, Any]]]
    refused_services: list[tuple[dict[str, Any], Resolution]]


def namespace_statuses(
    namespace: str,
    services: Iterable[dict[str, Any]],
    aliases: Iterable[dict[str, Any]],
    now: str,
) -> Verdict:
    services = [s for s in services if s["metadata"].get("namespace") == namespace]
    aliases = [a for a in aliases if a["metadata"].get("namespace") == namespace]
    resolved = resolve(claims_of(services, aliases))
    by_name = {s["metadata"]["name"]: s for s in services}
    statuses = []
    for alias in aliases:
        resolution = resolved[(ALIAS_KIND, f"{namespace}/{alias['metadata']['name']}")]
        statuses.append((alias, alias_status(alias, resolution, by_name, now)))
    refused = [
        (service, resolution)
        for service in services
        for resolution in [resolved[(KIND, f"{namespace}/{service['metadata']['name']}")]]
        if resolution.reason == REASON_NAME_CONFLICT
    ]
    return Verdict(statuses, refused)


def name_conflict(service: Mapping[str, Any], alias: Mapping[str, Any] | None) -> str | None:
    """Why `alias`, the EmbeddingAlias of the same name in the same namespace (None: there
    is none), holds `service`'s own name (the older claim wins), or None when it does not."""
    if alias is None:
        return None
    resolved = resolve(claims_of([service], [alias]))
    meta = service["metadata"]
    found = resolved[(KIND, f"{meta['namespace']}/{meta['name']}")]
    return found.message if found.reason == REASON_NAME_CONFLICT else None


def status_patch(current: Mapping[str, Any], desired: Mapping[str, Any]) -> dict[str, Any]:
    """The merge patch that turns `current` into `desired` (a key `desired` lacks: None)."""
    patch = dict(desired)
    for key in current:
        patch.setdefault(key, None)
    return {"status": patch}


class AliasKeeper:
    """Keeps every EmbeddingAlias's status right, one namespace at a time: `enqueue` asks for a
    namespace to be recomputed (collapsed while one is pending); one worker recomputes and
    writes."""

    def __init__(
        self,
        client: KubeClient,
        cache: Cache,
        recorder: EventRecorder,
        metrics: Metrics | None = None,
        clock: Callable[[], str] = rfc3339,
        retry_seconds: float = RETRY_SECONDS,
    ) -> None:
        self._client = client
        self._cache = cache
        self._recorder = recorder
        self._metrics = metrics
        self._clock = clock
        self._retry_seconds = retry_seconds
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._pending: set[str] = set()
        self._task: asyncio.Task[None] | None = None
        self._refused: dict[str, set[str]] = {}
        """Per namespace: uids of the EmbeddingServices whose name an alias holds, as last
        told (an Event once per refusal, not once per sync)."""

    def enqueue(self, namespace: str) -> None:
        if namespace not in self._pending:
            self._pending.add(namespace)
            self._queue.put_nowait(namespace)

    def start(self) -> None:
        self._task = asyncio.create_task(self._work(), name="alias-status")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _work(self) -> None:
        while True:
            namespace = await self._queue.get()
            self._pending.discard(namespace)
            try:
                failed = await self.sync(namespace)
            except Exception:  # a bug must not stop every later namespace's statuses
                logger.exception("alias statuses of namespace %s failed", namespace)
                failed = True
            if failed:
                asyncio.get_running_loop().call_later(self._retry_seconds, self.enqueue, namespace)

    async def sync(self, namespace: str) -> bool:
        """Recompute `namespace`'s aliases and write those that differ; True when a write
        failed (retry later)."""
        verdict = namespace_statuses(
            namespace,
            self._cache.services.in_namespace(namespace),
            self._cache.aliases.in_namespace(namespace),
            self._clock(),
        )
        failed = False
        for alias, desired in verdict.aliases:
            current = alias.get("status") or {}
            if desired == current or alias["metadata"].get("deletionTimestamp"):
                continue
            failed |= not await self._write(alias, current, desired)
        await self._tell_refused_services(namespace, verdict.refused_services)
        return failed

    async def _write(
        self, alias: Mapping[str, Any], current: Mapping[str, Any], desired: Mapping[str, Any]
    ) -> bool:
        meta = alias["metadata"]
        try:
            written = await self._client.merge_patch(
                EMBEDDING_ALIAS,
                meta["namespace"],
                meta["name"],
                status_patch(current, desired),
                subresource="status",
            )
        except ApiError as error:
            if error.status == 404:  # deleted meanwhile: its watch event says so
                return True
            logger.warning(
                "status of EmbeddingAlias %s/%s not written: %s",
                meta["namespace"],
                meta["name"],
                error,
            )
            return False
        self._cache.record(EMBEDDING_ALIAS, written)
        ready = condition({"status": desired}, "Ready") or {}
        before = condition({"status": current}, "Ready") or {}
        if self._metrics is not None:
            self._metrics.alias_status_writes.labels(reason=ready.get("reason", "")).inc()
        logger.info(
            "EmbeddingAlias %s/%s: %s: %s",
            meta["namespace"],
            meta["name"],
            ready.get("reason"),
            ready.get("message"),
        )
        if ready.get("reason") == REASON_NAME_CONFLICT != before.get("reason"):
            await self._recorder.record(
                alias, "Warning", REASON_NAME_CONFLICT, str(ready.get("message"))
            )
        elif ready.get("reason") == REASON_RESOLVED and desired.get("service") != current.get(
            "service"
        ):
            await self._recorder.record(alias, "Normal", REASON_RESOLVED, str(ready.get("message")))
        return True

    async def _tell_refused_services(
        self, namespace: str, refused: list[tuple[dict[str, Any], Resolution]]
    ) -> None:
        """An EmbeddingService whose own name an older alias holds still serves through its
        Service, but not by its name through warmgate-router: a Warning Event on it, once."""
        told = self._refused.get(namespace, set())
        now = set()
        for service, resolution in refused:
            uid = str(service["metadata"].get("uid"))
            now.add(uid)
            if uid not in told:
                await self._recorder.record(
                    service, "Warning", REASON_NAME_CONFLICT, resolution.message
                )
        if now:
            self._refused[namespace] = now
        else:
            self._refused.pop(namespace, None)
