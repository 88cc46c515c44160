"""What a request tells the cluster besides its answer: the last-request time of its
EmbeddingService (an annotation the operator's idle check reads, written at most once per
interval, view.activity_interval), and, for a service scaled to zero, the wake: its scale
subresource set to 1, conditional on the version read, so that an HPA decision or another
replica's wake is never overwritten."""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from typing import Any

from warmgate_contract.names import LAST_REQUEST_ANNOTATION
from warmgate_kube.client import MERGE_PATCH, UNANSWERED, ApiError, KubeClient

from .config import RouterConfig
from .metrics import Metrics
from .view import SERVICES, Key, View, activity_interval

log = logging.getLogger("warmgate.router")


def activity_stamp(moment: float | None = None) -> str:
    """`moment` (Unix time; now when None) as RFC 3339 in UTC with milliseconds, for the
    last-request annotation: whole seconds would date a request up to a second early, and
    the operator counts the idle window from it."""
    when = datetime.datetime.fromtimestamp(time.time() if moment is None else moment, datetime.UTC)
    return when.isoformat(timespec="milliseconds").removesuffix("+00:00") + "Z"


class Waker:
    """Writes each service's last-request time and wakes services at zero; `kube` None (a
    router without cluster access, in tests) writes nothing."""

    def __init__(
        self, config: RouterConfig, view: View, kube: KubeClient | None, metrics: Metrics
    ) -> None:
        self.config = config
        self.view = view
        self.kube = kube
        self.metrics = metrics
        self._activity: dict[Key, float] = {}
        self._woken: dict[Key, float] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def note_activity(self, key: Key) -> None:
        now = time.monotonic()
        if self.kube is None:
            return
        interval = activity_interval(self.view.service(key), self.config.activity_seconds)
        if now - self._activity.get(key, -1e9) < interval:
            return
        self._activity[key] = now
        self._spawn(self._write_activity(key))

    async def _write_activity(self, key: Key) -> None:
        body = {"metadata": {"annotations": {LAST_REQUEST_ANNOTATION: activity_stamp()}}}
        try:
            await self.kube.request(
                "PATCH",
                SERVICES.path(key[0], key[1]),
                body,
                content_type=MERGE_PATCH,
            )
        except (ApiError, *UNANSWERED) as error:
            log.warning("%s/%s: could not record its last request: %s", *key, error)
            self._activity.pop(key, None)

    async def wake(self, key: Key) -> None:
        """Scale a service at zero to one (unless something else already did)."""
        now = time.monotonic()
        if self.kube is None or now - self._woken.get(key, -1e9) < 10:
            return
        self._woken[key] = now
        path = SERVICES.path(key[0], key[1], "scale")
        # A Scale at 0 replicas has no spec.replicas (omitted when empty). The write is
        # conditional on the version read, so an HPA decision or another replica's wake in
        # between is never overwritten: a 409 reads again (the EmbeddingService also changes
        # for the last-request annotation, written at the same moment).
        for _ in range(5):
            try:
                scale = await self.kube.request("GET", path)
                if int((scale.get("spec") or {}).get("replicas") or 0) > 0:
                    return  # woken by another replica, or scaled by someone else
                version = scale["metadata"]["resourceVersion"]
                await self.kube.request(
                    "PATCH",
                    path,
                    {"metadata": {"resourceVersion": version}, "spec": {"replicas": 1}},
                    content_type=MERGE_PATCH,
                )
                break
            except ApiError as error:
                if error.status == 409:
                    continue
                log.warning("%s/%s: could not scale from zero: %s", *key, error)
            except (*UNANSWERED, KeyError) as error:
                log.warning("%s/%s: could not scale from zero: %s", *key, error)
            self._woken.pop(key, None)
            return
        else:
            self._woken.pop(key, None)
            return
        self.metrics.cold_starts.labels(service=f"{key[0]}/{key[1]}").inc()
        log.info("%s/%s: scaled from zero to 1 for a request", *key)
        self._activity.pop(key, None)
        self.note_activity(key)
