"""An in-memory stand-in for the operator's KubeClient, counting reads and writes, and mirroring
every object it holds into the operator's watch cache at once, as a watch without lag would."""

from __future__ import annotations

import copy
import itertools
from collections import Counter
from collections.abc import Mapping
from typing import Any

from warmgate_contract.names import MANAGED_BY, MANAGED_BY_LABEL
from warmgate_kube.client import ApiError
from warmgate_kube.kinds import EMBEDDING_ALIAS, EMBEDDING_SERVICE, ResourceKind
from warmgate_operator.runtime import CHILD_KINDS
from warmgate_operator.watch import Cache

WRITE_METHODS = ("POST", "PUT", "PATCH", "DELETE")


class FakeClient:
    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.requests: Counter[str] = Counter()
        self.log: list[tuple[str, str, str]] = []
        self.events: list[dict[str, Any]] = []
        self._rv = itertools.count(100)
        self._uid = itertools.count(1)
        self.fail_apply_for: set[str] = set()
        self.cache = Cache(EMBEDDING_SERVICE, CHILD_KINDS, "warmgate.dev/service", EMBEDDING_ALIAS)
        """What the operator's watches would hold: the EmbeddingServices and aliases, and the
        children labelled as warmgate's."""

    def _mirror(self, event_type: str, kind: ResourceKind, obj: Mapping[str, Any]) -> None:
        if kind == EMBEDDING_SERVICE:
            store = self.cache.services
        elif kind == EMBEDDING_ALIAS:
            store = self.cache.aliases
        elif (
            kind in self.cache.children
            and (obj["metadata"].get("labels") or {}).get(MANAGED_BY_LABEL) == MANAGED_BY
        ):
            store = self.cache.children[kind]
        else:
            return
        store.apply(event_type, copy.deepcopy(dict(obj)))

    async def aclose(self) -> None:
        return None

    @property
    def writes(self) -> int:
        return sum(n for m, n in self.requests.items() if m in WRITE_METHODS)

    def _count(self, method: str, kind: str, name: str) -> None:
        self.requests[method] += 1
        self.log.append((method, kind, name))

    def put(self, kind: ResourceKind, obj: Mapping[str, Any]) -> dict[str, Any]:
        obj = copy.deepcopy(dict(obj))
        meta = obj.setdefault("metadata", {})
        meta.setdefault("uid", f"uid-{next(self._uid)}")
        meta["resourceVersion"] = str(next(self._rv))
        self.objects[(kind.kind, meta["namespace"], meta["name"])] = obj
        self._mirror("MODIFIED", kind, obj)
        return copy.deepcopy(obj)

    def find(self, kind: ResourceKind, namespace: str, name: str) -> dict[str, Any] | None:
        return self.objects.get((kind.kind, namespace, name))

    async def get(self, kind: ResourceKind, namespace: str, name: str) -> dict[str, Any] | None:
        self._count("GET", kind.kind, name)
        obj = self.objects.get((kind.kind, namespace, name))
        return copy.deepcopy(obj) if obj is not None else None

    async def list(self, kind: ResourceKind, namespace: str, label_selector: str) -> list[dict]:
        self._count("LIST", kind.kind, label_selector)
        wanted = dict(part.split("=", 1) for part in label_selector.split(","))
        return [
            copy.deepcopy(o)
            for (k, ns, _), o in self.objects.items()
            if k == kind.kind
            and ns == namespace
            and all(o["metadata"].get("labels", {}).get(a) == b for a, b in wanted.items())
        ]

    async def apply(
        self, kind: ResourceKind, obj: Mapping[str, Any], field_manager: str
    ) -> dict[str, Any]:
        self._count("PATCH", kind.kind, obj["metadata"]["name"])
        if kind.kind in self.fail_apply_for:
            raise ApiError(500, "InternalError", "injected failure")
        meta = obj["metadata"]
        current = self.objects.get((kind.kind, meta["namespace"], meta["name"]))
        new = copy.deepcopy(dict(obj))
        if current is not None:
            merged = copy.deepcopy(current)
            _merge(merged, new)
            # SSA drops a field its manager stops applying unless another manager holds it.
            if (
                field_manager == "warmgate"
                and "replicas" not in new.get("spec", {})
                and not _held_by_other(current, "warmgate")
            ):
                merged.get("spec", {}).pop("replicas", None)
            new = merged
        fields = {"f:spec": {"f:replicas": {}}} if "replicas" in obj.get("spec", {}) else {}
        managed = [
            m for m in (new["metadata"].get("managedFields") or []) if m["manager"] != field_manager
        ]
        managed.append({"manager": field_manager, "operation": "Apply", "fieldsV1": fields})
        new["metadata"]["managedFields"] = managed
        if current is not None:
            new["metadata"]["uid"] = current["metadata"]["uid"]
        return self.put(kind, new)

    async def delete(
        self, kind: ResourceKind, namespace: str, name: str, uid: str | None = None
    ) -> None:
        self._count("DELETE", kind.kind, name)
        gone = self.objects.pop((kind.kind, namespace, name), None)
        if gone is not None:
            self._mirror("DELETED", kind, gone)

    async def json_patch(
        self,
        kind: ResourceKind,
        namespace: str,
        name: str,
        operations: list[dict[str, Any]],
        subresource: str | None = None,
    ) -> dict[str, Any]:
        self._count("PATCH", kind.kind + (f"/{subresource}" if subresource else ""), name)
        obj = copy.deepcopy(self.objects[(kind.kind, namespace, name)])
        for op in operations:
            if op["op"] == "test":  # like the API server: a failed test is 422, nothing written
                field = op["path"].removeprefix("/metadata/")
                if obj["metadata"].get(field) != op["value"]:
                    raise ApiError(422, "Invalid", f"test of {op['path']} failed")
            elif op["op"] == "add" and op["path"] == "/status":
                obj["status"] = copy.deepcopy(op["value"])
            elif op["op"] == "replace" and op["path"] == "/spec/replicas":  # the scale
                obj["spec"]["replicas"] = op["value"]
        return self.put(kind, obj)

    async def merge_patch(
        self,
        kind: ResourceKind,
        namespace: str,
        name: str,
        patch: Mapping[str, Any],
        subresource: str | None = None,
    ) -> dict[str, Any]:
        self._count("PATCH", kind.kind + (f"/{subresource}" if subresource else ""), name)
        current = self.objects.get((kind.kind, namespace, name))
        if current is None:
            raise ApiError(404, "NotFound", f"{kind.plural} {name!r} not found")
        obj = copy.deepcopy(current)
        _merge_patch(obj, patch)
        return self.put(kind, obj)

    async def create(self, kind: ResourceKind, namespace: str, body: Mapping[str, Any]) -> dict:
        self._count("POST", kind.kind, body["metadata"].get("generateName", ""))
        self.events.append(copy.deepcopy(dict(body)))
        return dict(body)


def _merge(into: dict[str, Any], new: Mapping[str, Any]) -> None:
    for key, value in new.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)


def _merge_patch(into: dict[str, Any], patch: Mapping[str, Any]) -> None:
    """RFC 7386: None removes a key, an object merges, anything else replaces."""
    for key, value in patch.items():
        if value is None:
            into.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _merge_patch(into[key], value)
        else:
            into[key] = copy.deepcopy(value)


def _held_by_other(obj: Mapping[str, Any], manager: str) -> bool:
    return any(
        m["manager"] != manager and "f:replicas" in m.get("fieldsV1", {}).get("f:spec", {})
        for m in obj["metadata"].get("managedFields") or []
    )
