"""A view of the cluster in memory: each kind is listed once and then watched, into a Store
that its readers consult instead of asking the API. Like client-go's Reflector and Store, without
the parts warmgate does not need; the operator (its cache of EmbeddingServices and the children
they own) and the router (names and Ready endpoints) both read through it.

After a watch gap (a 410 for a resource version too old, a restarted apiserver) an object
deleted meanwhile gets no DELETED event. Here a relist is an explicit event that carries the
whole listing, and what the store held that the listing lacks is gone (`Listing.gone`): an
EmbeddingService deleted during the gap does not have its children created again, and a
router does not keep forwarding to an endpoint that left.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from .client import ApiError, KubeClient
from .kinds import ResourceKind

log = logging.getLogger("warmgate.watch")

ADDED, MODIFIED, DELETED = "ADDED", "MODIFIED", "DELETED"

Key = tuple[str, str]  # (namespace, name)


def key_of(obj: Mapping[str, Any]) -> Key:
    meta = obj["metadata"]
    return meta.get("namespace", ""), meta["name"]


def _uid(obj: Mapping[str, Any]) -> str | None:
    return obj["metadata"].get("uid")


def _stamp(obj: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """(uid, resourceVersion): which object, at which version."""
    return _uid(obj), obj["metadata"].get("resourceVersion")


def resource_version(obj: Mapping[str, Any]) -> int | None:
    """The resourceVersion as a number (etcd's revision), None when it is not one."""
    try:
        return int(obj["metadata"]["resourceVersion"])
    except (KeyError, TypeError, ValueError):
        return None


@dataclass(frozen=True)
class Change:
    """One object added, modified or deleted, as a watch reported it."""

    kind: ResourceKind
    type: str  # ADDED | MODIFIED | DELETED
    obj: dict[str, Any]


@dataclass(frozen=True)
class Listing:
    """A whole listing of a kind (in one namespace, or in all with None): the first, or a relist
    after a watch gap, whose `gone` are the objects held before that it no longer has (deleted
    during the gap, or replaced by a new object of the same name)."""

    kind: ResourceKind
    namespace: str | None
    objects: tuple[dict[str, Any], ...]
    gone: tuple[dict[str, Any], ...]
    relist: bool


Event = Change | Listing
Sink = Callable[[Event], None]


class Store:
    """The objects of one kind by (namespace, name), also found by the value of one label (the
    EmbeddingService a child belongs to)."""

    def __init__(self, kind: ResourceKind, index_label: str | None = None) -> None:
        self.kind = kind
        self._objects: dict[Key, dict[str, Any]] = {}
        self._index_label = index_label
        self._index: dict[Key, set[Key]] = {}

    def __len__(self) -> int:
        return len(self._objects)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(list(self._objects.values()))

    def keys(self) -> list[Key]:
        return list(self._objects)

    def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._objects.get((namespace, name))

    def in_namespace(self, namespace: str) -> list[dict[str, Any]]:
        return [obj for key, obj in sorted(self._objects.items()) if key[0] == namespace]

    def labelled(self, namespace: str, value: str) -> list[dict[str, Any]]:
        """The objects in `namespace` whose index label is `value`."""
        keys = self._index.get((namespace, value), ())
        return [self._objects[key] for key in sorted(keys)]

    def replace(self, namespace: str | None, objects: Iterable[dict[str, Any]]) -> list[dict]:
        """Hold exactly `objects` for `namespace` (all with None); return those held before that
        the listing lacks, or has with another uid."""
        listed = {key_of(obj): obj for obj in objects}
        gone = []
        for key, held in list(self._objects.items()):
            if namespace is not None and key[0] != namespace:
                continue
            current = listed.get(key)
            if current is None or _uid(current) != _uid(held):
                gone.append(held)
                self._drop(key)
        for obj in listed.values():
            self._put(obj)
        return gone

    def versions(self, namespace: str | None) -> dict[Key, tuple[str | None, str | None]]:
        """(uid, resourceVersion) of each object held in `namespace` (all with None): what an
        audit compares a listing with (`prune`)."""
        return {
            key: _stamp(obj)
            for key, obj in self._objects.items()
            if namespace is None or key[0] == namespace
        }

    def prune(
        self,
        objects: Iterable[Mapping[str, Any]],
        held: Mapping[Key, tuple[str | None, str | None]],
    ) -> list[dict[str, Any]]:
        """Drop what was `held` (versions() of the listing's namespace, taken before the listing
        was asked for) that the listing `objects` lacks, or has with another uid, and return
        it. An object whose version changed since `held` was taken is left alone: an event
        newer than the snapshot speaks for it. Nothing listed is put in: that is for the events
        that follow."""
        listed = {key_of(obj): _uid(obj) for obj in objects}
        gone = []
        for key, snapshot in held.items():
            current = self._objects.get(key)
            if current is None or _stamp(current) != snapshot:
                continue
            if listed.get(key, "") != snapshot[0]:
                gone.append(current)
                self._drop(key)
        return gone

    def apply(self, event_type: str, obj: dict[str, Any]) -> bool:
        """Take a watch event; False when it changes nothing held (the echo of a write whose
        answer `record` already took)."""
        key = key_of(obj)
        if event_type == DELETED:
            held = self._objects.get(key)
            if held is None or _uid(held) != _uid(obj):
                return False
            self._drop(key)
            return True
        held = self._objects.get(key)
        version = obj["metadata"].get("resourceVersion")
        if (
            held is not None
            and _uid(held) == _uid(obj)
            and held["metadata"].get("resourceVersion") == version
        ):
            return False
        self._put(obj)
        return True

    def record(self, obj: Mapping[str, Any] | None) -> None:
        """Take the answer of this operator's own write, unless the cache already holds a newer
        copy: the next reconcile then sees the write before its watch event arrives."""
        if not obj or "metadata" not in obj:
            return
        held = self._objects.get(key_of(obj))
        if held is not None and _uid(held) == _uid(obj):
            old, new = resource_version(held), resource_version(obj)
            if old is not None and new is not None and new <= old:
                return
        self._put(dict(obj))

    def _put(self, obj: dict[str, Any]) -> None:
        key = key_of(obj)
        self._drop(key)
        self._objects[key] = obj
        value = self._label(obj)
        if value is not None:
            self._index.setdefault((key[0], value), set()).add(key)

    def _drop(self, key: Key) -> None:
        held = self._objects.pop(key, None)
        value = None if held is None else self._label(held)
        if value is not None:
            keys = self._index.get((key[0], value))
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._index[(key[0], value)]

    def _label(self, obj: Mapping[str, Any]) -> str | None:
        if self._index_label is None:
            return None
        return (obj["metadata"].get("labels") or {}).get(self._index_label)


@dataclass(frozen=True)
class WatchSettings:
    timeout_seconds: int = 300
    """How long one watch request lasts before the apiserver closes it (it is then renewed
    from its last resource version, without a listing)."""
    backoff_initial_seconds: float = 1.0
    backoff_max_seconds: float = 30.0
    page_size: int = 500


def backoff(settings: WatchSettings) -> Iterator[float]:
    """The waits between failed calls: doubling from the first to the longest."""
    delay = settings.backoff_initial_seconds
    while True:
        yield delay
        delay = min(delay * 2, settings.backoff_max_seconds)


def with_kind(kind: ResourceKind, obj: dict[str, Any]) -> dict[str, Any]:
    """`obj` with its apiVersion and kind: a listing's items carry none, a watch event's do."""
    obj.setdefault("apiVersion", kind.api_version)
    obj.setdefault("kind", kind.kind)
    return obj


class Reflector:
    """Lists one kind (in one namespace, or in all), then watches it from the listing's
    resource version into `store`, telling `sink` of every listing and change. A watch that
    ends is renewed from where it stopped; one whose version has expired (410), or that
    reports any error, is followed by a relist."""

    def __init__(
        self,
        client: KubeClient,
        store: Store,
        sink: Sink,
        namespace: str | None = None,
        label_selector: str = "",
        settings: WatchSettings = WatchSettings(),
        on_relist: Callable[[ResourceKind], None] = lambda kind: None,
        optional: bool = False,
    ) -> None:
        """`optional`: a kind whose CRD may not be installed (a 404 for the listing): it is
        then taken as empty, and listed again every `backoff_max_seconds` until it is."""
        self._client = client
        self._store = store
        self._sink = sink
        self._namespace = namespace
        self._selector = label_selector
        self._settings = settings
        self._on_relist = on_relist
        self._optional = optional
        self.synced = asyncio.Event()
        """Set once the first listing is in the store."""

    @property
    def kind(self) -> ResourceKind:
        return self._store.kind

    def __repr__(self) -> str:
        where = self._namespace or "every namespace"
        return f"{self.kind.plural} in {where}"

    async def run(self) -> None:
        backoff = self._backoff()
        while True:
            try:
                objects, version = await self._client.list(
                    self.kind, self._namespace, self._selector, self._settings.page_size
                )
            except ApiError as error:
                if self._optional and error.status == 404:
                    self._absent()
                    await asyncio.sleep(self._settings.backoff_max_seconds)
                else:
                    log.warning("listing %s failed: %s", self, error)
                    await asyncio.sleep(next(backoff))
                continue
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as error:
                log.warning("listing %s failed: %s", self, error)
                await asyncio.sleep(next(backoff))
                continue
            backoff = self._backoff()
            for obj in objects:
                with_kind(self.kind, obj)
            relist = self.synced.is_set()
            gone = self._store.replace(self._namespace, objects)
            if relist:
                self._on_relist(self.kind)
                log.info("relisted %s: %d objects, %d gone", self, len(objects), len(gone))
            self._sink(Listing(self.kind, self._namespace, tuple(objects), tuple(gone), relist))
            self.synced.set()
            await self._watch(version)

    def _absent(self) -> None:
        """The kind is not served (its CRD is not installed): hold none of it, so that
        whoever waits for the first listing is not kept waiting."""
        if not self.synced.is_set():
            log.warning(
                "%s: the API does not serve %s (is its CRD installed? kubectl apply -f crds/); "
                "taken as none, listed again every %.0f s",
                self,
                self.kind.kind,
                self._settings.backoff_max_seconds,
            )
        gone = self._store.replace(self._namespace, [])
        if not self.synced.is_set() or gone:
            self._sink(Listing(self.kind, self._namespace, (), tuple(gone), self.synced.is_set()))
        self.synced.set()

    async def _watch(self, version: str) -> None:
        """Watch from `version` until a relist is needed."""
        backoff = self._backoff()
        while True:
            try:
                async for event in self._client.watch(
                    self.kind,
                    self._namespace,
                    version,
                    self._selector,
                    self._settings.timeout_seconds,
                ):
                    event_type, obj = event.get("type"), event.get("object") or {}
                    if event_type == "ERROR":
                        log.info("watch of %s: %s; listing again", self, obj.get("message"))
                        return
                    version = (obj.get("metadata") or {}).get("resourceVersion") or version
                    if event_type in (ADDED, MODIFIED, DELETED) and self._store.apply(
                        event_type, obj
                    ):
                        self._sink(Change(self.kind, event_type, obj))
                backoff = self._backoff()  # the server's timeout ended it: renew at once
            except ApiError as error:
                if error.status == 410:
                    log.info("watch of %s: version %s expired; listing again", self, version)
                    return
                log.warning("watch of %s refused: %s", self, error)
                await asyncio.sleep(next(backoff))
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as error:
                log.warning("watch of %s broke: %s", self, error or type(error).__name__)
                await asyncio.sleep(next(backoff))

    def _backoff(self) -> Iterator[float]:
        return backoff(self._settings)
