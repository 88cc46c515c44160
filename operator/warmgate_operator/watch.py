"""The operator's view of the cluster, in memory: the EmbeddingServices and aliases, and the
children it owns, each kind held in a warmgate_kube Store. kopf's event handlers fill the
custom resources' Stores (feed.py, with the seed and audits kopf cannot do); the children's are
filled by the operator's own Reflectors (a listing, then a watch, and an explicit relist after
a gap).

Why not kopf's watches for the children: kopf hands each object's events to a worker of its own
and never tells its handlers where a listing starts or ends, and its in-memory indexes drop an
object only on a DELETED event. After a watch gap a pod deleted meanwhile gets no such event:
its gate worker would run on, and a Deployment collected meanwhile would stay cached. For two
kinds of a few objects each, one audit LIST after each listing closes that (feed.py); for the
pods of a namespace of 10,000, kopf's per-object workers and the audits would cost what one
Store and an explicit relist do not.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from warmgate_kube.kinds import EMBEDDING_ALIAS, ResourceKind
from warmgate_kube.watch import DELETED, Store


class Cache:
    """What the operator reads: the EmbeddingServices and EmbeddingAliases, and the children
    it owns (labelled managed-by warmgate), found by the EmbeddingService they belong to."""

    def __init__(
        self,
        service_kind: ResourceKind,
        child_kinds: Iterable[ResourceKind],
        label: str,
        alias_kind: ResourceKind = EMBEDDING_ALIAS,
    ):
        self.services = Store(service_kind)
        self.aliases = Store(alias_kind)
        self.children = {kind: Store(kind, index_label=label) for kind in child_kinds}

    def stores(self) -> list[Store]:
        return [self.services, self.aliases, *self.children.values()]

    def child(self, kind: ResourceKind, namespace: str, name: str) -> dict[str, Any] | None:
        return self.children[kind].get(namespace, name)

    def owned(self, kind: ResourceKind, namespace: str, service: str) -> list[dict[str, Any]]:
        """The children of `kind` that the EmbeddingService `service` owns, by their label."""
        return self.children[kind].labelled(namespace, service)

    def record(self, kind: ResourceKind, obj: Mapping[str, Any] | None) -> None:
        """The answer of this operator's write (Store.record)."""
        if kind == self.services.kind:
            self.services.record(obj)
        elif kind == self.aliases.kind:
            self.aliases.record(obj)
        else:
            self.children[kind].record(obj)

    def forget(self, kind: ResourceKind, obj: Mapping[str, Any] | None) -> None:
        """This operator deleted `obj`: its watch event then changes nothing."""
        if obj:
            self.children[kind].apply(DELETED, dict(obj))
