"""EmbeddingAlias status (aliases.py): computed from the names in a namespace, written only
when different, a Warning Event once per name conflict."""

from __future__ import annotations

import copy
from typing import Any

from support.fakes import FakeClient

from warmgate_kube.kinds import EMBEDDING_ALIAS, EMBEDDING_SERVICE
from warmgate_operator.aliases import AliasKeeper, namespace_statuses, status_patch
from warmgate_operator.events import EventRecorder
from warmgate_operator.metrics import Metrics

OLD, NEW = "2026-01-01T00:00:00Z", "2026-01-02T00:00:00Z"
T0, T1 = "2026-11-29T22:00:00Z", "2026-11-29T22:05:00Z"


def service(name: str, created: str = OLD, revision: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "warmgate.dev/v1alpha1",
        "kind": "EmbeddingService",
        "metadata": {"name": name, "namespace": "ns", "creationTimestamp": created},
        "spec": {"model": {"id": "m"}},
    }
    if revision:
        body["status"] = {"model": {"id": "m", "revision": revision}}
    return body


def alias(name: str, target: str, created: str = NEW, generation: int = 1) -> dict[str, Any]:
    return {
        "apiVersion": "warmgate.dev/v1alpha1",
        "kind": "EmbeddingAlias",
        "metadata": {
            "name": name,
            "namespace": "ns",
            "creationTimestamp": created,
            "generation": generation,
        },
        "spec": {"service": target},
    }


def ready(status: dict[str, Any]) -> dict[str, Any]:
    (condition,) = status["conditions"]
    assert condition["type"] == "Ready"
    return condition


def test_a_resolved_alias_names_its_service_and_the_revision_it_serves() -> None:
    verdict = namespace_statuses(
        "ns", [service("bge-v1", revision="abc123")], [alias("search", "bge-v1")], T0
    )
    ((_, status),) = verdict.aliases
    assert status["service"] == "bge-v1" and status["revision"] == "abc123"
    assert status["observedGeneration"] == 1
    condition = ready(status)
    assert (condition["status"], condition["reason"]) == ("True", "Resolved")
    assert condition["message"] == "ns/search is served by EmbeddingService ns/bge-v1"
    assert condition["lastTransitionTime"] == T0
    assert verdict.refused_services == []


def test_a_refused_alias_says_why_and_names_no_service() -> None:
    verdict = namespace_statuses(
        "ns",
        [service("search", created=OLD), service("bge")],
        [alias("search", "bge", created=NEW), alias("other", "gone")],
        T0,
    )
    statuses = {a["metadata"]["name"]: s for a, s in verdict.aliases}
    conflict = ready(statuses["search"])
    assert (conflict["status"], conflict["reason"]) == ("False", "NameConflict")
    assert "EmbeddingService ns/search" in conflict["message"]
    assert "EmbeddingAlias ns/search" in conflict["message"]
    assert "service" not in statuses["search"] and "revision" not in statuses["search"]
    assert ready(statuses["other"])["reason"] == "TargetMissing"


def test_the_same_names_give_an_equal_status_and_a_transition_moves_only_its_time() -> None:
    first = namespace_statuses("ns", [service("bge")], [alias("search", "bge")], T0)
    ((held, status),) = first.aliases
    held = {**held, "status": status}
    again = namespace_statuses("ns", [service("bge")], [held], T1)
    assert again.aliases[0][1] == status
    moved = namespace_statuses("ns", [service("bge"), service("e5")], [held], T1)
    assert moved.aliases[0][1] == status  # still True: nothing moved
    gone = namespace_statuses("ns", [], [held], T1)
    assert ready(gone.aliases[0][1])["lastTransitionTime"] == T1


def test_other_namespaces_are_not_looked_at() -> None:
    elsewhere = service("bge")
    elsewhere["metadata"]["namespace"] = "other"
    verdict = namespace_statuses("ns", [elsewhere], [alias("search", "bge")], T0)
    assert ready(verdict.aliases[0][1])["reason"] == "TargetMissing"


def test_the_patch_removes_what_the_new_status_lacks() -> None:
    current = {"service": "bge", "revision": "abc", "conditions": []}
    desired = {"conditions": [{"type": "Ready"}]}
    assert status_patch(current, desired) == {
        "status": {"conditions": [{"type": "Ready"}], "service": None, "revision": None}
    }


async def keeper_of(client: FakeClient, metrics: Metrics, now: list[str]) -> AliasKeeper:
    """A keeper whose recorder repeats every event it is given: once per transition is the
    keeper's doing."""
    return AliasKeeper(
        client,  # type: ignore[arg-type]
        client.cache,
        EventRecorder(client, repeat_after=0),
        metrics,
        clock=lambda: now[0],
    )


async def test_the_keeper_writes_what_differs_once_and_warns_once_per_conflict() -> None:
    client, metrics, now = FakeClient(), Metrics(), [T0]
    client.put(EMBEDDING_SERVICE, service("bge", revision="r1"))
    client.put(EMBEDDING_ALIAS, alias("search", "bge"))
    keeper = await keeper_of(client, metrics, now)

    assert await keeper.sync("ns") is False
    status = client.find(EMBEDDING_ALIAS, "ns", "search")["status"]
    assert (status["service"], status["revision"]) == ("bge", "r1")
    assert client.cache.aliases.get("ns", "search")["status"] == status  # the answer is kept
    # The status, and a Normal event: what the name serves now.
    assert [(m, k) for m, k, _ in client.log] == [
        ("PATCH", "EmbeddingAlias/status"),
        ("POST", "Event"),
    ]
    assert (client.events[0]["type"], client.events[0]["reason"]) == ("Normal", "Resolved")

    client.log.clear()
    now[0] = T1
    await keeper.sync("ns")  # nothing changed: no write
    assert client.log == []

    # An older EmbeddingService of the alias's name appears (made by hand, say).
    client.put(EMBEDDING_SERVICE, service("search", created=OLD))
    await keeper.sync("ns")
    await keeper.sync("ns")
    status = client.find(EMBEDDING_ALIAS, "ns", "search")["status"]
    assert ready(status)["reason"] == "NameConflict" and "service" not in status
    warnings = [e for e in client.events if e["type"] == "Warning"]
    assert [(e["reason"], e["involvedObject"]["kind"]) for e in warnings] == [
        ("NameConflict", "EmbeddingAlias")
    ]
    assert "EmbeddingService ns/search" in warnings[0]["message"]

    # The conflict goes, then comes back: one more warning.
    await client.delete(EMBEDDING_SERVICE, "ns", "search")
    await keeper.sync("ns")
    assert ready(client.find(EMBEDDING_ALIAS, "ns", "search")["status"])["reason"] == "Resolved"
    client.put(EMBEDDING_SERVICE, service("search", created=OLD))
    await keeper.sync("ns")
    assert len([e for e in client.events if e["reason"] == "NameConflict"]) == 2
    assert metrics.value("warmgate_operator_alias_status_writes_total", {"reason": "Resolved"}) == 2


async def test_a_service_whose_name_an_older_alias_holds_is_warned_once() -> None:
    client, now = FakeClient(), [T0]
    client.put(EMBEDDING_SERVICE, service("bge"))
    client.put(EMBEDDING_ALIAS, alias("search", "bge", created=OLD))
    client.put(EMBEDDING_SERVICE, service("search", created=NEW))
    keeper = await keeper_of(client, Metrics(), now)
    for _ in range(3):
        await keeper.sync("ns")
    warned = [e for e in client.events if e["reason"] == "NameConflict"]
    assert [e["involvedObject"]["name"] for e in warned] == ["search"]
    assert warned[0]["involvedObject"]["kind"] == "EmbeddingService"
    assert ready(client.find(EMBEDDING_ALIAS, "ns", "search")["status"])["reason"] == "Resolved"


async def test_switching_an_alias_is_one_status_write_and_a_normal_event() -> None:
    client, now = FakeClient(), [T0]
    for name in ("bge-v1", "bge-v2"):
        client.put(EMBEDDING_SERVICE, service(name))
    client.put(EMBEDDING_ALIAS, alias("search", "bge-v1"))
    keeper = await keeper_of(client, Metrics(), now)
    await keeper.sync("ns")
    switched = copy.deepcopy(client.find(EMBEDDING_ALIAS, "ns", "search"))
    switched["spec"]["service"] = "bge-v2"
    switched["metadata"]["generation"] = 2
    client.put(EMBEDDING_ALIAS, switched)
    client.log.clear()
    await keeper.sync("ns")
    assert [(m, k) for m, k, _ in client.log] == [
        ("PATCH", "EmbeddingAlias/status"),
        ("POST", "Event"),
    ]
    status = client.find(EMBEDDING_ALIAS, "ns", "search")["status"]
    assert (status["service"], status["observedGeneration"]) == ("bge-v2", 2)
    assert client.events[-1]["message"] == "ns/search is served by EmbeddingService ns/bge-v2"


async def test_an_alias_deleted_before_its_write_is_no_failure() -> None:
    client = FakeClient()
    client.put(EMBEDDING_ALIAS, alias("search", "gone"))
    del client.objects[("EmbeddingAlias", "ns", "search")]  # the cache has not heard yet
    keeper = await keeper_of(client, Metrics(), [T0])
    assert await keeper.sync("ns") is False
