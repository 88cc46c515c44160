"""The whole operator runtime (runtime.py: watches, cache, controller, gate, observer) over an
in-memory API whose watches the test breaks at will: an EmbeddingService deleted while its
watch was away is never reconciled again and none of its children is made again, and a pod
deleted meanwhile has its gate worker stopped. (The API is in memory so the gap is exact; the
same property is checked on the real apiserver in test_cluster_relist.py.)"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator
from typing import Any

from support.fakes import FakeClient

from warmgate_contract import names
from warmgate_kube.kinds import DEPLOYMENT, EMBEDDING_ALIAS, EMBEDDING_SERVICE, POD, ResourceKind
from warmgate_kube.watch import WatchSettings
from warmgate_operator.config import OperatorConfig
from warmgate_operator.metrics import Metrics
from warmgate_operator.runtime import MANAGED_SELECTOR, Operator

from .test_reconcile import new_es

FAST = WatchSettings(backoff_initial_seconds=0.01, backoff_max_seconds=0.05)


class WatchableClient(FakeClient):
    """The in-memory API, listable and watchable: every watch stays quiet until `expire`
    ends it with a 410, as the apiserver does once the version it watches from is compacted."""

    def __init__(self) -> None:
        super().__init__()
        self.expiring: dict[str, asyncio.Event] = {}
        self.selectors: dict[str, str] = {}

    async def list(
        self, kind: ResourceKind, namespace: str | None, selector: str = "", page_size: int = 500
    ) -> tuple[list[dict[str, Any]], str]:
        self._count("LIST", kind.kind, selector)
        self.selectors[kind.plural] = selector
        wanted = dict(part.split("=", 1) for part in selector.split(",") if part)
        items = [
            copy.deepcopy(obj)
            for (k, ns, _), obj in self.objects.items()
            if k == kind.kind
            and namespace in (None, ns)
            and all((obj["metadata"].get("labels") or {}).get(a) == b for a, b in wanted.items())
        ]
        return items, str(next(self._rv))

    async def watch(
        self,
        kind: ResourceKind,
        namespace: str | None,
        version: str,
        selector: str,
        timeout_seconds: int,
    ) -> AsyncIterator[dict[str, Any]]:
        self._count("WATCH", kind.kind, selector)
        expiring = self.expiring.setdefault(kind.plural, asyncio.Event())
        await expiring.wait()
        expiring.clear()
        yield {"type": "ERROR", "object": {"kind": "Status", "code": 410}}

    def expire(self, kind: ResourceKind) -> None:
        self.expiring.setdefault(kind.plural, asyncio.Event()).set()


async def until(condition, seconds: float = 5.0) -> None:
    for _ in range(int(seconds / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not within the time")


def gated_pod(service: str) -> dict[str, Any]:
    """A pod of `service` that has not started yet: its gate worker waits for it."""
    return {
        "metadata": {
            "name": f"{service}-abc",
            "namespace": "default",
            "labels": {names.MANAGED_BY_LABEL: names.MANAGED_BY, names.SERVICE_LABEL: service},
        },
        "spec": {
            "readinessGates": [{"conditionType": names.WARMED_CONDITION}],
            "containers": [{"name": "server", "args": ["--model", "m"]}],
        },
        "status": {},
    }


async def test_a_service_and_a_pod_deleted_while_the_watches_were_away_stay_gone() -> None:
    client = WatchableClient()
    kept = new_es(client)
    gone = copy.deepcopy(kept)
    gone["metadata"].update(name="gone", uid="uid-gone")
    client.put(EMBEDDING_SERVICE, gone)
    client.put(POD, gated_pod("gone"))
    metrics = Metrics()
    config = OperatorConfig(namespaces=("default",), resync_seconds=1)
    operator = Operator.build(config, client, metrics, FAST)  # type: ignore[arg-type]
    await operator.start()
    try:
        await until(lambda: client.find(DEPLOYMENT, "default", "gone") is not None)
        await until(lambda: operator.gatekeeper.active == 1)
        # The children's watches ask the apiserver for warmgate's objects only.
        assert (
            client.selectors["pods"] == MANAGED_SELECTOR == "app.kubernetes.io/managed-by=warmgate"
        )
        assert client.selectors["deployments"] == MANAGED_SELECTOR
        assert client.selectors["embeddingservices"] == ""

        # While the watches are away, "gone" is deleted and garbage collection takes its
        # children and its pod: no watch event tells of it.
        for key in [key for key in client.objects if key[2].startswith("gone")]:
            del client.objects[key]
        for kind in (EMBEDDING_SERVICE, POD, DEPLOYMENT):
            client.expire(kind)
        await until(
            lambda: metrics.value("warmgate_operator_watch_relists_total", {"resource": "pods"})
        )
        await until(lambda: operator.gatekeeper.active == 0)
        await until(lambda: operator.cache.services.get("default", "gone") is None)
        client.log.clear()
        reconciles = operator.controller.reconciles
        await until(lambda: operator.controller.reconciles >= reconciles + 2, seconds=5)  # resyncs
    finally:
        await operator.stop()
    # "minilm" kept being reconciled; nothing was written for "gone" again.
    assert not [entry for entry in client.log if entry[2].startswith("gone")], client.log
    assert client.find(DEPLOYMENT, "default", "gone") is None
    assert operator.controller.keys == [("default", "minilm")]
    assert (
        metrics.value("warmgate_operator_watch_relists_total", {"resource": "embeddingservices"})
        == 1
    )


def condition_reason(client: WatchableClient, name: str) -> str | None:
    alias = client.find(EMBEDDING_ALIAS, "default", name) or {}
    conditions = (alias.get("status") or {}).get("conditions") or [{}]
    return conditions[0].get("reason")


async def test_an_alias_gets_its_status_and_follows_its_service() -> None:
    client = WatchableClient()
    new_es(client)
    client.put(
        EMBEDDING_ALIAS,
        {
            "metadata": {"name": "search", "namespace": "default", "generation": 1},
            "spec": {"service": "minilm"},
        },
    )
    config = OperatorConfig(namespaces=("default",), resync_seconds=60)
    operator = Operator.build(config, client, Metrics(), FAST)  # type: ignore[arg-type]
    await operator.start()
    try:
        await until(lambda: condition_reason(client, "search") == names.REASON_RESOLVED)
        assert client.selectors["embeddingaliases"] == ""  # every alias: each is a name
        # The EmbeddingService goes while its watch is away: the relist tells the aliases too.
        del client.objects[("EmbeddingService", "default", "minilm")]
        client.expire(EMBEDDING_SERVICE)
        await until(lambda: condition_reason(client, "search") == names.REASON_TARGET_MISSING)
    finally:
        await operator.stop()
    assert "service" not in client.find(EMBEDDING_ALIAS, "default", "search")["status"]


def conflict_of(client: WatchableClient, name: str) -> tuple[str, str] | None:
    status = (client.find(EMBEDDING_SERVICE, "default", name) or {}).get("status") or {}
    found = {c["type"]: c for c in status.get("conditions") or []}.get("Conflict")
    return None if found is None else (found["status"], found["reason"])


async def test_an_alias_that_takes_a_services_name_reconciles_that_service() -> None:
    """An EmbeddingAlias named like an EmbeddingService, and older, appears: that service is
    reconciled again at once (no resync waited for) and its Conflict condition names the
    alias."""
    client = WatchableClient()
    body = new_es(client)
    body["metadata"]["creationTimestamp"] = "2026-11-02T00:00:00Z"
    client.put(EMBEDDING_SERVICE, body)
    config = OperatorConfig(namespaces=("default",), resync_seconds=600)
    operator = Operator.build(config, client, Metrics(), FAST)  # type: ignore[arg-type]
    await operator.start()
    try:
        await until(lambda: conflict_of(client, "minilm") == ("False", "NoConflict"))
        client.put(
            EMBEDDING_ALIAS,
            {
                "metadata": {"name": "minilm", "namespace": "default", "generation": 1,
                             "creationTimestamp": "2026-11-01T00:00:00Z"},
                "spec": {"service": "other"},
            },
        )  # fmt: skip
        client.expire(EMBEDDING_ALIAS)
        await until(lambda: conflict_of(client, "minilm") == ("True", names.REASON_NAME_CONFLICT))
    finally:
        await operator.stop()


# -- the custom resources carried by kopf (handlers.py, feed.py) ------------------------------
# kopf itself is not run here: these tests call `Operator.observe` exactly as its on.event
# handler does (test_handlers.py pins what kopf delivers; the cluster tests run both).

CARRIED = (EMBEDDING_SERVICE, EMBEDDING_ALIAS)


def kopf_listing(operator: Operator, client: WatchableClient, kind: ResourceKind) -> None:
    """What kopf hands the handler for one listing: type None for each object that exists."""
    for (k, _, _), obj in list(client.objects.items()):
        if k == kind.kind:
            operator.observe(kind, None, copy.deepcopy(obj))


def writes_for(client: WatchableClient, name: str) -> list[tuple[str, str, str]]:
    return [e for e in client.log if e[0] not in ("GET", "LIST", "WATCH") and e[2] == name]


async def test_kopf_carries_the_services_and_a_service_gone_during_a_gap_stays_gone() -> None:
    """kopf's relist after a gap yields only what exists; the audit it triggers finds "gone"
    missing: its observer stops, it is never reconciled again, and none of its children is
    made again, while kopf's own watches were never asked to list anything."""
    client = WatchableClient()
    kept = new_es(client)
    gone = copy.deepcopy(kept)
    gone["metadata"].update(name="gone", uid="uid-gone")
    client.put(EMBEDDING_SERVICE, gone)
    metrics = Metrics()
    config = OperatorConfig(namespaces=("default",), resync_seconds=1)
    operator = Operator.build(config, client, metrics, FAST, carried=CARRIED)  # type: ignore[arg-type]
    await operator.start()
    try:
        # The seed: both held (and reconciled) before kopf's first event.
        assert operator.listed()
        assert sorted(operator.cache.services.keys()) == [
            ("default", "gone"),
            ("default", "minilm"),
        ]
        assert "embeddingservices" not in client.expiring  # no own watch of a carried kind
        await until(lambda: client.find(DEPLOYMENT, "default", "gone") is not None)
        kopf_listing(operator, client, EMBEDDING_SERVICE)  # kopf's first listing: one audit
        await until(lambda: operator.feed.audits == 2)  # one LIST per carried kind
        assert operator.cache.services.get("default", "gone") is not None

        for key in [key for key in client.objects if key[2].startswith("gone")]:
            del client.objects[key]
        kopf_listing(operator, client, EMBEDDING_SERVICE)  # the relist after a 410
        await until(lambda: operator.cache.services.get("default", "gone") is None)
        client.log.clear()
        reconciles = operator.controller.reconciles
        await until(lambda: operator.controller.reconciles >= reconciles + 2, seconds=5)
    finally:
        await operator.stop()
    assert not writes_for(client, "gone"), client.log
    assert client.find(DEPLOYMENT, "default", "gone") is None
    assert operator.controller.keys == [("default", "minilm")]
    assert operator.feed.audits == 4
    assert (
        metrics.value("warmgate_operator_watch_relists_total", {"resource": "embeddingservices"})
        == 2
    )


async def test_the_only_service_of_a_namespace_gone_during_a_gap_is_found_by_a_child_relist() -> (
    None
):
    """kopf's relist of an empty namespace delivers nothing at all; the pods' own watch, which
    the same gap expired, triggers the audit that finds the service gone."""
    client = WatchableClient()
    new_es(client)
    client.put(POD, gated_pod("minilm"))
    metrics = Metrics()
    config = OperatorConfig(namespaces=("default",), resync_seconds=1)
    operator = Operator.build(config, client, metrics, FAST, carried=CARRIED)  # type: ignore[arg-type]
    await operator.start()
    try:
        await until(lambda: client.find(DEPLOYMENT, "default", "minilm") is not None)
        await until(lambda: operator.gatekeeper.active == 1)
        client.objects.clear()  # deleted, and its children collected, while nobody watched
        client.expire(POD)  # kopf says nothing: its listing is empty
        await until(lambda: operator.cache.services.get("default", "minilm") is None)
        await until(lambda: operator.gatekeeper.active == 0)
        client.log.clear()
        reconciles = operator.controller.reconciles
        await asyncio.sleep(1.5)  # a resync's length: it would reconcile "minilm" if still held
    finally:
        await operator.stop()
    assert operator.controller.reconciles == reconciles
    assert not writes_for(client, "minilm"), client.log
    assert operator.controller.keys == []


async def test_a_ghost_service_is_evicted_by_the_owner_read_before_any_create() -> None:
    """The one case no listing reveals: a service held, gone from the apiserver, its children
    missing. The reconcile reads the owner before creating anything, finds it gone, forgets it
    and writes nothing."""
    client = WatchableClient()
    new_es(client)
    config = OperatorConfig(namespaces=("default",), resync_seconds=600)
    operator = Operator.build(config, client, Metrics(), FAST, carried=CARRIED)  # type: ignore[arg-type]
    await operator.start()
    try:
        await until(lambda: client.find(DEPLOYMENT, "default", "minilm") is not None)
        client.objects.clear()
        for store in operator.cache.children.values():  # their DELETED events came
            for obj in store:
                store.apply("DELETED", obj)
        client.log.clear()
        operator.controller.enqueue(("default", "minilm"))
        await until(lambda: operator.cache.services.get("default", "minilm") is None)
        await until(lambda: operator.controller.keys == [])
    finally:
        await operator.stop()
    assert client.log == [("GET", "EmbeddingService", "minilm")]


async def test_a_late_deleted_of_an_old_object_leaves_the_new_one_of_its_name() -> None:
    """kopf runs each object's events on a worker of its own, in no order across objects: the
    DELETED of an old "minilm" may come after the ADDED of the new one."""
    client = WatchableClient()
    old = new_es(client)
    config = OperatorConfig(namespaces=("default",), resync_seconds=600)
    operator = Operator.build(config, client, Metrics(), FAST, carried=CARRIED)  # type: ignore[arg-type]
    await operator.start()
    try:
        new = copy.deepcopy(old)
        new["metadata"].update(uid="uid-new", resourceVersion="999")
        operator.observe(EMBEDDING_SERVICE, "ADDED", new)
        operator.observe(EMBEDDING_SERVICE, "DELETED", old)
        assert operator.cache.services.get("default", "minilm")["metadata"]["uid"] == "uid-new"
        assert operator.controller.keys == [("default", "minilm")]
    finally:
        await operator.stop()


def test_kopf_gets_the_operator_itself_for_every_object() -> None:
    """kopf hands each object's handlers copy.copy(memo) and keeps it until a DELETED: the same
    Operator, and nothing that leaks for an object deleted during a gap."""
    operator = Operator.build(OperatorConfig(), WatchableClient(), Metrics(), carried=CARRIED)  # type: ignore[arg-type]
    assert copy.copy(operator) is operator


async def test_an_alias_kind_kopf_does_not_carry_is_watched_by_the_operator_itself() -> None:
    """The alias CRD was not served when the process started (kopf would never watch it): kopf
    carries the services only, and the operator's own Reflector lists the aliases."""
    client = WatchableClient()
    new_es(client)
    client.put(
        EMBEDDING_ALIAS,
        {"metadata": {"name": "search", "namespace": "default", "generation": 1},
         "spec": {"service": "minilm"}},
    )  # fmt: skip
    config = OperatorConfig(namespaces=("default",), resync_seconds=60)
    operator = Operator.build(config, client, Metrics(), FAST, carried=(EMBEDDING_SERVICE,))  # type: ignore[arg-type]
    await operator.start()
    try:
        assert operator.feed.kinds == (EMBEDDING_SERVICE,)
        assert "embeddingaliases" in client.selectors  # listed by its own Reflector
        assert "embeddingservices" not in client.expiring  # watched by kopf, not here
        await until(lambda: condition_reason(client, "search") == names.REASON_RESOLVED)
    finally:
        await operator.stop()
