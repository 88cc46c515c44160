"""The custom resources as kopf carries them (handlers.py), and the part kopf cannot tell.

kopf delivers every EmbeddingService and EmbeddingAlias event to `observe`: ADDED, MODIFIED and
DELETED as they happen, and type None for each object of a listing (its first, or a relist after
a 410). What kopf never says is where a listing starts or ends, nor which objects vanished
during a watch gap: its relist yields only the objects that exist, and a relist of an empty
namespace yields nothing at all (tests/operator/test_handlers.py pins both). Without more, an
EmbeddingService deleted during a gap would stay held and have its children made again.

So the feed keeps three things of its own:
- **the seed**: one LIST per kind and namespace before kopf starts watching (kopf's watchers
  start only once the startup handler returns), so that the first reconcile sees every
  EmbeddingService and no child is taken for an orphan;
- **the audit**: after any listing that follows the seed (kopf's type-None events, or a relist
  of one of the operator's own child watches in that namespace, which a gap usually causes
  too), one LIST per kind; what the store held before and the listing lacks is gone, told to
  the operator as a relist's `gone`, exactly as an own Reflector would. Objects an event touched
  while the LIST was in flight are left alone: kopf's live watch speaks for them;
- the owner GET before a reconcile creates a child (reconcile.py) covers the one case left:
  a gap that expires only the EmbeddingService watch, in a namespace left empty.
None of it runs at idle: the audit only after a listing, the backstop only before a create.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp

from warmgate_kube.client import ApiError, KubeClient
from warmgate_kube.kinds import ResourceKind
from warmgate_kube.watch import (
    ADDED,
    DELETED,
    MODIFIED,
    Change,
    Listing,
    Sink,
    Store,
    WatchSettings,
    backoff,
    with_kind,
)

log = logging.getLogger("warmgate.operator")

AUDIT_DELAY_SECONDS = 0.5
"""How long an audit waits after the first sign of a listing: the rest of that listing (one
event per object) folds into the same audit."""


class ResourceFeed:
    """The kinds kopf carries, into their stores, told to `sink` as an own Reflector would."""

    def __init__(
        self,
        client: KubeClient,
        stores: Mapping[ResourceKind, Store],
        namespaces: tuple[str, ...],
        sink: Sink,
        on_audit: Callable[[ResourceKind], None] = lambda kind: None,
        settings: WatchSettings = WatchSettings(),  # noqa: B008 (frozen)
        audit_delay: float = AUDIT_DELAY_SECONDS,
    ) -> None:
        self._client = client
        self._stores = dict(stores)
        self._scopes: tuple[str | None, ...] = namespaces or (None,)
        self._sink = sink
        self._on_audit = on_audit
        self._settings = settings
        self._audit_delay = audit_delay
        self._seeded = False
        self._pending: dict[str | None, asyncio.Task[None]] = {}
        self._again: set[str | None] = set()
        self.audits = 0
        """Audit LISTs taken (one per kind)."""

    @property
    def kinds(self) -> tuple[ResourceKind, ...]:
        return tuple(self._stores)

    def scope_of(self, namespace: str | None) -> str | None:
        return None if self._scopes == (None,) else namespace

    async def seed(self) -> None:
        """List every carried kind in every watched namespace into its store, retrying until
        the apiserver answers."""
        for kind, store in self._stores.items():
            for scope in self._scopes:
                objects = await self._list_until_answered(kind, scope)
                gone = store.replace(scope, objects)
                self._sink(Listing(kind, scope, tuple(objects), tuple(gone), relist=False))
        self._seeded = True

    def observe(self, kind: ResourceKind, event_type: str | None, obj: Mapping[str, Any]) -> None:
        """One event as kopf delivers it (`event_type` None: a member of a listing)."""
        store = self._stores.get(kind)
        if store is None:
            return
        obj = with_kind(kind, dict(obj))
        if event_type is None:
            if store.apply(ADDED, obj):
                namespace = obj["metadata"].get("namespace")
                self._sink(Listing(kind, namespace, (obj,), (), relist=self._seeded))
            if self._seeded:
                self.audit_soon(obj["metadata"].get("namespace"))
        elif event_type in (ADDED, MODIFIED, DELETED) and store.apply(event_type, obj):
            # Store.apply compares uids: kopf's per-object workers run in no order across
            # objects, so a DELETED of an old object can follow the ADDED of a new one of the
            # same name; it then changes nothing.
            self._sink(Change(kind, event_type, obj))

    def audit_soon(self, namespace: str | None) -> None:
        """A listing happened in `namespace` (or a child watch relisted there): audit what is
        held there against one LIST, once, shortly."""
        if not self._seeded or not self._stores:
            return
        scope = self.scope_of(namespace)
        if scope in self._pending:
            self._again.add(scope)
            return
        self._pending[scope] = asyncio.create_task(self._audits(scope), name=f"audit {scope}")

    async def stop(self) -> None:
        tasks = list(self._pending.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _audits(self, scope: str | None) -> None:
        try:
            while True:
                await asyncio.sleep(self._audit_delay)
                self._again.discard(scope)
                await self._audit(scope)
                if scope not in self._again:
                    return
        finally:
            self._pending.pop(scope, None)

    async def _audit(self, scope: str | None) -> None:
        for kind, store in self._stores.items():
            held = store.versions(scope)
            objects = await self._list_until_answered(kind, scope)
            gone = store.prune(objects, held)
            self.audits += 1
            self._on_audit(kind)
            if gone:
                where = scope or "every namespace"
                log.info(
                    "%s in %s: %d gone while the watch was away", kind.plural, where, len(gone)
                )
                self._sink(Listing(kind, scope, (), tuple(gone), relist=True))

    async def _list_until_answered(
        self, kind: ResourceKind, scope: str | None
    ) -> list[dict[str, Any]]:
        waits = backoff(self._settings)
        while True:
            try:
                objects, _ = await self._client.list(kind, scope, "", self._settings.page_size)
                return [with_kind(kind, obj) for obj in objects]
            except (ApiError, aiohttp.ClientError, TimeoutError, OSError, ValueError) as error:
                log.warning("listing %s in %s failed: %s", kind.plural, scope or "*", error)
                await asyncio.sleep(next(waits))
