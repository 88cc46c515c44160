"""The work queue: events collapse, one reconcile per key at a time, failures back off."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from typing import Any

from warmgate_kube.kinds import EMBEDDING_SERVICE
from warmgate_kube.watch import Store
from warmgate_operator.controller import Controller
from warmgate_operator.metrics import Metrics


@dataclass
class Result:
    requeue_after: float | None = None
    recheck_after: float | None = None


def body(name: str, rv: int = 1) -> dict[str, Any]:
    return {"metadata": {"namespace": "ns", "name": name, "uid": name, "resourceVersion": str(rv)}}


class Services(Store):
    """The watch cache's EmbeddingServices, fed by hand as a watch would."""

    def __init__(self) -> None:
        super().__init__(EMBEDDING_SERVICE)

    def add(self, controller: Controller, obj: dict[str, Any]) -> None:
        if self.apply("MODIFIED", obj):
            controller.enqueue((obj["metadata"]["namespace"], obj["metadata"]["name"]))


def controller_of(reconcile, **kwargs: Any) -> tuple[Controller, Services]:
    services = Services()
    return Controller(reconcile, services, Metrics(), **kwargs), services


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

    controller, services = controller_of(reconcile, workers=4, resync_seconds=3600)
    controller.start()
    try:
        services.add(controller, body("a"))
        await wait_for(lambda: calls == ["a"])
        for _ in range(10):  # arrive while "a" runs: one more reconcile, not ten
            controller.enqueue(("ns", "a"))
        services.add(controller, body("b"))
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

    controller, services = controller_of(reconcile, workers=1, resync_seconds=3600)
    controller.start()
    try:
        controller.enqueue(("ns", "child-of-nobody"))
        services.add(controller, body("gone"))
        services.apply("DELETED", body("gone"))  # before a worker took it
        controller.forget(("ns", "gone"))
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

    controller, services = controller_of(reconcile, workers=1, resync_seconds=3600)
    controller.start()
    try:
        services.add(controller, body("a"))
        await wait_for(lambda: len(attempts) == 2, seconds=5)
    finally:
        await controller.stop()


async def test_resync_reconciles_everything_again() -> None:
    calls: list[str] = []

    async def reconcile(obj: dict[str, Any]) -> Result:
        calls.append(obj["metadata"]["name"])
        return Result()

    controller, services = controller_of(reconcile, workers=2, resync_seconds=0.05)
    controller.start()
    try:
        services.add(controller, body("a"))
        services.add(controller, body("b"))
        await wait_for(lambda: calls.count("a") >= 3 and calls.count("b") >= 3)
    finally:
        await controller.stop()


async def test_the_echo_of_an_own_status_write_is_not_reconciled_again() -> None:
    """Reconcile keeps what its status write returned in the cache (Store.record): that
    write's watch event then changes nothing and reconciles nothing; someone else's does."""
    calls: list[str] = []
    services = Services()

    async def reconcile(obj: dict[str, Any]) -> Result:
        calls.append(obj["metadata"]["resourceVersion"])
        if obj["metadata"]["resourceVersion"] == "1":
            services.record(body("a", rv=2))  # what the status write returned
        return Result()

    controller = Controller(reconcile, services, Metrics(), workers=1, resync_seconds=3600)
    controller.start()
    try:
        services.add(controller, body("a", rv=1))
        await wait_for(lambda: calls == ["1"])
        await asyncio.sleep(0.02)
        services.add(controller, body("a", rv=2))  # the watch event of that write
        services.add(controller, body("a", rv=3))  # someone else's change
        await wait_for(lambda: calls == ["1", "3"])
    finally:
        await controller.stop()


async def test_a_recheck_comes_at_its_time_without_backing_off() -> None:
    """An idle window's end (scale to zero) is no failure: each reconcile that asks for a
    recheck gets it after the time asked, never doubled."""
    started = asyncio.get_running_loop().time()
    calls: list[float] = []

    async def reconcile(obj: dict[str, Any]) -> Result:
        calls.append(asyncio.get_running_loop().time() - started)
        return Result(recheck_after=0.1)

    controller, services = controller_of(reconcile, workers=1, resync_seconds=3600)
    controller.start()
    try:
        services.add(controller, body("a"))
        await wait_for(lambda: len(calls) == 4, seconds=2)
    finally:
        await controller.stop()
    gaps = [later - earlier for earlier, later in itertools.pairwise(calls)]
    assert all(0.1 <= gap < 0.19 for gap in gaps), gaps
