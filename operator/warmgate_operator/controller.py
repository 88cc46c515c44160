"""The work queue between kopf's watch events and reconcile.

Many events for one EmbeddingService (its own changes, its Deployment's, each pod's) collapse
into one pending reconcile; a key is never reconciled twice at once; a fixed number of workers
bounds the load on the apiserver; a periodic resync repairs drift in unwatched children.
Like client-go's workqueue, without the parts this operator does not need.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from . import metrics
from .relist import Confirmations, Exists

logger = logging.getLogger(__name__)

Key = tuple[str, str]  # (namespace, name)

MAX_BACKOFF_SECONDS = 300.0


class Result(Protocol):
    requeue_after: float | None
    body: dict[str, Any] | None


def key_of(body: Mapping[str, Any]) -> Key:
    meta = body["metadata"]
    return meta["namespace"], meta["name"]


def _resource_version(body: Mapping[str, Any]) -> int | None:
    try:
        return int(body["metadata"]["resourceVersion"])
    except (KeyError, TypeError, ValueError):
        return None


class Controller:
    def __init__(
        self,
        reconcile: Callable[[Mapping[str, Any]], Awaitable[Result]],
        workers: int = 8,
        resync_seconds: float = 60.0,
        exists: Exists | None = None,
        on_gone: Callable[[Mapping[str, Any]], None] = lambda body: None,
    ) -> None:
        self._reconcile = reconcile
        self._confirmations = Confirmations(exists)
        self._on_gone = on_gone
        self._workers = workers
        self._resync_seconds = resync_seconds
        self._bodies: dict[Key, dict[str, Any]] = {}
        self._queue: asyncio.Queue[Key] = asyncio.Queue()
        self._pending: set[Key] = set()
        self._active: set[Key] = set()
        self._dirty: set[Key] = set()
        self._failures: dict[Key, int] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._timers: dict[Key, asyncio.TimerHandle] = {}
        self._soon: dict[Key, asyncio.TimerHandle] = {}
        self.reconciles = 0

    # -- what kopf's handlers call -------------------------------------------------------------

    def observe(self, body: Mapping[str, Any], deleted: bool = False) -> None:
        """An EmbeddingService was listed, added, changed or deleted."""
        key = key_of(body)
        self._confirmations.seen(key)
        if deleted:
            self._bodies.pop(key, None)
            self._failures.pop(key, None)
            for timers in (self._timers, self._soon):
                timer = timers.pop(key, None)
                if timer is not None:
                    timer.cancel()
            return
        old = self._bodies.get(key)
        if (
            old is not None
            and old["metadata"].get("uid") == body["metadata"].get("uid")
            and old["metadata"].get("resourceVersion") == body["metadata"].get("resourceVersion")
        ):
            return  # the echo of this operator's own status write: already reconciled
        self._remember(body)
        self.enqueue(key)

    def relisted(self) -> None:
        """The EmbeddingService watch started again (a 410 relist, a dropped stream): its
        listing says nothing of objects deleted in the gap, so each one remembered must be
        seen again, by an event or a GET, before it is reconciled (no children recreated for
        a deleted EmbeddingService)."""
        self._confirmations.relisted(self._bodies)

    def enqueue(self, key: Key) -> None:
        """Ask for one reconcile of `key` soon (collapsed with any already pending)."""
        if key not in self._bodies:
            return  # a child of an EmbeddingService not (yet) seen, or one already gone
        if key in self._active:
            self._dirty.add(key)
        elif key not in self._pending:
            self._pending.add(key)
            self._queue.put_nowait(key)

    def enqueue_soon(self, key: Key, delay: float = 0.5) -> None:
        """Reconcile `key` within `delay` seconds: a burst of child events (a Deployment's status
        updates, a pod starting) becomes one reconcile."""
        if key in self._soon or key not in self._bodies:
            return
        loop = asyncio.get_running_loop()
        self._soon[key] = loop.call_later(delay, self._fire_soon, key)

    def _fire_soon(self, key: Key) -> None:
        self._soon.pop(key, None)
        self.enqueue(key)

    def enqueue_after(self, key: Key, delay: float) -> None:
        old = self._timers.pop(key, None)
        if old is not None:
            old.cancel()
        loop = asyncio.get_running_loop()
        self._timers[key] = loop.call_later(delay, self._fire_timer, key)

    def body(self, key: Key) -> dict[str, Any] | None:
        return self._bodies.get(key)

    @property
    def keys(self) -> list[Key]:
        return list(self._bodies)

    # -- running -------------------------------------------------------------------------------

    def start(self) -> None:
        for index in range(self._workers):
            self._tasks.append(asyncio.create_task(self._work(), name=f"reconcile-{index}"))
        self._tasks.append(asyncio.create_task(self._resync(), name="resync"))

    async def stop(self) -> None:
        for timer in [*self._timers.values(), *self._soon.values()]:
            timer.cancel()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

    def _fire_timer(self, key: Key) -> None:
        self._timers.pop(key, None)
        self.enqueue(key)

    def _remember(self, body: Mapping[str, Any]) -> None:
        key = key_of(body)
        old = self._bodies.get(key)
        if old is not None and old["metadata"].get("uid") == body["metadata"].get("uid"):
            old_rv, new_rv = _resource_version(old), _resource_version(body)
            if old_rv is not None and new_rv is not None and new_rv < old_rv:
                return  # an older copy than the one already held (e.g. our own write's reply)
        self._bodies[key] = dict(body)

    async def _resync(self) -> None:
        while True:
            await asyncio.sleep(self._resync_seconds)
            for key in list(self._bodies):
                self.enqueue(key)

    async def _work(self) -> None:
        while True:
            key = await self._queue.get()
            self._pending.discard(key)
            body = self._bodies.get(key)
            if body is None:
                continue
            if not await self._confirm(key, body):
                continue
            self._active.add(key)
            try:
                await self._reconcile_one(key, body)
            finally:
                self._active.discard(key)
                if key in self._dirty:
                    self._dirty.discard(key)
                    self.enqueue(key)

    async def _confirm(self, key: Key, body: Mapping[str, Any]) -> bool:
        """Whether to reconcile `key`: after a relist, only once it is known to still exist."""
        alive = await self._confirmations.still_there(key, body)
        if alive is None:  # the API is away: look again later
            self.enqueue_after(key, 5.0)
            return False
        if key not in self._bodies:  # deleted by an event meanwhile
            return False
        if alive is False:
            logger.info("%s/%s was deleted while the watch was down: forgetting it", *key)
            self.observe(body, deleted=True)
            self._on_gone(body)
            return False
        return True

    async def _reconcile_one(self, key: Key, body: Mapping[str, Any]) -> None:
        started = time.monotonic()
        try:
            result = await self._reconcile(body)
        except asyncio.CancelledError:
            raise
        except Exception:
            metrics.RECONCILES.labels(result="error").inc()
            metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)
            failures = self._failures.get(key, 0) + 1
            self._failures[key] = failures
            delay = min(MAX_BACKOFF_SECONDS, 2.0 ** min(failures, 10))
            logger.exception(
                "reconcile of %s/%s failed (attempt %d); retrying in %.0fs",
                *key,
                failures,
                delay,
            )
            self.enqueue_after(key, delay)
            return
        self.reconciles += 1
        metrics.RECONCILES.labels(result="ok").inc()
        metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)
        if result.body is not None and key in self._bodies:
            self._remember(result.body)
        if result.requeue_after is not None:
            failures = self._failures.get(key, 0) + 1
            self._failures[key] = failures
            self.enqueue_after(
                key, min(MAX_BACKOFF_SECONDS, result.requeue_after * 2 ** min(failures - 1, 6))
            )
        else:
            self._failures.pop(key, None)
        logger.debug("reconciled %s/%s in %.3fs", *key, time.monotonic() - started)
