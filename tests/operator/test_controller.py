"""The work queue: events collapse, one reconcile per key at a time, failures back off."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from warmgate_operator.controller import Controller


@dataclass
class Result:
    requeue_after: float | None = None
    body: dict[str, Any] | None = None


def body(name: str, rv: int = 1) -> dict[str, Any]:
    return {"metadata": {"namespace": "ns", "name": name, "uid": name, "resourceVersion": str(rv)}}


async def wait_for(predicate, seconds: float = 2.0) -> None:
    for _ in range(int(seconds / 0.005)):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("timed out")


async def test_events_for_one_key_collapse_and_never_overlap() -> None:
    running: set[str] = set()
    calls: list[str] = []
    gate = asyncio.Event()

    async def reconcile(obj: dict[str, Any]) -> Result:
        name = obj["metadata"]["name"]
        assert name not in running, "two reconciles of one key at once"
        running.add(name)
        calls.append(name)
        await gate.wait()
        running.discard(name)
        return Result()

    controller = Controller(reconcile, workers=4, resync_seconds=3600)
    controller.start()
    try:
        controller.observe(body("a"))
        await wait_for(lambda: calls == ["a"])
        for _ in range(10):  # arrive while "a" runs: one more reconcile, not ten
            controller.enqueue(("ns", "a"))
        controller.observe(body("b"))
        await wait_for(lambda: len(calls) == 2)
        gate.set()
        await wait_for(lambda: len(calls) == 3)
        await asyncio.sleep(0.05)
        assert sorted(calls) == ["a", "a", "b"]
    finally:
        await controller.stop()


async def test_unknown_and_deleted_keys_are_not_reconciled() -> None:
    calls: list[str] = []

    async def reconcile(obj: dict[str, Any]) -> Result:
        calls.append(obj["metadata"]["name"])
        return Result()

    controller = Controller(reconcile, workers=1, resync_seconds=3600)
    controller.start()
    try:
        controller.enqueue(("ns", "child-of-nobody"))
        controller.observe(body("gone"), deleted=True)
        await asyncio.sleep(0.05)
        assert calls == []
    finally:
        await controller.stop()


async def test_failures_are_retried() -> None:
    attempts: list[int] = []

    async def reconcile(obj: dict[str, Any]) -> Result:
        attempts.append(1)
        if len(attempts) == 1:
            raise RuntimeError("apiserver hiccup")
        return Result()

    controller = Controller(reconcile, workers=1, resync_seconds=3600)
    controller.start()
    try:
        controller.observe(body("a"))
        await wait_for(lambda: len(attempts) == 2, seconds=5)
    finally:
        await controller.stop()


async def test_resync_reconciles_everything_again() -> None:
    calls: list[str] = []

    async def reconcile(obj: dict[str, Any]) -> Result:
        calls.append(obj["metadata"]["name"])
        return Result()

    controller = Controller(reconcile, workers=2, resync_seconds=0.05)
    controller.start()
    try:
        controller.observe(body("a"))
        controller.observe(body("b"))
        await wait_for(lambda: calls.count("a") >= 3 and calls.count("b") >= 3)
    finally:
        await controller.stop()


async def test_older_copies_do_not_replace_newer_ones() -> None:
    async def reconcile(obj: dict[str, Any]) -> Result:
        return Result()

    controller = Controller(reconcile)
    controller.observe(body("a", rv=10))
    controller.observe(body("a", rv=9))
    assert controller.body(("ns", "a"))["metadata"]["resourceVersion"] == "10"


async def test_the_echo_of_an_own_status_write_is_not_reconciled_again() -> None:
    calls: list[str] = []

    async def reconcile(obj: dict[str, Any]) -> Result:
        calls.append(obj["metadata"]["resourceVersion"])
        if obj["metadata"]["resourceVersion"] == "1":
            return Result(body=body("a", rv=2))  # what the status write returned
        return Result()

    controller = Controller(reconcile, workers=1, resync_seconds=3600)
    controller.start()
    try:
        controller.observe(body("a", rv=1))
        await wait_for(lambda: calls == ["1"])
        await asyncio.sleep(0.02)
        controller.observe(body("a", rv=2))  # the watch event of that write
        controller.observe(body("a", rv=3))  # someone else's change
        await wait_for(lambda: calls == ["1", "3"])
    finally:
        await controller.stop()


async def test_after_a_relist_a_service_deleted_in_the_gap_is_forgotten_not_reconciled() -> None:
    """A watch that expired (410) and relisted sends no DELETED for what went meanwhile: each
    remembered EmbeddingService is confirmed (by its listing event, or a GET) before its next
    reconcile, so no children are recreated for one that is gone."""
    calls: list[str] = []
    checked: list[str] = []
    gone: list[str] = []
    alive = {"kept": True, "listed": True, "deleted": False}

    async def reconcile(obj: dict[str, Any]) -> Result:
        calls.append(obj["metadata"]["name"])
        return Result()

    async def exists(obj: dict[str, Any]) -> bool:
        checked.append(obj["metadata"]["name"])
        return alive[obj["metadata"]["name"]]

    controller = Controller(
        reconcile,
        workers=2,
        resync_seconds=3600,
        exists=exists,
        on_gone=lambda obj: gone.append(obj["metadata"]["name"]),
    )
    controller.start()
    try:
        for name in alive:
            controller.observe(body(name))
        await wait_for(lambda: len(calls) == 3)
        controller.relisted()
        controller.observe(body("listed", rv=2))  # the relist's own event confirms it
        await wait_for(lambda: calls.count("listed") == 2)
        for name in ("kept", "deleted"):  # child events (a pod of it changed) ask for more
            controller.enqueue(("ns", name))
        await wait_for(lambda: calls.count("kept") == 2 and gone == ["deleted"])
        await asyncio.sleep(0.05)
        assert calls.count("deleted") == 1  # never again after the relist
        assert sorted(checked) == ["deleted", "kept"]  # "listed" needed no GET
        assert controller.body(("ns", "deleted")) is None
        controller.enqueue(("ns", "kept"))
        await wait_for(lambda: calls.count("kept") == 3)
        assert sorted(checked) == ["deleted", "kept"]  # confirmed once is enough
    finally:
        await controller.stop()
