"""Warmup: every planned shape through the serving path (Workers.execute) on every model worker,
side by side as under load, until its latency settles (warmup.py's rule); CUDA graphs are
captured first. What it measured goes to the lifecycle (/ready) and the metrics."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from warmgate_contract.report import WARMING, WarmedShape
from warmgate_contract.shapes import Shape

from .errors import ModelLoadError
from .lifecycle import Lifecycle
from .metrics import Metrics
from .warmup import SettleRule, should_stop, steady_seconds
from .workers import Workers

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Warmup:
    workers: Workers
    plan: tuple[Shape, ...]
    metrics: Metrics
    graphs_required: bool = False
    """--cuda-graphs on: a capture that fails fails the warmup (auto: every shape is served
    eagerly instead)."""

    async def run(self, lifecycle: Lifecycle, rule: SettleRule) -> None:
        """A shape counts as warm once all workers have settled it, and its steady latency is
        the slowest worker's. Stops early when the phase leaves warming (draining, failed)."""
        workers = self.workers
        started = time.perf_counter()
        await self._capture_graphs(lifecycle)
        for shape in self.plan:
            if lifecycle.phase != WARMING:
                return
            inputs = await workers.run(workers.runner.warmup_inputs, shape)
            shape_started = time.perf_counter()
            tasks = [
                asyncio.create_task(self._settle(shape, inputs, worker, rule))
                for worker in range(workers.count)
            ]
            try:
                runs = await asyncio.gather(*tasks)
            except BaseException:  # one worker failed (out of memory...): stop the others too
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
            if workers.runs_solo(shape):  # and alone, on every worker's cores
                runs.append(await self._settle(shape, inputs, 0, rule, solo=True))
            steady = max(steady_seconds(seconds, rule) for seconds in runs)
            spent = time.perf_counter() - shape_started
            count = sum(map(len, runs))
            lifecycle.warmed[shape] = WarmedShape(shape, steady * 1000.0, count, spent)
            self.metrics.warmup_shape_duration.labels(shape=shape.key).set(spent)
            self.metrics.warmup_shape_steady.labels(shape=shape.key).set(steady)
            log.info(
                "warmed %s: first %.1f ms, steady %.1f ms after %d runs on %d workers",
                shape.key,
                max(seconds[0] for seconds in runs) * 1000.0,
                steady * 1000.0,
                count,
                workers.count,
            )
        lifecycle.warmup_seconds = time.perf_counter() - started
        self.metrics.warmup_duration.set(lifecycle.warmup_seconds)

    async def _capture_graphs(self, lifecycle: Lifecycle) -> None:
        """Capture every planned shape's graph on every worker, before any shape is settled,
        so that the settled latencies are the graphs' and a capture that fails (with
        --cuda-graphs auto) leaves every shape to the eager pass, none half-warmed."""
        workers = self.workers
        graphs = workers.runner.graphs
        if graphs is None:
            return
        from .graphs import GraphCaptureError

        try:
            for shape in self.plan:
                if lifecycle.phase != WARMING:
                    return
                for worker in range(workers.count):
                    await workers.run(workers.runner.capture, shape, worker, worker=worker)
        except GraphCaptureError as error:
            if self.graphs_required:
                raise ModelLoadError(f"--cuda-graphs on: {error}") from None
            log.warning("serving eagerly, without CUDA graphs: %s", error)
            workers.drop_graphs(str(error))
            return
        stats = graphs.stats
        self.metrics.cuda_graph_memory.set(stats.memory_bytes)
        log.info(
            "captured %d CUDA graphs in %.1fs, holding %.1f MiB",
            stats.captured,
            stats.capture_seconds,
            stats.memory_bytes / 2**20,
        )

    async def _settle(
        self,
        shape: Shape,
        inputs: list[Sequence[int]],
        worker: int,
        rule: SettleRule,
        solo: bool = False,
    ) -> list[float]:
        seconds: list[float] = []
        while not should_stop(seconds, rule):
            result = await self.workers.execute(inputs, shape, worker, solo=solo)
            seconds.append(result.seconds)
        return seconds
