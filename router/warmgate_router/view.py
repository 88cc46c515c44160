"""What the router knows of the cluster, in memory: the EmbeddingServices and aliases (the model
names, resolved by warmgate_contract.aliases as the operator resolves them) and the Ready
endpoints of each service's EndpointSlices (only pods the warm gate verified are Ready; with a
standby pool, only serving ones)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from warmgate_contract.aliases import NameTable, Resolution, claims_of
from warmgate_contract.names import SERVER_PORT_NAME
from warmgate_kube.kinds import EMBEDDING_ALIAS, EMBEDDING_SERVICE, ENDPOINT_SLICE, ResourceKind
from warmgate_kube.watch import DELETED, Change, Event, Key, Listing, Store, key_of

SERVICES = EMBEDDING_SERVICE
ALIASES = EMBEDDING_ALIAS
SLICES = ENDPOINT_SLICE
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
# The EndpointSlice controller copies a Service's labels onto its slices: the operator's
# Services are labelled managed-by warmgate, so the router watches only their slices.
SLICE_SELECTOR = "app.kubernetes.io/managed-by=warmgate"


@dataclass(frozen=True)
class Endpoint:
    address: str
    port: int
    pod: str

    @property
    def key(self) -> str:
        return f"{self.address}:{self.port}"

    @property
    def url(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"http://{host}:{self.port}"


def ready_endpoints(slices: Iterable[dict[str, Any]]) -> list[Endpoint]:
    """The Ready, not terminating endpoints of a service's slices, on its server port."""
    found: dict[str, Endpoint] = {}
    for item in slices:
        ports = [p for p in item.get("ports") or [] if p.get("port")]
        named = [p for p in ports if p.get("name") == SERVER_PORT_NAME] or ports[:1]
        if not named:
            continue
        port = int(named[0]["port"])
        for endpoint in item.get("endpoints") or []:
            conditions = endpoint.get("conditions") or {}
            if conditions.get("ready") is False or conditions.get("terminating"):
                continue
            pod = (endpoint.get("targetRef") or {}).get("name", "")
            for address in endpoint.get("addresses") or []:
                found.setdefault(f"{address}:{port}", Endpoint(address, port, pod))
    return sorted(found.values(), key=lambda e: e.key)


class View:
    """The router's three Stores, filled by warmgate_kube Reflectors (`take` is their sink),
    and what it derives from them at each change: the name table and the Ready endpoints."""

    def __init__(self) -> None:
        self.services = Store(SERVICES)
        self.aliases = Store(ALIASES)
        self.slices = Store(SLICES)
        self.names = NameTable.build(())
        self.endpoints: dict[Key, list[Endpoint]] = {}
        self._available: dict[Key, asyncio.Event] = {}
        self.version = 0  # bumped on every change (for tests and /v1/models caching)

    # -- from the reflectors --------------------------------------------------------------
    def store(self, kind: ResourceKind) -> Store:
        return {SERVICES: self.services, ALIASES: self.aliases, SLICES: self.slices}[kind]

    def take(self, event: Event) -> None:
        """A Reflector's listing or change, already in the kind's Store."""
        if isinstance(event, Listing):
            self._refresh(event.kind)
        elif isinstance(event, Change):
            self._refresh(event.kind, event.obj)

    def on_listing(
        self, kind: ResourceKind, namespace: str | None, items: list[dict[str, Any]]
    ) -> None:
        """Hold exactly `items` of `kind` in `namespace` (all with None)."""
        self.store(kind).replace(namespace, items)
        self._refresh(kind)

    def on_change(self, kind: ResourceKind, event: str, obj: dict[str, Any]) -> None:
        """One object ADDED, MODIFIED or DELETED, held as given (a Reflector's events go
        through `take`, already in the Store)."""
        store = self.store(kind)
        if event == DELETED:
            store.apply(DELETED, obj)
        else:
            store.record(obj)
        self._refresh(kind, obj)

    def _refresh(self, kind: ResourceKind, obj: dict[str, Any] | None = None) -> None:
        self.version += 1
        if kind is SLICES:
            namespaces = {obj["metadata"].get("namespace", "")} if obj else None
            self._refresh_endpoints(namespaces)
        else:
            self.names = NameTable.build(claims_of(self.services, self.aliases))

    def _refresh_endpoints(self, namespaces: set[str] | None) -> None:
        grouped: dict[Key, list[dict[str, Any]]] = {}
        for item in self.slices:
            namespace = key_of(item)[0]
            if namespaces is not None and namespace not in namespaces:
                continue
            service = (item["metadata"].get("labels") or {}).get(SERVICE_NAME_LABEL)
            if service:
                grouped.setdefault((namespace, service), []).append(item)
        keys = [k for k in self.endpoints if namespaces is None or k[0] in namespaces]
        for key in set(keys) | set(grouped):
            endpoints = ready_endpoints(grouped.get(key, ()))
            if endpoints:
                self.endpoints[key] = endpoints
            else:
                self.endpoints.pop(key, None)
            event = self._available.get(key)
            if endpoints and event is not None:
                event.set()
                del self._available[key]

    # -- for requests ---------------------------------------------------------------------
    def lookup(self, model: str) -> Resolution | str:
        return self.names.lookup(model)

    def service(self, key: Key) -> dict[str, Any] | None:
        return self.services.get(*key)

    def ready(self, key: Key) -> list[Endpoint]:
        return self.endpoints.get(key, [])

    async def wait_ready(self, key: Key, seconds: float) -> bool:
        """Until `key` has a Ready endpoint (True) or `seconds` pass (False)."""
        if self.endpoints.get(key):
            return True
        event = self._available.setdefault(key, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), seconds)
        except TimeoutError:
            return bool(self.endpoints.get(key))
        return True


def scale_to_zero(service: dict[str, Any]) -> bool:
    """Whether the EmbeddingService scales to zero (autoscaling.scaleToZero is set)."""
    autoscaling = (service.get("spec") or {}).get("autoscaling") or {}
    return bool(autoscaling.get("enabled")) and autoscaling.get("scaleToZero") is not None


ACTIVITY_FRACTION = 3
"""A service's last-request time is written at least this many times per idle window."""


def activity_interval(service: dict[str, Any] | None, configured: float) -> float:
    """Least seconds between two writes of `service`'s last-request time: --activity-seconds,
    but at most a third of its own scaleToZero.idleSeconds. The operator scales a service to
    zero once a whole idle window has passed since the latest write, so under steady traffic
    a write every window or less could arrive after the window closed (the write's latency,
    the operator's watch): the service would be put to sleep while it serves."""
    if service is None or not scale_to_zero(service):
        return configured
    window = ((service.get("spec") or {}).get("autoscaling") or {}).get("scaleToZero") or {}
    idle = window.get("idleSeconds")
    if not isinstance(idle, int | float) or idle <= 0:
        return configured
    return min(configured, idle / ACTIVITY_FRACTION)


def replicas(service: dict[str, Any]) -> int | None:
    value = (service.get("spec") or {}).get("replicas")
    return int(value) if isinstance(value, int) else None
