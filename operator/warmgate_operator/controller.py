"""The work queue between kopf's watch events and reconcile.

Many events for one EmbeddingService (its own changes, its children's, each pod's) collapse
into one pending reconcile; a key is never reconciled twice at once; a fixed number of workers
bounds the load on the apiserver; a periodic resync reconciles everything again (from the
cache: it costs a write only where something drifted). Like client-go's workqueue, without the
parts this operator does not need.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from warmgate_kube.watch import Key, Store

from .metrics import Metrics

logger = logging.getLogger(__name__)

MAX_BACKOFF_SECONDS = 300.0


class Result(Protocol):
    requeue_after: float | None
    """A failure's retry, backed off further on each repeat."""
    recheck_after: float | None
    """No failure: reconcile again after this long (an idle window's end), as it is."""


class Controller:
    """Reconciles the EmbeddingServices held in `services` (the watch cache): a key is queued
    when its object or one of its children changes, and every `resync_seconds`."""

    def __init__(
        self,
        reconcile: Callable[[Mapping[str, Any]], Awaitable[Result]],
        services: Store,
        metrics: Metrics,
        workers: int = 8,
        resync_seconds: float = 60.0,
    ) -> None:
        self._reconcile = reconcile
        self._services = services
        self._metrics = metrics
        self._workers = workers
        self._resync_seconds = resync_seconds
        self._queue: asyncio.Queue[Key] = asyncio.Queue()
        self._pending: set[Key] = set()
        self._active: set[Key] = set()
        self._dirty: set[Key] = set()
        self._failures: dict[Key, int] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._timers: dict[Key, asyncio.TimerHandle] = {}
        self._soon: dict[Key, asyncio.TimerHandle] = {}
        self.reconciles = 0

    # -- what the watches' events call --------------------------------------------------------

    def forget(self, key: Key) -> None:
        """The EmbeddingService is gone: drop its timers and failure count."""
        self._failures.pop(key, None)
        for timers in (self._timers, self._soon):
            timer = timers.pop(key, None)
            if timer is not None:
                timer.cancel()

    def enqueue(self, key: Key) -> None:
        """Ask for one reconcile of `key` soon (collapsed with any already pending)."""
        if self.body(key) is None:
            return  # a child of an EmbeddingService not (yet) seen, or one already gone
        if key in self._active:
            self._dirty.add(key)
        elif key not in self._pending:
            self._pending.add(key)
            self._queue.put_nowait(key)

    def enqueue_soon(self, key: Key, delay: float = 0.5) -> None:
        """Reconcile `key` within `delay` seconds: a burst of child events (a Deployment's status
        updates, a pod starting) becomes one reconcile."""
        if key in self._soon or self.body(key) is None:
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
        return self._services.get(*key)

    @property
    def keys(self) -> list[Key]:
        return self._services.keys()

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

    async def _resync(self) -> None:
        while True:
            await asyncio.sleep(self._resync_seconds)
            for key in self.keys:
                self.enqueue(key)

    async def _work(self) -> None:
        while True:
            key = await self._queue.get()
            self._pending.discard(key)
            body = self.body(key)
            if body is None:
                continue
            self._active.add(key)
            try:
                await self._reconcile_one(key, body)
            finally:
                self._active.discard(key)
                if key in self._dirty:
                    self._dirty.discard(key)
                    self.enqueue(key)

    async def _reconcile_one(self, key: Key, body: Mapping[str, Any]) -> None:
        started = time.monotonic()
        try:
            result = await self._reconcile(body)
        except asyncio.CancelledError:
            raise
        except Exception:
            self._metrics.reconciles.labels(result="error").inc()
            self._metrics.reconcile_seconds.observe(time.monotonic() - started)
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
        self._metrics.reconciles.labels(result="ok").inc()
        self._metrics.reconcile_seconds.observe(time.monotonic() - started)
        if result.requeue_after is not None:
            failures = self._failures.get(key, 0) + 1
            self._failures[key] = failures
            self.enqueue_after(
                key, min(MAX_BACKOFF_SECONDS, result.requeue_after * 2 ** min(failures - 1, 6))
            )
        else:
            self._failures.pop(key, None)
            if result.recheck_after is not None:
                self.enqueue_after(key, result.recheck_after)
        logger.debug("reconciled %s/%s in %.3fs", *key, time.monotonic() - started)
