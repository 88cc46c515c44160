"""The watch cache (watch.py) against a scripted watch stream: listings, changes, bookmarks,
renewals, and relists whose `gone` names exactly what was deleted while the watch was away.
(The stream is scripted because each case needs an exact event or failure at an exact moment;
tests/operator/test_cluster_relist.py forces a real relist on the real apiserver.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from warmgate_kube.client import ApiError
from warmgate_kube.kinds import POD, ResourceKind
from warmgate_kube.watch import Change, Listing, Reflector, Store, WatchSettings

FAST = WatchSettings(backoff_initial_seconds=0.001, backoff_max_seconds=0.01)
QUIET = object()
"""In a watch script: the stream stays open with nothing to say."""


def pod(
    name: str, rv: int, uid: str | None = None, service: str = "minilm", namespace: str = "ns"
) -> dict[str, Any]:
    return {
        "metadata": {
            "namespace": namespace,
            "name": name,
            "uid": uid or f"uid-{name}",
            "resourceVersion": str(rv),
            "labels": {"warmgate.dev/service": service},
        }
    }


def event(type_: str, obj: dict[str, Any]) -> dict[str, Any]:
    return {"type": type_, "object": obj}


def expired() -> dict[str, Any]:
    return event("ERROR", {"kind": "Status", "code": 410, "message": "too old resource version"})


class ScriptedApi:
    """The two calls a Reflector makes. Each list answers with the next of `listings`; each
    watch plays the next of `watches`: events, exceptions to raise, QUIET to stay open (until
    the test ends), or, at the end of a script, the stream ending as the server's timeout
    ends it."""

    def __init__(self, listings: list[tuple[list[dict], str]], watches: list[list]) -> None:
        self.listings = listings
        self.watches = watches
        self.lists = 0
        self.watched_from: list[str] = []

    async def list(
        self, kind: ResourceKind, namespace: str | None, selector: str, page_size: int
    ) -> tuple[list[dict], str]:
        answer = self.listings[min(self.lists, len(self.listings) - 1)]
        self.lists += 1
        if isinstance(answer, BaseException):
            raise answer
        objects, version = answer
        return [dict(obj) for obj in objects], version

    async def watch(
        self,
        kind: ResourceKind,
        namespace: str | None,
        version: str,
        selector: str,
        timeout_seconds: int,
    ) -> AsyncIterator[dict]:
        self.watched_from.append(version)
        script = self.watches.pop(0) if self.watches else [QUIET]
        for item in script:
            if item is QUIET:
                await asyncio.Event().wait()
            if isinstance(item, BaseException):
                raise item
            yield item


async def reflect(api: ScriptedApi, until, store: Store | None = None) -> tuple[Store, list]:
    """Run a Reflector of pods on `api` until `until(events)` holds; the store and events."""
    store = store or Store(POD, index_label="warmgate.dev/service")
    events: list = []
    reflector = Reflector(api, store, events.append, "ns", "managed=yes", FAST)  # type: ignore[arg-type]
    task = asyncio.create_task(reflector.run())
    try:
        for _ in range(400):
            if until(events):
                return store, events
            await asyncio.sleep(0.005)
        raise AssertionError(f"not reached; events: {events}")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def names(store: Store) -> list[str]:
    return sorted(obj["metadata"]["name"] for obj in store)


async def test_the_first_listing_fills_the_store_then_changes_follow() -> None:
    api = ScriptedApi(
        [([pod("a", 1), pod("b", 2)], "10")],
        [
            [
                event("ADDED", pod("c", 11)),
                event("MODIFIED", pod("a", 12)),
                event("DELETED", pod("b", 13)),
                QUIET,
            ]
        ],
    )
    store, events = await reflect(api, lambda events: len(events) == 4)
    first = events[0]
    assert isinstance(first, Listing) and not first.relist and first.gone == ()
    assert [obj["metadata"]["name"] for obj in first.objects] == ["a", "b"]
    # A listing's items get their kind, as a watch event's objects have it.
    assert first.objects[0]["kind"] == "Pod" and first.objects[0]["apiVersion"] == "v1"
    assert [(e.type, e.obj["metadata"]["name"]) for e in events[1:]] == [
        ("ADDED", "c"),
        ("MODIFIED", "a"),
        ("DELETED", "b"),
    ]
    assert all(isinstance(e, Change) for e in events[1:])
    assert names(store) == ["a", "c"]
    assert store.get("ns", "a")["metadata"]["resourceVersion"] == "12"
    assert [o["metadata"]["name"] for o in store.labelled("ns", "minilm")] == ["a", "c"]
    assert api.watched_from == ["10"] and api.lists == 1


async def test_a_stream_that_ends_or_breaks_is_renewed_from_its_last_version() -> None:
    api = ScriptedApi(
        [([pod("a", 1)], "10")],
        [
            [
                event("MODIFIED", pod("a", 11)),
                event("BOOKMARK", {"metadata": {"resourceVersion": "15"}}),
            ],
            [aiohttp.ClientConnectionError("connection reset")],
            [TimeoutError()],
            [event("MODIFIED", pod("a", 16)), QUIET],
        ],
    )
    await reflect(api, lambda events: len(events) == 3)
    assert api.watched_from == ["10", "15", "15", "15"]
    assert api.lists == 1  # no relist: nothing was missed


async def test_an_expired_version_relists_and_tells_what_went_meanwhile() -> None:
    """While the watch was away, b was deleted, c was deleted and made again (another uid), d
    is new: the relist's `gone` is b and the old c, and the store holds what the API has."""
    api = ScriptedApi(
        [
            ([pod("a", 1), pod("b", 2), pod("c", 3)], "10"),
            ([pod("a", 1), pod("c", 30, uid="uid-c2"), pod("d", 31)], "40"),
        ],
        [[expired()], [QUIET]],
    )
    store, events = await reflect(api, lambda events: len(events) == 2)
    relist = events[1]
    assert isinstance(relist, Listing) and relist.relist
    assert sorted((o["metadata"]["name"], o["metadata"]["uid"]) for o in relist.gone) == [
        ("b", "uid-b"),
        ("c", "uid-c"),
    ]
    assert names(store) == ["a", "c", "d"]
    assert store.get("ns", "c")["metadata"]["uid"] == "uid-c2"
    assert api.watched_from == ["10", "40"]


async def test_a_watch_request_refused_with_410_relists_too() -> None:
    api = ScriptedApi(
        [([pod("a", 1)], "10"), ([], "20")],
        [[ApiError(410, "Expired", "too old resource version")], [QUIET]],
    )
    store, events = await reflect(api, lambda events: len(events) == 2)
    assert [o["metadata"]["name"] for o in events[1].gone] == ["a"]
    assert len(store) == 0


async def test_a_failed_listing_is_tried_again_and_nothing_is_reported_before_it_works() -> None:
    api = ScriptedApi(
        [ApiError(503, "ServiceUnavailable", "etcd"), ([pod("a", 1)], "10")],  # type: ignore[list-item]
        [[QUIET]],
    )
    _, events = await reflect(api, lambda events: len(events) == 1)
    assert isinstance(events[0], Listing) and not events[0].relist
    assert api.lists == 2


def test_the_echo_of_a_recorded_write_changes_nothing_and_older_copies_lose() -> None:
    store = Store(POD, index_label="warmgate.dev/service")
    store.replace("ns", [pod("a", 5)])
    store.record(pod("a", 7))  # what our own write returned
    assert not store.apply("MODIFIED", pod("a", 7))  # its watch event: nothing new
    store.record(pod("a", 6))  # an older copy (a slow reply)
    assert store.get("ns", "a")["metadata"]["resourceVersion"] == "7"
    assert store.apply("MODIFIED", pod("a", 8))


def test_the_label_index_follows_a_relabelled_object_and_replace_keeps_other_namespaces() -> None:
    store = Store(POD, index_label="warmgate.dev/service")
    store.replace(None, [pod("a", 1), pod("z", 2, namespace="other")])
    store.apply("MODIFIED", pod("a", 3, service="e5"))
    assert store.labelled("ns", "minilm") == [] and len(store.labelled("ns", "e5")) == 1
    gone = store.replace("ns", [])  # a listing of namespace ns only
    assert [obj["metadata"]["name"] for obj in gone] == ["a"]
    assert names(store) == ["z"] and store.labelled("ns", "e5") == []


async def test_an_optional_kind_whose_crd_is_missing_is_taken_as_empty_until_it_is_served() -> None:
    """An operator upgraded before the EmbeddingAlias CRD was applied: the alias listing is
    a 404. It counts as an empty first listing (so reconciles start), and is tried again
    until the CRD is there."""
    missing = ApiError(404, "NotFound", "the server could not find the requested resource")
    api = ScriptedApi([missing, missing, ([pod("a", 1)], "10")], [[QUIET]])  # type: ignore[list-item]
    store = Store(POD)
    events: list = []
    reflector = Reflector(
        api,  # type: ignore[arg-type]
        store,
        events.append,
        "ns",
        settings=FAST,
        optional=True,
    )
    task = asyncio.create_task(reflector.run())
    try:
        await asyncio.wait_for(reflector.synced.wait(), 1)
        first = events[0]
        assert isinstance(first, Listing) and first.objects == () and not first.relist
        for _ in range(200):
            if len(store):
                break
            await asyncio.sleep(0.005)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert names(store) == ["a"] and api.lists == 3
    assert [len(e.objects) for e in events] == [0, 1]  # the second 404 tells nothing new


async def test_a_kind_that_must_be_served_is_not_taken_as_empty() -> None:
    missing = ApiError(404, "NotFound", "the server could not find the requested resource")
    api = ScriptedApi([missing, ([pod("a", 1)], "10")], [[QUIET]])  # type: ignore[list-item]
    _, events = await reflect(api, lambda events: len(events) == 1)
    assert len(events[0].objects) == 1 and api.lists == 2


def test_an_audit_prunes_only_what_it_saw_held_and_no_event_touched_since() -> None:
    """Store.prune, the operator's audit of what kopf carries: held objects the listing lacks
    (or has as a new object of that name) go; one that an event changed while the listing was
    asked for stays, and so do other namespaces and objects listed but not held."""
    store = Store(POD, index_label="warmgate.dev/service")
    store.replace(None, [pod("a", 1), pod("b", 2), pod("c", 3), pod("d", 4, namespace="other")])
    held = store.versions("ns")
    assert set(held) == {("ns", "a"), ("ns", "b"), ("ns", "c")}
    store.apply("MODIFIED", pod("b", 5))  # an event during the listing
    listed = [pod("c", 3, uid="uid-c2"), pod("e", 6)]  # c was replaced; e is new, not held
    gone = store.prune(listed, held)
    assert sorted(obj["metadata"]["name"] for obj in gone) == ["a", "c"]
    assert names(store) == ["b", "d"]
    assert store.labelled("ns", "minilm")[0]["metadata"]["name"] == "b"
