"""Observed traffic: the shapes production really runs, fed back into the warmup plan.

For each EmbeddingService with `warmup.observedTraffic.enabled`, every `refreshSeconds` the
operator asks its Ready pods for `GET /warmup/profile` (the (batch, bucket) shapes each served,
with counts) and `GET /ready` (its warmup time), keeps the `maxShapes` most frequent shapes in
`status.observedShapes` and the slowest pod's warmup in `status.warmupSeconds`. The reconcile
writes `status.observedShapes` into the warmup-profile ConfigMap, which new pods read at start:
scale-outs and restarts warm what traffic uses. The ConfigMap is not part of the pod template, so
running pods never restart for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from warmgate_contract.names import SERVER_PORT
from warmgate_contract.report import (
    ReadyReport,
    ReportError,
    merge_profiles,
    parse_profile,
    render_profile,
)
from warmgate_kube.client import ApiError, KubeClient
from warmgate_kube.kinds import EMBEDDING_SERVICE, POD
from warmgate_kube.watch import Key

from .podclient import ERRORS, PodClient
from .spec import EmbeddingServiceSpec, ParsedSpecs, SpecError
from .status import is_pod_ready
from .watch import Cache

log = logging.getLogger("warmgate.observed")

MIN_REFRESH_SECONDS = 5.0


def merged_shapes(profiles: Iterable[Any], max_shapes: int) -> list[dict]:
    """The pods' `/warmup/profile` documents summed (the contract's merge), as status items;
    a document that does not follow the contract is left out."""
    entries = []
    for document in profiles:
        try:
            entries.append(parse_profile(document))
        except ValueError:
            continue
    return render_profile(merge_profiles(entries, max_shapes))["shapes"]


def slowest_warmup(reports: Iterable[Any]) -> float | None:
    """The longest warmup (seconds) the pods' `/ready` reports give, read as the contract's
    ReadyReport; a report that does not follow the contract, or gives no time yet, is left out
    like a pod that did not answer."""
    seconds = []
    for document in reports:
        if document is None:
            continue
        try:
            report = ReadyReport.from_json(document)
        except ReportError as error:
            log.debug("a /ready report left out: %s", error)
            continue
        if report.warmup_seconds is not None:
            seconds.append(report.warmup_seconds)
    return round(max(seconds), 3) if seconds else None


def traffic_settings(spec: EmbeddingServiceSpec | None) -> tuple[bool, int, float]:
    """(enabled, maxShapes, refreshSeconds) of a parsed spec; off without one (a spec that does
    not parse: reconcile reports it)."""
    if spec is None:
        return False, 0, 300.0
    observed = spec.warmup.observed_traffic
    return (
        observed.enabled and spec.warmup.enabled,
        observed.max_shapes,
        float(observed.refresh_seconds),
    )


def status_patch(
    body: Mapping[str, Any], shapes: list[dict], warmup_seconds: float | None
) -> list[dict] | None:
    """A JSON patch for the status subresource, guarded by the resourceVersion; None when
    nothing would change (no write)."""
    status = body.get("status") or {}
    operations: list[dict] = []
    if shapes != (status.get("observedShapes") or []):
        operations.append({"op": "add", "path": "/status/observedShapes", "value": shapes})
    if warmup_seconds is not None and status.get("warmupSeconds") != warmup_seconds:
        operations.append({"op": "add", "path": "/status/warmupSeconds", "value": warmup_seconds})
    if not operations or "status" not in body:
        return None
    version = body["metadata"].get("resourceVersion")
    guard = [{"op": "test", "path": "/metadata/resourceVersion", "value": version}]
    return guard + operations


class TrafficObserver:
    """One collection loop per EmbeddingService, in memory (no finalizers, no annotations);
    the pods come from the watch cache."""

    def __init__(
        self,
        client: KubeClient,
        pods: PodClient,
        cache: Cache,
        specs: ParsedSpecs,
        port: int = SERVER_PORT,
    ) -> None:
        self._client = client
        self._pods = pods
        self._cache = cache
        self._specs = specs
        self._port = port
        self._tasks: dict[Key, asyncio.Task] = {}

    def _settings(self, body: Mapping[str, Any]) -> tuple[bool, int, float]:
        try:
            return traffic_settings(self._specs.of(body))
        except SpecError:
            return traffic_settings(None)

    def observe(self, key: Key, deleted: bool = False) -> None:
        task = self._tasks.get(key)
        if deleted:
            if task is not None:
                task.cancel()
                self._tasks.pop(key, None)
            return
        if task is None or task.done():
            self._tasks[key] = asyncio.create_task(self._run(key), name=f"observed/{key[1]}")

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _run(self, key: Key) -> None:
        while True:
            body = self._cache.services.get(*key)
            if body is None:
                return
            enabled, _, refresh = self._settings(body)
            await asyncio.sleep(max(MIN_REFRESH_SECONDS, refresh))
            if not enabled:
                continue
            try:
                await self.collect(key)
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the next round tries again
                log.warning("observed traffic of %s/%s: %s", key[0], key[1], error)

    async def _fetch(self, pod: Mapping[str, Any], path: str) -> Any:
        """The pod's answer to GET `path` (a /ready report whatever its status, other paths
        only when 200); None when it gave none."""
        address = (pod.get("status") or {}).get("podIP")
        if not address:
            return None
        try:
            status, document = await self._pods.get_json(address, self._port, path)
        except ERRORS:
            return None
        return document if status == 200 or path == "/ready" else None

    async def collect(self, key: Key) -> bool:
        """One round; True when the status was written."""
        namespace, name = key
        body = self._cache.services.get(namespace, name)
        if body is None:
            return False
        _, max_shapes, _ = self._settings(body)
        pods = self._cache.owned(POD, namespace, name)
        ready = [p for p in pods if is_pod_ready(p) and not p["metadata"].get("deletionTimestamp")]
        if not ready:
            return False
        profiles = await asyncio.gather(*(self._fetch(p, "/warmup/profile") for p in ready))
        reports = await asyncio.gather(*(self._fetch(p, "/ready") for p in ready))
        shapes = merged_shapes([p for p in profiles if p], max_shapes)
        operations = status_patch(body, shapes, slowest_warmup(reports))
        if operations is None:
            return False
        try:
            # Not recorded in the cache: its watch event is what makes reconcile write the new
            # shapes into the warmup-profile ConfigMap.
            await self._client.json_patch(
                EMBEDDING_SERVICE, namespace, name, operations, subresource="status"
            )
        except ApiError as error:
            if error.status in (404, 409, 422):  # changed meanwhile: the next round retries
                return False
            raise
        return True
