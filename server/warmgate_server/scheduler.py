"""The dynamic batcher (core): a bounded queue of inputs grouped by sequence bucket, batches
built against the batch-size and token limits (padding counted), results handed back per request
in order. Every request goes through it: pooled (one vector per input) and per-token (/embed_all)
alike, under the same queue bound, forward timeout and fault accounting; a batch holds inputs of
one kind only, since its forward pass either pools or does not. Knows tokens, buckets and
futures; nothing of HTTP or torch."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np

from warmgate_contract.report import ProfileEntry, render_profile
from warmgate_contract.shapes import Shape

from .bucketing import ShapePolicy, bucket_for
from .errors import ModelFault, QueueFull
from .metrics import Metrics
from .runner import BatchResult

log = logging.getLogger(__name__)


SHARE_MIN_INPUTS = 8
"""share_load never cuts a batch below this many inputs: a few inputs cost a forward pass
about as much together as apart (every pass reads all the weights), so they stay together
(and a lone small request still runs solo)."""


class Execute(Protocol):
    """Run a batch as a shape on a model worker (its index). `solo`: on every worker's cores;
    `pooled`: one vector per input, else every input's token states."""

    def __call__(
        self, batch: list[Sequence[int]], shape: Shape, worker: int, *, solo: bool, pooled: bool
    ) -> Awaitable[BatchResult]: ...


@dataclass
class StageTimes:
    """Where a request's time went, in seconds; for a request split over several batches, the
    slowest batch's figures (the batches run side by side or one after another)."""

    tokenize: float = 0.0
    queue: float = 0.0
    """From being queued to its batch starting on a model worker."""
    model: float = 0.0
    """From its batch starting to its vectors being back on the event loop."""
    model_cpu: float = 0.0
    """CPU time of the forward pass (the model thread's)."""

    def server_timing(self, total: float) -> str:
        """A Server-Timing header value, in milliseconds, `embed` being the whole request."""
        parts = [
            ("tokenize", self.tokenize),
            ("queue", self.queue),
            ("model", self.model),
            ("model-cpu", self.model_cpu),
            ("embed", total),
        ]
        return ", ".join(f"{name};dur={seconds * 1000.0:.1f}" for name, seconds in parts)


@dataclass(frozen=True)
class Embedded:
    outputs: list[np.ndarray]
    """Per input, in request order: its pooled vector (float32, as the module chain left it),
    or its tokens' last hidden states (tokens, hidden)."""
    cold: bool
    """At least one of the batches that served this request ran its shape for the first time."""
    timing: StageTimes = field(default_factory=StageTimes)


@dataclass
class _Request:
    future: asyncio.Future[Embedded]
    outputs: list[np.ndarray | None]
    """By input index, filled as its batches finish: all set once `remaining` is 0."""
    remaining: int
    pooled: bool
    recorded: bool = True
    cold: bool = False
    timing: StageTimes = field(default_factory=StageTimes)

    @property
    def abandoned(self) -> bool:
        """The client left (the handler was cancelled) or the request already failed."""
        return self.future.done()


class Lane(NamedTuple):
    """Inputs that may share a batch: the same kind of output, and the bucket that holds them."""

    pooled: bool
    bucket: int


@dataclass
class _Item:
    request: _Request
    index: int
    token_ids: Sequence[int]
    lane: Lane
    order: int
    enqueued: float


@dataclass
class Scheduler:
    policy: ShapePolicy
    execute: Execute
    metrics: Metrics
    max_wait_s: float
    max_queued_inputs: int
    workers: int = 1
    """Batches that may run at once (model workers); a batch starts as soon as one is free."""
    more_coming: Callable[[], bool] = lambda: True
    """Whether other requests are about to be queued (e.g. being tokenized). When none are,
    waiting for a fuller batch only adds latency."""
    forward_timeout_s: float | None = None
    """A batch running longer fails its requests (ModelFault, hung) and counts as a fault; its
    worker stays taken until the pass really returns."""
    on_fault: Callable[[str, bool], None] = lambda error, hung: None
    """Called with (what went wrong, hung) for each failed or hung batch, once it is counted
    (model_faults_total)."""
    on_success: Callable[[], None] = lambda: None
    """Called for each batch that ran."""
    solo: Callable[[Shape], bool] = lambda shape: False
    """Whether a batch of this shape may run solo: when it is all there is to do (no other
    batch running, nothing queued or being tokenized) it gets every worker's cores, and no
    other batch starts until it is done. A lone small request then takes half the time on two
    cores, while under load the workers still run side by side."""
    share_load: bool = False
    """With several workers, a batch takes at most its fair share of the inputs in the server
    (those queued and those running, over the workers) instead of all it can hold: a worker
    that frees up beside a busy one and takes the whole queue leaves the other worker to run
    the few inputs that come next in tiny batches, one after another (at 32 clients sending
    one sentence each: batches of 30 on one worker, of 1 on the other). Only where a batch's
    padding rows cost nothing (the packed pass on a CPU runs its real rows only): elsewhere
    two half batches padded to one planned size would do twice the work."""
    _pending: dict[Lane, deque[_Item]] = field(default_factory=dict)
    _arrival: asyncio.Event = field(default_factory=asyncio.Event)
    _order: itertools.count = field(default_factory=itertools.count)
    _queued: int = 0
    _free: list[int] = field(default_factory=list)
    _worker_freed: asyncio.Event = field(default_factory=asyncio.Event)
    _running: set[asyncio.Task[None]] = field(default_factory=set)
    _active: int = 0
    _running_inputs: int = 0
    """Inputs of the batches running now."""
    _solo: bool = False
    served: Counter[Shape] = field(default_factory=Counter)
    """Shapes run for requests (warmup excluded), with counts: the /warmup/profile."""

    @property
    def depth(self) -> int:
        return self._queued

    @property
    def idle(self) -> bool:
        return self._queued == 0 and self._active == 0

    async def submit(
        self, token_ids: Sequence[Sequence[int]], record: bool = True, pooled: bool = True
    ) -> Embedded:
        """Queue one request's inputs (each within the largest bucket) and await its outputs:
        pooled vectors, or with `pooled=False` every input's token states.

        `record=False` keeps the request out of the served-shape profile and batch metrics
        (the server's own warmup of the serving path)."""
        if self._queued + len(token_ids) > self.max_queued_inputs:
            raise QueueFull(f"{self._queued} inputs already queued")
        lanes = []
        for index, ids in enumerate(token_ids):
            bucket = bucket_for(len(ids), self.policy.buckets)
            if bucket is None:
                raise ValueError(f"input {index} has {len(ids)} tokens, above the largest bucket")
            lanes.append(Lane(pooled, bucket))
        loop = asyncio.get_running_loop()
        count = len(token_ids)
        request = _Request(loop.create_future(), [None] * count, count, pooled, record)
        now = time.monotonic()
        for index, (ids, lane) in enumerate(zip(token_ids, lanes, strict=True)):
            item = _Item(request, index, ids, lane, next(self._order), now)
            self._pending.setdefault(lane, deque()).append(item)
        self._queued += len(token_ids)
        self.metrics.queue_depth.set(self._queued)
        self._arrival.set()
        try:
            return await request.future
        finally:
            # A cancelled handler leaves its items queued; the batcher drops them unrun.
            if not request.future.done():
                request.future.cancel()

    def _drop_abandoned_heads(self) -> None:
        for lane, items in list(self._pending.items()):
            while items and items[0].request.abandoned:
                items.popleft()
                self._queued -= 1
            if not items:
                del self._pending[lane]

    def _choose_lane(self) -> Lane | None:
        """The lane of the next batch: the oldest input always rides in it; among the buckets
        of its kind that hold it, the one with the fewest padded tokens per input (shorter
        inputs fill a longer bucket's rows when that beats running them apart)."""
        self._drop_abandoned_heads()
        if not self._pending:
            return None
        anchor = min(self._pending, key=lambda lane: self._pending[lane][0].order)
        best: tuple[float, Lane] | None = None
        waiting = 0
        for lane in sorted(lane for lane in self._pending if lane.pooled == anchor.pooled):
            waiting += len(self._pending[lane])
            if lane.bucket < anchor.bucket:
                continue
            count = min(waiting, self.policy.capacity(lane.bucket))
            cost = self.policy.shape_for(count, lane.bucket).tokens / count
            if best is None or cost < best[0]:
                best = (cost, lane)
        assert best is not None
        return best[1]

    def _share(self, capacity: int) -> int:
        """How many inputs the next batch may take: all it holds, or with share_load the
        workers' fair share of the inputs queued and running (at least one)."""
        if not self.share_load or self.workers < 2:
            return capacity
        fair = -(-(self._queued + self._running_inputs) // self.workers)
        return min(capacity, max(SHARE_MIN_INPUTS, fair))

    def _take(self, lane: Lane) -> list[_Item]:
        """Up to a batch of inputs of `lane`'s kind that fit its bucket, oldest first."""
        capacity = self._share(self.policy.capacity(lane.bucket))
        sources = [
            items
            for key, items in self._pending.items()
            if key.pooled == lane.pooled and key.bucket <= lane.bucket
        ]
        taken: list[_Item] = []
        while len(taken) < capacity:
            heads = [items for items in sources if items]
            if not heads:
                break
            item = min(heads, key=lambda items: items[0].order).popleft()
            self._queued -= 1
            if not item.request.abandoned:
                taken.append(item)
        for key in [key for key, items in self._pending.items() if not items]:
            del self._pending[key]
        self.metrics.queue_depth.set(self._queued)
        return taken

    async def _wait_for_more(self, lane: Lane) -> None:
        """Give a batch that is not full up to max_wait from its oldest input to fill up."""
        oldest = min(items[0].enqueued for items in self._pending.values() if items)
        deadline = oldest + self.max_wait_s
        capacity = self.policy.capacity(lane.bucket)
        while self._queued < capacity:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._arrival.clear()
            try:
                await asyncio.wait_for(self._arrival.wait(), remaining)
            except TimeoutError:
                return

    async def run(self) -> None:
        """The batching loop; runs until cancelled. Whenever a model worker is free and inputs
        wait, it builds the next batch and starts it on that worker."""
        self._free = list(range(self.workers - 1, -1, -1))  # pop() hands out worker 0 first
        try:
            while True:
                if not self._free or self._solo:
                    self._worker_freed.clear()
                    await self._worker_freed.wait()
                    continue
                lane = self._choose_lane()
                if lane is None:
                    self._arrival.clear()
                    await self._arrival.wait()
                    continue
                if (
                    self.max_wait_s > 0
                    and self.more_coming()
                    and self._queued < self.policy.capacity(lane.bucket)
                ):
                    await self._wait_for_more(lane)
                    lane = self._choose_lane()
                    if lane is None:
                        continue
                batch = self._take(lane)
                if batch:
                    solo = self._alone(batch)
                    if solo:  # always worker 0: the one whose thread the warmup ran solo
                        self._free.remove(0)
                        self._start(batch, 0, solo=True)
                    else:
                        self._start(batch, self._free.pop())
        finally:
            for task in self._running:
                task.cancel()
            if self._running:
                await asyncio.gather(*self._running, return_exceptions=True)

    def _alone(self, batch: list[_Item]) -> bool:
        """Whether `batch` runs solo: nothing else running, queued or being tokenized, and a
        shape that may."""
        if self._active or self._queued or self.more_coming():
            return False
        return self.solo(self._shape(batch))

    def _start(self, batch: list[_Item], worker: int, solo: bool = False) -> None:
        # Counted before the task first runs, so the loop's next choice already sees it.
        self._active += 1
        self._running_inputs += len(batch)
        self._solo = solo  # when solo, the loop starts nothing else until it ends
        task = asyncio.create_task(self._run_on(batch, worker, solo))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _run_on(self, batch: list[_Item], worker: int, solo: bool = False) -> None:
        try:
            await self._run_batch(batch, worker, solo)
        finally:
            # Before any awaiting request resumes: a caller that got its vectors sees the
            # worker free and, with nothing queued, the scheduler idle.
            self._active -= 1
            self._running_inputs -= len(batch)
            if solo:
                self._solo = False
            self._free.append(worker)
            self._worker_freed.set()

    def _shape(self, batch: list[_Item]) -> Shape:
        bucket = max(item.lane.bucket for item in batch)  # the smallest that holds them all
        return self.policy.shape_for(len(batch), bucket)

    async def _run_batch(self, batch: list[_Item], worker: int = 0, solo: bool = False) -> None:
        shape = self._shape(batch)
        pooled = batch[0].lane.pooled  # a batch holds one lane's kind (_take)
        started = time.monotonic()
        running = asyncio.ensure_future(
            self.execute(
                [item.token_ids for item in batch], shape, worker, solo=solo, pooled=pooled
            )
        )
        try:
            result = await asyncio.wait_for(asyncio.shield(running), self.forward_timeout_s)
        except asyncio.CancelledError:
            running.cancel()
            for item in batch:
                if not item.request.abandoned:
                    item.request.future.cancel()
            raise
        except TimeoutError:
            message = (
                f"the forward pass of {shape.key} on worker {worker} is still running after "
                f"{self.forward_timeout_s:g}s"
            )
            log.error("%s: failing its %d requests", message, len(batch))
            self._fail(batch, ModelFault(message, hung=True))
            self._fault(message, hung=True)
            # The thread is still busy: keep the worker taken until it returns.
            await asyncio.gather(running, return_exceptions=True)
            return
        except Exception as exc:
            log.exception("batch %s failed", shape.key)
            message = f"{type(exc).__name__}: {exc}"
            self._fail(batch, ModelFault(f"the forward pass of {shape.key} failed: {message}"))
            self._fault(message, hung=False)
            return
        self.on_success()
        if any(item.request.recorded for item in batch):
            self.served[shape] += 1
            real_tokens = sum(len(item.token_ids) for item in batch)
            self.metrics.observe_batch(
                shape,
                len(batch),
                real_tokens,
                result.seconds,
                result.first_time,
                cpu_seconds=result.cpu_seconds,
            )
        model_seconds = time.monotonic() - started
        for row, item in enumerate(batch):
            request = item.request
            if request.abandoned:
                continue
            timing = request.timing
            timing.queue = max(timing.queue, started - item.enqueued)
            timing.model = max(timing.model, model_seconds)
            timing.model_cpu = max(timing.model_cpu, result.cpu_seconds)
            request.outputs[item.index] = result.vectors[row]
            request.cold = request.cold or result.first_time
            request.remaining -= 1
            if request.remaining == 0:
                request.future.set_result(Embedded(request.outputs, request.cold, request.timing))

    def _fault(self, message: str, hung: bool) -> None:
        self.metrics.model_faults.labels(kind="hung" if hung else "raised").inc()
        self.on_fault(message, hung)

    @staticmethod
    def _fail(batch: list[_Item], error: Exception) -> None:
        for item in batch:
            if not item.request.abandoned:
                item.request.future.set_exception(error)

    def profile(self) -> dict[str, list[dict[str, int]]]:
        """The served shapes with counts, most frequent first (the warmup profile format)."""
        return render_profile(ProfileEntry(shape, count) for shape, count in self.served.items())
