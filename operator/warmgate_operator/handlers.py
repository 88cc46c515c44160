"""Thin kopf adapters: each handler turns one watch event into one call and returns None.

Only event (watching) handlers are used: kopf then adds no finalizer and writes no annotations
or status to any object, so deleting an EmbeddingService or a pod never waits for the operator,
and children go with their owner through garbage collection.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp
import kopf

from warmgate_contract.names import (
    GROUP,
    KIND,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    PLURAL,
    SERVICE_LABEL,
    VERSION,
)

from . import metrics, stats
from .config import OperatorConfig
from .controller import Controller, Key
from .events import EventRecorder
from .gatekeeper import GateConfig, Gatekeeper, KubeClientStatusWriter, ReportClient
from .kube import EMBEDDING_SERVICE, POD, KubeClient, ResourceKind
from .observed import TrafficObserver
from .reconcile import Reconciler
from .spec import ParsedSpecs, SpecError

logger = logging.getLogger(__name__)

MANAGED = {MANAGED_BY_LABEL: MANAGED_BY}
MANAGED_SELECTOR = f"{MANAGED_BY_LABEL}={MANAGED_BY}"
WATCHED_CHILDREN = (("apps", "v1", "deployments"), ("", "v1", "pods"))


def owner_key(obj: Mapping[str, Any]) -> Key | None:
    """The EmbeddingService that controls a child, from its owner reference."""
    meta = obj.get("metadata") or {}
    for ref in meta.get("ownerReferences") or []:
        if ref.get("controller") and ref.get("kind") == KIND:
            return meta.get("namespace", ""), ref["name"]
    return None


def _owner_of_pod(pod: Mapping[str, Any]) -> Key | None:
    # Pods belong to a ReplicaSet; the label written by the builders names the service.
    meta = pod.get("metadata") or {}
    name = (meta.get("labels") or {}).get(SERVICE_LABEL)
    return (meta.get("namespace", ""), name) if name else None


class Listings:
    """Tells a relist from kopf's listing events (type None), which come in one burst each
    time a watch lists its objects: one that arrives after a quiet gap, once a first listing
    was seen, starts a relist (a 410, a reconnect): what it lists says nothing of what was
    deleted meanwhile. (The watch-restart lines of kopf's log say the same, metrics.py; this
    does not depend on their wording.)"""

    def __init__(self, gap_seconds: float = 5.0, clock: Any = time.monotonic) -> None:
        self._gap = gap_seconds
        self._clock = clock
        self._last: dict[tuple[str, str], float] = {}

    def starts_relist(self, resource: str, namespace: str) -> bool:
        now = self._clock()
        last = self._last.get((resource, namespace))
        self._last[(resource, namespace)] = now
        return last is not None and now - last > self._gap


class NoDiffBase(kopf.DiffBaseStorage):
    """kopf deep-copies every watched object to diff it for change handlers; this operator has
    none (it reconciles current state), so skip that copy: most of kopf's CPU per event."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> None:  # type: ignore[override]
        return None

    def fetch(self, *, body: kopf.Body) -> None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: Any) -> None:
        return None


def configure_settings(settings: kopf.OperatorSettings) -> None:
    settings.peering.standalone = True
    settings.peering.mandatory = False
    # The operator records its own events; kopf's per-handler events would be noise and writes.
    settings.posting.enabled = False
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.networking.request_timeout = 60
    settings.persistence.diffbase_storage = NoDiffBase()
    # Pods and Deployments are filtered by the apiserver: those of other workloads are never
    # listed or streamed (the handlers' `labels=` filters alone would only drop them here).
    for resource in WATCHED_CHILDREN:
        settings.watching.label_selectors[resource] = MANAGED_SELECTOR


def register(registry: kopf.OperatorRegistry) -> None:
    """Attach the handlers to `registry`; the memo carries the config and, once started, the
    controller."""

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # kopf's own loaders: in-cluster service account first, then the kubeconfig.
        return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        configure_settings(settings)
        config: OperatorConfig = memo.config
        client = KubeClient.from_environment(max_threads=config.workers)
        client.write_fence = getattr(memo, "write_fence", None)
        client.on_fence = getattr(memo, "on_fence", lambda: None)
        metrics.API_REQUESTS.source = lambda: dict(client.requests)
        memo.heartbeat_task = asyncio.create_task(_beat())
        specs = ParsedSpecs()
        reconciler = Reconciler.create(client, config, specs)
        controller = Controller(
            reconciler,
            workers=config.workers,
            resync_seconds=config.resync_seconds,
            exists=lambda body: _exists(client, EMBEDDING_SERVICE, body),
            on_gone=lambda body: _forget(memo, body),
        )
        controller.start()
        memo.client = client
        memo.controller = controller
        memo.specs = specs
        memo.gatekeeper = _start_gatekeeper(memo, client, recorder=EventRecorder(client))
        metrics.WATCH_RESTART_HOOKS[:] = [lambda resource: _relisted(memo, resource)]
        memo.listings = Listings()
        memo.observer = TrafficObserver(client, memo.http, controller.body, specs)
        memo.stats_task = None
        if config.stats_file:
            memo.stats_task = asyncio.create_task(
                stats.write_forever(Path(config.stats_file), client, controller)
            )
        logger.info(
            "warmgate operator started: namespaces=%s, default image %s",
            ",".join(config.namespaces) or "*",
            config.default_image,
        )

    @kopf.on.cleanup(registry=registry)
    async def cleanup(memo: kopf.Memo, **_: Any) -> None:
        heartbeat: asyncio.Task[None] | None = getattr(memo, "heartbeat_task", None)
        if heartbeat is not None:
            heartbeat.cancel()
        for worker in (getattr(memo, "gatekeeper", None), getattr(memo, "observer", None)):
            if worker is not None:
                await worker.close()
        session: aiohttp.ClientSession | None = getattr(memo, "http", None)
        if session is not None:
            await session.close()
        stats_task: asyncio.Task[None] | None = getattr(memo, "stats_task", None)
        if stats_task is not None:
            stats_task.cancel()
        controller: Controller | None = getattr(memo, "controller", None)
        if controller is not None:
            await controller.stop()
        client: KubeClient | None = getattr(memo, "client", None)
        if client is not None:
            logger.info("api requests made: %s", dict(client.requests))
            config: OperatorConfig = memo.config
            if controller is not None and config.stats_file:
                stats.write(Path(config.stats_file), stats.snapshot(client, controller))
            client.close()

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    async def embedding_service_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
        metrics.WATCH_EVENTS.labels(resource=PLURAL).inc()
        meta = event["object"]["metadata"]
        if event["type"] is None and memo.listings.starts_relist(PLURAL, meta["namespace"]):
            memo.controller.relisted()
        deleted = event["type"] == "DELETED"
        memo.controller.observe(event["object"], deleted=deleted)
        memo.observer.observe((meta["namespace"], meta["name"]), deleted=deleted)
        if deleted:
            memo.specs.forget(meta.get("uid"))

    @kopf.on.event(*WATCHED_CHILDREN[0], labels=MANAGED, registry=registry)
    async def deployment_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
        metrics.WATCH_EVENTS.labels(resource="deployments").inc()
        key = owner_key(event["object"])
        if key is not None:
            memo.controller.enqueue_soon(key)

    @kopf.on.event(*WATCHED_CHILDREN[1], labels=MANAGED, registry=registry)
    async def pod_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
        metrics.WATCH_EVENTS.labels(resource="pods").inc()
        namespace = event["object"]["metadata"].get("namespace", "")
        if event.get("type") is None and memo.listings.starts_relist("pods", namespace):
            memo.gatekeeper.relisted()
        # The warm gate judges the pod; the owner's status follows the pod.
        memo.gatekeeper.observe(event.get("type"), event["object"])
        key = _owner_of_pod(event["object"])
        if key is not None:
            memo.controller.enqueue_soon(key)


async def _exists(client: KubeClient, kind: ResourceKind, body: Mapping[str, Any]) -> bool | None:
    """Whether the object still exists with the same uid (a GET)."""
    meta = body.get("metadata") or {}
    current = await client.get(kind, meta.get("namespace", ""), meta.get("name", ""))
    return current is not None and current["metadata"].get("uid") == meta.get("uid")


def _forget(memo: kopf.Memo, body: Mapping[str, Any]) -> None:
    meta = body["metadata"]
    memo.observer.observe((meta["namespace"], meta["name"]), deleted=True)
    memo.specs.forget(meta.get("uid"))


def _relisted(memo: kopf.Memo, resource: str) -> None:
    """A watch restarted: what it lists again says nothing of what was deleted meanwhile."""
    name = resource.split(".", 1)[0]
    if name == PLURAL:
        memo.controller.relisted()
    elif name == "pods":
        memo.gatekeeper.relisted()


async def _beat() -> None:
    """The event loop's heartbeat, for /healthz."""
    while True:
        metrics.HEARTBEAT.beat()
        await asyncio.sleep(2.0)


def _start_gatekeeper(memo: kopf.Memo, client: KubeClient, recorder: EventRecorder) -> Gatekeeper:
    """The warm gate's workers: they verify each gated pod's /ready report and patch its
    warmgate.dev/warmed condition, and record what an ungated pod loaded (see gatekeeper.py)."""
    config = GateConfig()
    memo.http = aiohttp.ClientSession(trust_env=False)

    async def record(pod: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
        body = {**pod, "apiVersion": "v1", "kind": "Pod"}
        await recorder.record(body, type_, reason, message)
        owner = _owner_of_pod(pod)
        service = memo.controller.body(owner) if owner is not None else None
        if service is not None and type_ == "Warning":
            # Also on the EmbeddingService, where `kubectl describe emb` shows it.
            await recorder.record(service, type_, reason, message)

    def verify_latency(pod: Mapping[str, Any]) -> bool:
        owner = _owner_of_pod(pod)
        service = memo.controller.body(owner) if owner is not None else None
        if service is None:
            return False
        try:
            return memo.specs.of(service).rollout.verify_latency
        except SpecError:
            return False

    return Gatekeeper(
        writer=KubeClientStatusWriter(client),
        reports=ReportClient(memo.http, config),
        events=record,
        config=config,
        verify_latency=verify_latency,
        exists=lambda pod: _exists(client, POD, pod),
    )
