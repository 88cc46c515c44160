"""Kubernetes Events on EmbeddingServices: what a person running `kubectl describe` should see.

The same event is not repeated within `repeat_after` seconds, so a problem that persists
across reconciles (or a resync) costs one write, not one per reconcile.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from warmgate_contract.names import OPERATOR_NAME, REPORTING_COMPONENT
from warmgate_kube.client import ApiError
from warmgate_kube.kinds import EVENT
from warmgate_kube.objects import rfc3339

logger = logging.getLogger(__name__)

COMPONENT = OPERATOR_NAME


class Client(Protocol):
    async def create(self, kind: Any, namespace: str, body: Mapping[str, Any]) -> dict: ...


class EventRecorder:
    def __init__(
        self,
        client: Client,
        repeat_after: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._repeat_after = repeat_after
        self._clock = clock
        self._last: dict[tuple[str, str, str, str], float] = {}
        self._instance = socket.gethostname()

    async def record(self, body: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
        meta = body["metadata"]
        key = (meta.get("uid", ""), type_, reason, message)
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self._repeat_after:
            return
        self._last[key] = now
        if len(self._last) > 10_000:  # forget old keys rather than grow without bound
            cutoff = now - self._repeat_after
            self._last = {k: t for k, t in self._last.items() if t >= cutoff}
        stamp = rfc3339()
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": body.get("apiVersion"),
                "kind": body.get("kind"),
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
            },
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": COMPONENT},
            "reportingComponent": REPORTING_COMPONENT,
            "reportingInstance": self._instance,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }
        log = logger.warning if type_ == "Warning" else logger.info
        log("%s/%s %s: %s", meta["namespace"], meta["name"], reason, message)
        try:
            await self._client.create(EVENT, meta["namespace"], event)
        except ApiError as error:
            # An event is best effort; losing one must not fail the reconcile.
            logger.warning("could not record event %s: %s", reason, error)
