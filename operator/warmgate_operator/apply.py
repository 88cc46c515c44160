"""The one apply layer: server-side apply with the field manager `warmgate`, skipping writes
that would change nothing.

A child is up to date when it carries the hash of the desired object and every desired field
is still there with the same value (fields the apiserver or other controllers add are ignored).
Either check failing leads to one apply. The live object comes from the watch cache, so an
unchanged spec costs no request at all.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Protocol

from kubernetes.utils import parse_quantity as kubernetes_quantity

from warmgate_contract.names import APPLIED_HASH_ANNOTATION
from warmgate_kube.kinds import ResourceKind

from .builders import content_hash
from .config import FIELD_MANAGER

log = logging.getLogger("warmgate.apply")


class Client(Protocol):
    async def get(self, kind: ResourceKind, namespace: str, name: str) -> dict | None: ...
    async def apply(self, kind: ResourceKind, obj: Mapping, field_manager: str) -> dict: ...
    async def delete(
        self, kind: ResourceKind, namespace: str, name: str, uid: str | None = None
    ) -> None: ...


class ChildConflict(Exception):
    """A child's name is taken by an object that another controller owns."""


@dataclass(frozen=True)
class ApplyOutcome:
    kind: str
    name: str
    action: str  # created | updated | unchanged | deleted | absent
    obj: dict[str, Any] | None = None

    @property
    def wrote(self) -> bool:
        return self.action in ("created", "updated", "deleted")


def with_hash(desired: Mapping[str, Any]) -> dict[str, Any]:
    """`desired` plus the annotation recording its hash."""
    obj = dict(desired)
    meta = dict(obj["metadata"])
    annotations = dict(meta.get("annotations") or {})
    annotations[APPLIED_HASH_ANNOTATION] = content_hash(desired)
    meta["annotations"] = annotations
    obj["metadata"] = meta
    return obj


def parse_quantity(value: Any) -> Decimal | None:
    """A Kubernetes quantity's value (the client library's parser), or None when `value` is
    not one."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        return None
    try:
        return kubernetes_quantity(value)
    except (ValueError, ArithmeticError):
        return None


def _scalar_equal(desired: Any, current: Any) -> bool:
    if desired == current and type(desired) is type(current):
        return True
    # The apiserver canonicalises quantities ("1000m" comes back as "1").
    if isinstance(desired, str) or isinstance(current, str):
        left, right = parse_quantity(desired), parse_quantity(current)
        return left is not None and left == right
    return False


def is_subset(desired: Any, current: Any) -> bool:
    """Whether every field of `desired` is present in `current` with the same value.

    Lists of named items (containers, env, volumes) match by name, so items that admission
    adds do not count as drift; other lists must match item by item.
    """
    if isinstance(desired, Mapping):
        return isinstance(current, Mapping) and all(
            key in current and is_subset(value, current[key]) for key, value in desired.items()
        )
    if isinstance(desired, list):
        if not isinstance(current, list):
            return False
        if desired and all(isinstance(d, Mapping) and "name" in d for d in desired):
            by_name = {c.get("name"): c for c in current if isinstance(c, Mapping)}
            return all(d["name"] in by_name and is_subset(d, by_name[d["name"]]) for d in desired)
        return len(desired) == len(current) and all(
            is_subset(d, c) for d, c in zip(desired, current, strict=True)
        )
    return _scalar_equal(desired, current)


def difference(desired: Any, current: Any, path: str = "") -> str | None:
    """The first field where `current` does not hold `desired` (is_subset's answer, located):
    e.g. `spec.ports[http].port: 80 != 8080`; None when it does."""
    if isinstance(desired, Mapping):
        if not isinstance(current, Mapping):
            return f"{path or '.'}: not an object"
        for key, value in desired.items():
            where = f"{path}.{key}" if path else str(key)
            if key not in current:
                return f"{where}: missing"
            found = difference(value, current[key], where)
            if found:
                return found
        return None
    if isinstance(desired, list):
        if not isinstance(current, list):
            return f"{path}: not a list"
        if desired and all(isinstance(d, Mapping) and "name" in d for d in desired):
            by_name = {c.get("name"): c for c in current if isinstance(c, Mapping)}
            for item in desired:
                where = f"{path}[{item['name']}]"
                if item["name"] not in by_name:
                    return f"{where}: missing"
                found = difference(item, by_name[item["name"]], where)
                if found:
                    return found
            return None
        if len(desired) != len(current):
            return f"{path}: {len(desired)} items != {len(current)}"
        for index, (d, c) in enumerate(zip(desired, current, strict=True)):
            found = difference(d, c, f"{path}[{index}]")
            if found:
                return found
        return None
    if _scalar_equal(desired, current):
        return None
    return f"{path}: {current!r} should be {desired!r}"


def controller_uid(obj: Mapping[str, Any]) -> str | None:
    for ref in obj.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return ref.get("uid")
    return None


def _owner_uid(desired: Mapping[str, Any]) -> str:
    uid = controller_uid(desired)
    if uid is None:
        raise ValueError("desired children must carry a controller owner reference")
    return uid


async def ensure(
    client: Client,
    kind: ResourceKind,
    desired: Mapping[str, Any],
    current: Mapping[str, Any] | None,
) -> ApplyOutcome:
    """Make the child match `desired`, writing only when something differs. `current` is the
    live object as the watch cache holds it, None when it holds none."""
    meta = desired["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    owner_uid = _owner_uid(desired)
    if current is None:
        # The cache holds only objects labelled as warmgate's: an object of this name without
        # that label (a person's, another tool's) would be taken over by the apply. One read,
        # when a child is to be created.
        current = await client.get(kind, namespace, name)
    if current is not None:
        holder = controller_uid(current)
        if holder != owner_uid:
            # Never taken over: not another owner's, and not one a person made by hand.
            whose = (
                f"is controlled by another owner (uid {holder})"
                if holder is not None
                else "is not warmgate's (it has no controller owner)"
            )
            raise ChildConflict(
                f"{kind.kind} {namespace}/{name} already exists and {whose}; warmgate does not "
                "take it over: rename the EmbeddingService, or delete that object"
            )
    target = with_hash(desired)
    if current is not None and is_subset(target, current):
        return ApplyOutcome(kind.kind, name, "unchanged", current)
    # Every child write says why: absent, or the first field that differs (drift, or a spec
    # change through the hash annotation).
    if current is None:
        log.info("creating %s %s/%s: absent", kind.kind, namespace, name)
    else:
        log.info("updating %s %s/%s: %s", kind.kind, namespace, name, difference(target, current))
    applied = await client.apply(kind, target, FIELD_MANAGER)
    return ApplyOutcome(kind.kind, name, "created" if current is None else "updated", applied)


async def ensure_absent(
    client: Client,
    kind: ResourceKind,
    namespace: str,
    name: str,
    owner_uid: str,
    current: Mapping[str, Any] | None,
) -> ApplyOutcome:
    """Delete the child if it exists (`current`, from the watch cache) and this
    EmbeddingService controls it."""
    if current is None or controller_uid(current) != owner_uid:
        return ApplyOutcome(kind.kind, name, "absent")
    log.info("deleting %s %s/%s: no longer wanted", kind.kind, namespace, name)
    await client.delete(kind, namespace, name, uid=current["metadata"].get("uid"))
    return ApplyOutcome(kind.kind, name, "deleted", dict(current))
