"""The operator as one object: built in `__main__` from the configuration (no I/O, no event
loop needed), handed to kopf as its memo, started by kopf's startup handler, fed the custom
resources by kopf's event handlers (`observe`) and stopped by its cleanup handler (handlers.py).

What it runs: the ResourceFeed holding the EmbeddingServices and aliases kopf carries (feed.py:
its seed and audits say what kopf cannot); one Reflector per child kind (and namespace) filling
the rest of the Cache; the Controller reconciling EmbeddingServices from it; the AliasKeeper
writing each EmbeddingAlias's status; the Gatekeeper verifying each gated pod; the
TrafficObserver collecting served shapes. Events reach them through `dispatch`, the one place
that decides who hears of what.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from warmgate_contract.names import MANAGED_BY, MANAGED_BY_LABEL, SERVICE_LABEL
from warmgate_kube.client import KubeClient
from warmgate_kube.kinds import (
    CONFIGMAP,
    DEPLOYMENT,
    EMBEDDING_ALIAS,
    EMBEDDING_SERVICE,
    HPA,
    PDB,
    POD,
    SERVICE,
    ResourceKind,
)
from warmgate_kube.watch import DELETED, Event, Listing, Reflector, WatchSettings

from . import stats
from .aliases import AliasKeeper
from .config import OperatorConfig
from .controller import Controller
from .events import EventRecorder
from .feed import ResourceFeed
from .gatekeeper import Gatekeeper
from .metrics import Metrics
from .observed import TrafficObserver
from .podclient import PodClient
from .reconcile import Reconciler
from .roles import RoleKeeper
from .spec import ParsedSpecs, SpecError
from .watch import Cache

log = logging.getLogger("warmgate.operator")

CHILD_KINDS = (DEPLOYMENT, POD, SERVICE, CONFIGMAP, HPA, PDB)
MANAGED_SELECTOR = f"{MANAGED_BY_LABEL}={MANAGED_BY}"
"""What the child watches ask the apiserver for: other workloads' pods and Deployments are
never sent to the operator."""

HEARTBEAT_SECONDS = 2.0
DEFAULT_WATCH = WatchSettings()


class PodStatusWriter:
    """Patches `pods/<name>/status` with a strategic-merge patch (conditions merge by type, so
    kubelet's own are left as they are), and keeps the answer in the cache."""

    def __init__(self, client: KubeClient, cache: Cache) -> None:
        self._client = client
        self._cache = cache

    async def patch_status(
        self, namespace: str, name: str, body: dict[str, Any]
    ) -> dict[str, Any] | None:
        written = await self._client.request(
            "PATCH",
            POD.path(namespace, name, "status"),
            body=body,
            content_type="application/strategic-merge-patch+json",
        )
        self._cache.record(POD, written)
        return written if isinstance(written, dict) else None


@dataclass(frozen=True)
class Operator:
    config: OperatorConfig
    client: KubeClient
    metrics: Metrics
    cache: Cache
    specs: ParsedSpecs
    recorder: EventRecorder
    pods: PodClient
    controller: Controller
    gatekeeper: Gatekeeper
    observer: TrafficObserver
    feed: ResourceFeed
    watch_settings: WatchSettings = DEFAULT_WATCH
    roles: RoleKeeper | None = None
    aliases: AliasKeeper | None = None
    _tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    _started: asyncio.Event = field(default_factory=asyncio.Event)

    def __copy__(self) -> Operator:
        # kopf hands each object's handlers copy.copy(memo), kept until that object's DELETED:
        # one Operator, and nothing kept for an object deleted during a watch gap.
        return self

    @classmethod
    def build(
        cls,
        config: OperatorConfig,
        client: KubeClient,
        metrics: Metrics,
        watch_settings: WatchSettings = DEFAULT_WATCH,
        carried: Iterable[ResourceKind] = (),
    ) -> Operator:
        """`carried`: the custom resource kinds kopf delivers (`observe`); the others are
        watched by the operator's own Reflectors (a CRD not served when the process started,
        which kopf would never watch; every kind, in tests that run without kopf)."""
        cache = Cache(EMBEDDING_SERVICE, CHILD_KINDS, SERVICE_LABEL, EMBEDDING_ALIAS)
        specs = ParsedSpecs()
        recorder = EventRecorder(client)
        pods = PodClient(metrics)
        status_writer = PodStatusWriter(client, cache)
        roles = RoleKeeper(status_writer, pods)
        reconciler = Reconciler(
            client,
            config,
            recorder,
            cache,
            roles=roles,
            metrics=metrics,
            specs=specs,
            evict=lambda body: operator.evict(body),
        )
        controller = Controller(
            reconciler,
            cache.services,
            metrics,
            workers=config.workers,
            resync_seconds=config.resync_seconds,
        )
        operator: Operator

        async def record(pod: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
            await operator.record_pod_event(pod, type_, reason, message)

        gatekeeper = Gatekeeper(
            status_writer,
            pods,
            record,
            metrics,
            verify_latency=lambda pod: operator.verifies_latency(pod),
        )
        observer = TrafficObserver(client, pods, cache, specs)
        metrics.count_api_requests(lambda: dict(client.requests))
        stores = {EMBEDDING_SERVICE: cache.services, EMBEDDING_ALIAS: cache.aliases}
        feed = ResourceFeed(
            client,
            {kind: stores[kind] for kind in carried},
            config.namespaces,
            lambda event: operator.dispatch(event),
            on_audit=lambda kind: operator.count_relist(kind),
            settings=watch_settings,
        )
        operator = cls(
            config,
            client,
            metrics,
            cache,
            specs,
            recorder,
            pods,
            controller,
            gatekeeper,
            observer,
            feed,
            watch_settings,
            roles,
            AliasKeeper(client, cache, recorder, metrics),
        )
        return operator

    # -- lifecycle -----------------------------------------------------------------------------

    def reflectors(self) -> list[Reflector]:
        """One per kind the operator watches itself, and namespace (one per kind when watching
        every namespace): the children, and any custom resource kopf does not carry."""
        namespaces: tuple[str | None, ...] = self.config.namespaces or (None,)
        custom = (self.cache.services, self.cache.aliases)
        return [
            Reflector(
                self.client,
                store,
                self.dispatch,
                namespace,
                # Every EmbeddingService and alias (they are all names); warmgate's children only.
                "" if store in custom else MANAGED_SELECTOR,
                self.watch_settings,
                on_relist=lambda kind, namespace=namespace: self._relisted(kind, namespace),
                # An operator started before a CRD was applied still operates.
                optional=store in custom,
            )
            for store in self.cache.stores()
            if store.kind not in self.feed.kinds
            for namespace in namespaces
        ]

    async def start(self) -> None:
        """Seed the custom resources kopf carries, list the rest, and once every cache holds
        its first listing, reconcile: a reconcile before that would take children not listed
        yet for missing. kopf starts its own watchers only after this returns."""
        self._spawn(self._beat(), "heartbeat")
        reflectors = self.reflectors()
        for reflector in reflectors:
            self._spawn(reflector.run(), f"watch {reflector}")
        if self.config.stats_file:
            path = Path(self.config.stats_file)
            self._spawn(stats.write_forever(path, self.client, self.controller), "stats")
        await self.feed.seed()
        await asyncio.gather(*(reflector.synced.wait() for reflector in reflectors))
        self.controller.start()
        if self.aliases is not None:
            self.aliases.start()
        self._started.set()
        log.info(
            "warmgate operator started: namespaces=%s, default image %s, kopf carries %s",
            ",".join(self.config.namespaces) or "*",
            self.config.default_image,
            ", ".join(kind.plural for kind in self.feed.kinds) or "nothing",
        )

    def listed(self) -> bool:
        """Every watched kind's first listing is in, and reconciling has begun."""
        return self._started.is_set()

    def observe(self, kind: ResourceKind, event_type: str | None, obj: Mapping[str, Any]) -> None:
        """An EmbeddingService or alias event, as kopf delivers it (handlers.py)."""
        self.feed.observe(kind, event_type, obj)

    def evict(self, body: Mapping[str, Any]) -> None:
        """`body` is held but the apiserver no longer has it (an owner GET found it gone, or
        replaced by a new object): forget it as if its DELETED had arrived."""
        if self.cache.services.apply(DELETED, dict(body)):
            log.info(
                "%s/%s was deleted while the watch was away: forgotten",
                body["metadata"].get("namespace"),
                body["metadata"].get("name"),
            )
            self._changed(EMBEDDING_SERVICE, DELETED, body)

    async def stop(self) -> None:
        await self.feed.stop()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        await self.gatekeeper.close()
        await self.observer.close()
        await self.controller.stop()
        if self.aliases is not None:
            await self.aliases.stop()
        await self.pods.close()
        log.info("api requests made: %s", dict(self.client.requests))
        if self.config.stats_file:
            stats.write(Path(self.config.stats_file), stats.snapshot(self.client, self.controller))
        await self.client.aclose()

    def _spawn(self, coroutine: Any, name: str) -> None:
        self._tasks.append(asyncio.create_task(coroutine, name=name))

    async def _beat(self) -> None:
        """The event loop's heartbeat, for /healthz."""
        while True:
            self.metrics.heartbeat.beat()
            await asyncio.sleep(HEARTBEAT_SECONDS)

    def count_relist(self, kind: ResourceKind) -> None:
        self.metrics.relists.labels(resource=kind.plural).inc()

    def _relisted(self, kind: ResourceKind, namespace: str | None) -> None:
        """An own watch relisted after a gap: the same gap may have hidden the deletion of an
        EmbeddingService whose namespace kopf's relist found empty (feed.py)."""
        self.count_relist(kind)
        self.feed.audit_soon(namespace)

    # -- who hears of what ---------------------------------------------------------------------

    def dispatch(self, event: Event) -> None:
        """A listing or a change from a watch, already in the cache."""
        if isinstance(event, Listing):
            for obj in event.gone:  # deleted while the watch was away
                self._changed(event.kind, DELETED, obj)
            for obj in event.objects:
                self._changed(event.kind, None, obj)
            return
        self.metrics.watch_events.labels(resource=event.kind.plural).inc()
        self._changed(event.kind, event.type, event.obj)

    def _changed(self, kind: ResourceKind, event_type: str | None, obj: Mapping[str, Any]) -> None:
        meta = obj["metadata"]
        if kind in (EMBEDDING_SERVICE, EMBEDDING_ALIAS) and self.aliases is not None:
            # Names: an alias's status follows its own changes and every EmbeddingService's
            # of its namespace (created, deleted, or serving another revision).
            self.aliases.enqueue(meta["namespace"])
        if kind == EMBEDDING_ALIAS:
            # An alias named like an EmbeddingService may hold that one's name (its Conflict
            # condition says so), or let go of it.
            key = (meta["namespace"], meta["name"])
            if self.cache.services.get(*key) is not None:
                self.controller.enqueue(key)
            return
        if kind == EMBEDDING_SERVICE:
            key = (meta["namespace"], meta["name"])
            deleted = event_type == DELETED
            self.observer.observe(key, deleted=deleted)
            if deleted:
                self.controller.forget(key)
                self.specs.forget(meta.get("uid"))
                if self.roles is not None:
                    self.roles.forget(key)
            else:
                self.controller.enqueue(key)
            return
        if kind == POD:
            # The warm gate judges the pod; the owner's status follows the pod.
            self.gatekeeper.observe(event_type, obj)
        owner = (meta.get("labels") or {}).get(SERVICE_LABEL)
        if owner:
            self.controller.enqueue_soon((meta["namespace"], owner))

    # -- what the warm gate asks ---------------------------------------------------------------

    def service_of(self, pod: Mapping[str, Any]) -> dict[str, Any] | None:
        meta = pod.get("metadata") or {}
        owner = (meta.get("labels") or {}).get(SERVICE_LABEL)
        return self.cache.services.get(meta.get("namespace", ""), owner) if owner else None

    def verifies_latency(self, pod: Mapping[str, Any]) -> bool:
        service = self.service_of(pod)
        if service is None:
            return False
        try:
            return self.specs.of(service).rollout.verify_latency
        except SpecError:
            return False

    async def record_pod_event(
        self, pod: Mapping[str, Any], type_: str, reason: str, message: str
    ) -> None:
        pod = {**pod, "apiVersion": "v1", "kind": "Pod"}
        await self.recorder.record(pod, type_, reason, message)
        service = self.service_of(pod)
        if service is not None and type_ == "Warning":
            # Also on the EmbeddingService, where `kubectl describe emb` shows it.
            await self.recorder.record(service, type_, reason, message)
