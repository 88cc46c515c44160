"""The dynamic batcher on its own: bucket grouping, batch padding, order, dropped clients, and
pooled and per-token requests under the same queue bound, forward timeout and fault counting.

The execute step here is a plain function of the token ids (pooled: vector = [first id, length,
rows]; per token: one row [id, position] per token), so each result can be checked against the
batch it ran in.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import Sequence

import numpy as np
import pytest

from warmgate_contract.shapes import Shape, plan_warmup
from warmgate_server.bucketing import ShapePolicy
from warmgate_server.errors import ModelFault, QueueFull
from warmgate_server.metrics import Metrics
from warmgate_server.runner import BatchResult
from warmgate_server.scheduler import Scheduler


def make_scheduler(
    pad_batch: bool = True, max_wait_s: float = 0.005, workers: int = 1, seconds: float = 0.001
):
    plan = plan_warmup([1, 4], [16, 32], 1024, 8).shapes
    ran: list[tuple[Shape, int]] = []
    spans: list[tuple[int, float, float]] = []  # (worker, started, ended)
    solos: list[bool] = []  # per batch run, whether it ran solo
    kinds: list[bool] = []  # per batch run, whether it pooled

    async def execute(
        batch: list[Sequence[int]], shape: Shape, worker: int, *, solo: bool, pooled: bool
    ) -> BatchResult:
        ran.append((shape, len(batch)))
        solos.append(solo)
        kinds.append(pooled)
        started = time.monotonic()
        await asyncio.sleep(seconds)
        spans.append((worker, started, time.monotonic()))
        if pooled:
            vectors = np.array([[ids[0], len(ids), shape.batch_size] for ids in batch], np.float32)
            return BatchResult(vectors, seconds, first_time=False)
        states = [
            np.array([[token, position] for position, token in enumerate(ids)]) for ids in batch
        ]
        return BatchResult(states, seconds, first_time=False)

    policy = ShapePolicy.build([16, 32], 8, 1024, pad_batch, plan)
    scheduler = Scheduler(
        policy, execute, Metrics(), max_wait_s, max_queued_inputs=64, workers=workers
    )
    scheduler.spans = spans  # type: ignore[attr-defined]
    scheduler.solos = solos  # type: ignore[attr-defined]
    scheduler.kinds = kinds  # type: ignore[attr-defined]
    return scheduler, ran


def ids(first: int, length: int) -> list[int]:
    return [first] * length


def vectors(embedded) -> np.ndarray:
    """A pooled request's vectors, one row per input."""
    return np.stack(embedded.outputs)


async def test_requests_get_their_own_vectors_in_order_split_by_bucket() -> None:
    scheduler, ran = make_scheduler()
    loop_task = asyncio.create_task(scheduler.run())
    try:
        inputs = [ids(1, 20), ids(2, 5), ids(3, 30), ids(4, 3), ids(5, 10)]
        result = await scheduler.submit(inputs)
        assert vectors(result)[:, 0].tolist() == [1, 2, 3, 4, 5]
        assert vectors(result)[:, 1].tolist() == [20, 5, 30, 3, 10]
        # The oldest input needs bucket 32; the next three (two of them short) ride in the same
        # padded 4x32 batch rather than in a 4x16 batch of their own; the last runs as 1x16.
        assert ran == [(Shape(4, 32), 4), (Shape(1, 16), 1)]
        assert scheduler.idle and scheduler.depth == 0
        assert scheduler.profile() == {
            "shapes": [
                {"batch_size": 1, "seq_len": 16, "count": 1},
                {"batch_size": 4, "seq_len": 32, "count": 1},
            ]
        }
    finally:
        loop_task.cancel()


async def test_concurrent_requests_share_batches_up_to_the_largest_planned_size() -> None:
    scheduler, ran = make_scheduler()
    loop_task = asyncio.create_task(scheduler.run())
    try:
        results = await asyncio.gather(*(scheduler.submit([ids(n, 8)]) for n in range(6)))
        assert [vectors(r)[0, 0] for r in results] == list(range(6))
        assert all(shape in {Shape(1, 16), Shape(4, 16)} for shape, _count in ran)
        assert max(count for _shape, count in ran) <= 4
        assert sum(count for _shape, count in ran) == 6
    finally:
        loop_task.cancel()


async def test_a_short_oldest_input_does_not_wait_for_a_long_batch() -> None:
    scheduler, ran = make_scheduler()
    loop_task = asyncio.create_task(scheduler.run())
    try:
        await scheduler.submit([ids(1, 5), ids(2, 20), ids(3, 20), ids(4, 20), ids(5, 20)])
        # 1x16 costs 16 tokens per input, 4x32 would cost 32: the short one runs alone first
        assert ran == [(Shape(1, 16), 1), (Shape(4, 32), 4)]
    finally:
        loop_task.cancel()


async def test_without_padding_batches_run_at_their_real_size() -> None:
    scheduler, ran = make_scheduler(pad_batch=False)
    loop_task = asyncio.create_task(scheduler.run())
    try:
        await scheduler.submit([ids(1, 4), ids(2, 4), ids(3, 4)])
        assert ran == [(Shape(3, 16), 3)]
    finally:
        loop_task.cancel()


async def test_inputs_of_a_client_that_left_are_never_run() -> None:
    scheduler, ran = make_scheduler(max_wait_s=0.05)
    gone = asyncio.create_task(scheduler.submit([ids(7, 4)]))
    await asyncio.sleep(0)  # queued, batcher not started
    gone.cancel()
    loop_task = asyncio.create_task(scheduler.run())
    try:
        kept = await scheduler.submit([ids(8, 4)])
        assert vectors(kept)[0, 0] == 8
        assert ran == [(Shape(1, 16), 1)]
    finally:
        loop_task.cancel()


async def test_a_lone_request_does_not_wait_for_company() -> None:
    scheduler, ran = make_scheduler(max_wait_s=5.0)
    scheduler.more_coming = lambda: False  # nothing else is being tokenized
    loop_task = asyncio.create_task(scheduler.run())
    try:
        result = await asyncio.wait_for(scheduler.submit([ids(3, 4)]), timeout=2.0)
        assert vectors(result)[0, 0] == 3 and ran == [(Shape(1, 16), 1)]
    finally:
        loop_task.cancel()


def overlapping(spans: list[tuple[int, float, float]]) -> bool:
    ordered = sorted(spans, key=lambda span: span[1])
    return any(later[1] < earlier[2] for earlier, later in itertools.pairwise(ordered))


async def test_two_workers_run_two_batches_at_once_and_one_worker_runs_them_in_turn() -> None:
    for workers in (2, 1):
        scheduler, ran = make_scheduler(workers=workers, seconds=0.1)
        loop_task = asyncio.create_task(scheduler.run())
        try:
            # Four requests of four 8-token inputs: four full 4x16 batches.
            requests = [[ids(10 * r + i, 8) for i in range(4)] for r in range(4)]
            results = await asyncio.gather(*(scheduler.submit(inputs) for inputs in requests))
            for r, result in enumerate(results):
                assert vectors(result)[:, 0].tolist() == [10 * r + i for i in range(4)]
            spans = scheduler.spans  # type: ignore[attr-defined]
            assert ran == [(Shape(4, 16), 4)] * 4
            assert {worker for worker, _start, _end in spans} == set(range(workers))
            assert overlapping(spans) == (workers == 2)
            assert scheduler.idle
        finally:
            loop_task.cancel()


@pytest.mark.parametrize("share_load", [False, True])
async def test_a_worker_that_frees_beside_a_busy_one_takes_its_fair_share(share_load) -> None:
    """One input runs on worker 0 (held there); 18 single-input requests queue. Without
    share_load worker 1 takes all it can hold (16) and leaves the rest in a batch of two; with
    it, worker 1 takes half of what is queued and running (10 of 19), and when worker 0 frees
    it takes the other 8: two batches of near equal size, side by side, instead of one worker
    running the crumbs. The packed pass on a CPU runs real rows only, so halves cost half."""
    plan = plan_warmup([1, 8, 16], [16], 1024, 16).shapes
    policy = ShapePolicy.build([16], 16, 1024, False, plan)
    releases = [asyncio.Event(), asyncio.Event()]
    started = [asyncio.Event() for _ in range(3)]  # the first three batches began
    ran: list[tuple[int, int]] = []  # (worker, inputs)

    async def execute(batch, shape, worker, *, solo, pooled):
        ran.append((worker, len(batch)))
        if len(ran) <= len(started):
            started[len(ran) - 1].set()
        if len(ran) <= 2:
            await releases[len(ran) - 1].wait()  # the first two batches run until released
        return BatchResult(np.zeros((len(batch), 3), np.float32), 0.001, first_time=False)

    scheduler = Scheduler(
        policy, execute, Metrics(), 0.0, max_queued_inputs=64, workers=2, share_load=share_load
    )
    loop_task = asyncio.create_task(scheduler.run())
    try:
        first = asyncio.create_task(scheduler.submit([ids(1, 8)]))
        await started[0].wait()
        rest = [asyncio.create_task(scheduler.submit([ids(2 + i, 8)])) for i in range(18)]
        await started[1].wait()
        releases[0].set()  # worker 0 frees while worker 1 still runs its batch
        await started[2].wait()
        releases[1].set()
        await asyncio.gather(first, *rest)
    finally:
        loop_task.cancel()
    sizes = [inputs for _worker, inputs in ran]
    assert sizes == ([1, 10, 8] if share_load else [1, 16, 2]), ran
    assert {worker for worker, _inputs in ran[:2]} == {0, 1}


async def test_a_lone_small_batch_runs_solo_and_nothing_starts_beside_it() -> None:
    """A solo batch gets every worker's cores (the engine's threads); under load the workers
    run side by side again, and a batch that arrives during a solo one waits for it."""
    scheduler, ran = make_scheduler(workers=2, seconds=0.1)
    scheduler.more_coming = lambda: False
    scheduler.solo = lambda shape: shape.tokens <= 16  # 1x16 may run solo, 4x16 may not
    loop_task = asyncio.create_task(scheduler.run())
    try:
        # One lone input: solo.
        await scheduler.submit([ids(1, 8)])
        # A lone input, then another while it runs: the second waits for the solo one.
        first = asyncio.create_task(scheduler.submit([ids(2, 8)]))
        await asyncio.sleep(0.03)
        second = asyncio.create_task(scheduler.submit([ids(3, 8)]))
        await asyncio.gather(first, second)

        # A batch of a shape that may not run solo, and a lone input while it runs: the
        # lone one runs beside it on the other worker, not solo.
        async def lone_later() -> None:
            await asyncio.sleep(0.03)
            await scheduler.submit([ids(9, 8)])

        await asyncio.gather(scheduler.submit([ids(4, 8) for _ in range(4)]), lone_later())
        solos = scheduler.solos  # type: ignore[attr-defined]
        spans = scheduler.spans  # type: ignore[attr-defined]
        assert ran == [(Shape(1, 16), 1)] * 3 + [(Shape(4, 16), 4), (Shape(1, 16), 1)]
        # The input that arrived during a solo batch waited for it, then ran solo itself.
        assert solos == [True, True, True, False, False]
        assert not overlapping(spans[:3]) and overlapping(spans[3:])
        # After the side-by-side pair (worker 1's batch ending last or not), solo runs on
        # worker 0, the one the warmup ran solo.
        await scheduler.submit([ids(10, 8)])
        assert solos[-1] and spans[-1][0] == 0
        assert [worker for worker, _start, _end in spans[:3]] == [0, 0, 0]
        assert scheduler.idle
    finally:
        loop_task.cancel()


async def test_per_token_requests_share_the_batcher_but_never_a_batch_with_pooled_ones() -> None:
    """/embed_all's requests queue beside pooled ones and run in planned shapes; a batch holds
    one kind only (its forward pass pools or it does not), and each request gets its own
    outputs back in order: a vector per input, or per input one row per token."""
    scheduler, ran = make_scheduler(max_wait_s=0.02)
    loop_task = asyncio.create_task(scheduler.run())
    try:
        pooled_first, states, pooled_second = await asyncio.gather(
            scheduler.submit([ids(1, 8), ids(2, 8)]),
            scheduler.submit([ids(3, 5), ids(4, 20)], pooled=False),
            scheduler.submit([ids(5, 8)]),
        )
        assert vectors(pooled_first)[:, 0].tolist() == [1, 2]
        assert vectors(pooled_second)[:, 0].tolist() == [5]
        assert [output.shape for output in states.outputs] == [(5, 2), (20, 2)]
        assert states.outputs[0][:, 0].tolist() == [3] * 5
        assert states.outputs[1][:, 1].tolist() == list(range(20))
        kinds = scheduler.kinds  # type: ignore[attr-defined]
        inputs_by_kind: Counter[bool] = Counter()
        for (_shape, count), pooled in zip(ran, kinds, strict=True):
            inputs_by_kind[pooled] += count
        assert inputs_by_kind == {True: 3, False: 2}
        assert {shape for shape, _count in ran} <= set(scheduler.policy.planned)
        # Per-token batches are served shapes like any other (the profile, the batch metrics).
        assert sum(entry["count"] for entry in scheduler.profile()["shapes"]) == len(ran)
        assert scheduler.idle
    finally:
        loop_task.cancel()


@pytest.mark.parametrize("pooled", [True, False])
async def test_one_queue_bound_for_both_kinds(pooled: bool) -> None:
    scheduler, ran = make_scheduler()  # holds 64 inputs; no batcher runs, so they stay queued
    queued = asyncio.create_task(scheduler.submit([ids(1, 4)] * 60, pooled=not pooled))
    await asyncio.sleep(0)
    with pytest.raises(QueueFull):
        await scheduler.submit([ids(2, 4)] * 5, pooled=pooled)
    assert scheduler.depth == 60 and not ran
    queued.cancel()


@pytest.mark.parametrize("pooled", [True, False])
@pytest.mark.parametrize("failure", ["raised", "hung"])
async def test_a_failed_or_hung_batch_fails_its_requests_and_counts_a_fault(
    pooled: bool, failure: str
) -> None:
    """Pooled or per-token, a forward pass that raises or runs past the forward timeout fails
    its requests with a ModelFault, is counted, and is reported; the next batch runs."""
    scheduler, _ran = make_scheduler()
    scheduler.forward_timeout_s = 0.05
    faults: list[tuple[str, bool]] = []
    scheduler.on_fault = lambda error, hung: faults.append((error, hung))
    working = scheduler.execute
    calls = 0

    async def failing_once(batch, shape, worker, *, solo: bool, pooled: bool) -> BatchResult:
        nonlocal calls
        calls += 1
        if calls == 1 and failure == "raised":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        if calls == 1:
            await asyncio.sleep(0.3)
        return await working(batch, shape, worker, solo=solo, pooled=pooled)

    scheduler.execute = failing_once
    loop_task = asyncio.create_task(scheduler.run())
    try:
        with pytest.raises(ModelFault) as raised:
            await scheduler.submit([ids(1, 4)], pooled=pooled)
        assert raised.value.hung is (failure == "hung")
        assert [hung for _error, hung in faults] == [failure == "hung"]
        exposition = scheduler.metrics.render().decode()
        assert f'warmgate_model_faults_total{{kind="{failure}"}} 1.0' in exposition
        served = await scheduler.submit([ids(2, 4)], pooled=pooled)
        assert len(served.outputs) == 1 and calls == 2
    finally:
        loop_task.cancel()
