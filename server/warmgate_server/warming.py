"""Warmup: every planned shape through the serving path (Workers.execute) on every model worker,
side by side as under load, as the device's rule says (settle.py: on a CPU once cold and once
timed; on a GPU until its latency settles); CUDA graphs are captured first, and oneDNN's kernels
for the row counts no planned shape reaches are made (linear.warm). Shapes go from the smallest
up, each one's memory need measured, and none starts whose predicted need is past the budget
(memory_prediction.py): with --memory-policy refuse the warmup fails there, naming the shape, its
prediction, the limit and what to change; with fit the plan is cut there and the batcher is
told. What it measured goes to the lifecycle (/ready) and the metrics."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from warmgate_contract.report import (
    MEMORY_MARGIN,
    WARMING,
    MemoryReport,
    PlanCut,
    ShapeMemory,
    WarmedShape,
)
from warmgate_contract.shapes import Shape

from .errors import MemoryExceeded, ModelLoadError
from .lifecycle import Lifecycle
from .memory import Probe
from .memory_prediction import ACTIVATION_FACTOR, PassModel, predict, warm_order
from .metrics import Metrics
from .pacing import CpuPacer
from .settle import SettleRule, should_stop, steady_seconds
from .workers import Workers

LONG_PASS_SECONDS = 0.5
"""On a CPU every shape but the first warms with the packed pass's first layer only
(Warmup._layers_for), and one whose whole pass is predicted to take longer than this runs it
once, cold, its steady time that run's scaled to every layer (an upper bound); a shorter one runs
it twice, the second timed. On 2 cores an XLM-R of multilingual-e5-base's shape takes about 30 s
for a pass of 32 x 256, twice per worker, which was most of its time to /ready; after one layer
a worker, every shape's first request was within 1.10 of its steady time, 32 x 256 included
(docs/benchmarks.md, make bench-warm)."""


def _gib(size: int | None) -> str:
    return "?" if size is None else f"{size / 2**30:.2f} GiB"


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Warmup:
    workers: Workers
    plan: tuple[Shape, ...]
    metrics: Metrics
    memory: Probe
    memory_policy: str = "refuse"
    graphs_required: bool = False
    """--cuda-graphs on: a capture that fails fails the warmup (auto: every shape is served
    eagerly instead)."""
    pacer: CpuPacer = field(default_factory=lambda: CpuPacer(0))
    """Holds the warmup's passes to the pod's CPU share (--warmup-cpus; on a CPU only)."""

    async def run(self, lifecycle: Lifecycle, rule: SettleRule) -> None:
        """A shape counts as warm once all workers have settled it, and its steady latency is
        the slowest worker's. Stops early when the phase leaves warming (draining, failed).
        Raises MemoryExceeded when a shape would not fit and the policy is refuse; with fit,
        `lifecycle.memory.cut` says what was left out."""
        probe = self.memory
        started = time.perf_counter()
        await self.workers.export_onnx(probe)
        limit = probe.limit()
        loaded = probe.current()
        counted_file = probe.working_file
        report = MemoryReport(
            probe.device, probe.measure, limit.bytes, limit.source, self.memory_policy,
            loaded, loaded,
        )  # fmt: skip
        budget = report.budget_bytes
        lifecycle.memory = report
        await self._capture_graphs(lifecycle)
        await self._warm_kernels()
        order = warm_order(self.plan)
        model = self._pass_model()
        measured: list[tuple[Shape, int]] = []
        for position, shape in enumerate(order):
            if lifecycle.phase != WARMING:
                return
            predicted = predict(measured, shape, model)
            stop = None
            if budget is not None and loaded > budget:
                stop = f"the loaded model alone took {_gib(loaded)}, above the budget"
            elif budget is not None and predicted is not None and predicted > budget:
                largest = max(measured, key=lambda item: item[1], default=None)
                grown = predicted - (largest[1] if largest else 0)
                stop = (
                    f"shape {shape.key} would need about {_gib(predicted)} (the "
                    f"{_gib(largest[1] if largest else None)} measured at "
                    f"{largest[0].key if largest else '?'} plus {_gib(grown)}: "
                    f"{ACTIVATION_FACTOR:g}x the growth of its pass's activations, "
                    f"{_gib(model.activation_bytes(shape))} in all, and the allocator's steps), "
                    "above the budget"
                )
            else:
                probe.reset_peak()
                layers = self._layers_for(shape, lifecycle)
                peak = await self._warm_shape(lifecycle, shape, rule, layers)
                if peak is None:
                    stop = f"shape {shape.key} ran out of device memory"
                else:
                    measured.append((shape, peak))
                    working_file = probe.working_file if probe.device == "cpu" else None
                    report = replace(
                        report,
                        loaded_bytes=loaded + probe.working_file - counted_file,
                        peak_bytes=max(report.peak_bytes, peak),
                        shapes=(*report.shapes, ShapeMemory(shape, peak, predicted)),
                        working_file_bytes=working_file,
                    )
                    lifecycle.memory = report
                    self.metrics.warmup_shape_peak.labels(shape=shape.key).set(peak)
                    if budget is not None and peak > budget:
                        stop = f"shape {shape.key} reached {_gib(peak)}, above the budget"
            if stop is not None:
                why = self._advice(stop, shape, max(predicted or 0, report.peak_bytes), report)
                left_out = order[position:]
                # A bucket none of whose shapes fits cannot be served by a smaller plan.
                lost = {cut.seq_len for cut in left_out} - {
                    done.seq_len for done in order[:position]
                }
                if self.memory_policy != "fit":
                    raise MemoryExceeded(why)
                if lost:
                    raise MemoryExceeded(
                        f"{why} (a cut plan cannot serve an input of {max(lost)} tokens: not even "
                        f"one fits; lower warmup.sequenceBuckets or model.maxInputLength)"
                    )
                lifecycle.memory = report = self._cut(report, left_out, why)
                for cut in left_out:
                    lifecycle.warmed.pop(cut, None)
                log.warning("plan cut: %s", why)
                break
        usage, container_peak = probe.container()
        report = replace(
            report,
            container_usage_bytes=usage,
            container_peak_bytes=container_peak,
            device_details=probe.device_details(),
        )
        lifecycle.memory = report
        lifecycle.warmup_seconds = time.perf_counter() - started
        if self.pacer.cpus > 0:
            pacer = self.pacer
            log.info(
                "warmup paced to %g CPUs while the node was busy (%.1fs of %.1fs; its other "
                "processes used %.2f CPUs on average): %.1fs spent waiting",
                pacer.cpus,
                pacer.busy_seconds,
                lifecycle.warmup_seconds,
                pacer.others_cpus,
                pacer.waited_seconds,
            )
        self.metrics.warmup_duration.set(lifecycle.warmup_seconds)
        self._export(report)

    def _layers_for(self, shape: Shape, lifecycle: Lifecycle) -> int | None:
        """How many of the packed pass's layers warm `shape`: on a CPU, one for every shape
        but the first (the plan's smallest, which the warm gate times: whole passes), else all
        (None). Every layer runs the same kernels on the same shapes, and its activations are
        every layer's: one layer pays the shape's first-time costs (its allocator growth and
        attention at its length; oneDNN's kernels per row count are made apart, and the thread
        teams' first use by the first shape) and reaches the memory need of them all."""
        runner = self.workers.runner
        count = runner.layer_count
        if count is None or count < 2 or runner.loaded.device.type != "cpu":
            return None
        return 1 if lifecycle.warmed else None

    def _long(self, shape: Shape, lifecycle: Lifecycle) -> bool:
        """Whether a whole pass of `shape` is predicted to take more than LONG_PASS_SECONDS:
        the largest warmed shape's steady time, scaled by the tokens."""
        done = max(lifecycle.warmed.values(), key=lambda item: item.shape.tokens, default=None)
        if done is None:
            return False
        return done.steady_ms / 1000.0 * shape.tokens / done.shape.tokens > LONG_PASS_SECONDS

    async def _warm_shape(
        self, lifecycle: Lifecycle, shape: Shape, rule: SettleRule, layers: int | None = None
    ) -> int | None:
        """Settle `shape` on every worker (`layers`: the first layers of the packed pass only,
        once: its steady latency is then that run's scaled to every layer, an upper bound);
        its memory peak, or None when the device ran out of memory (a GPU: an allocation
        raises; a CPU past its limit is killed instead)."""
        workers = self.workers
        batches = await workers.run(workers.runner.warmup_inputs, shape)
        if layers is not None and self._long(shape, lifecycle):
            # The cold run warms; a second would only time it, and the mixed-length batch runs
            # the same kernels at about as many rows (its first request was within 1.10 of
            # steady without it: docs/benchmarks.md).
            rule = replace(rule, max_runs=1)
            batches = batches[:1]
        shape_started = time.perf_counter()
        tasks = [
            asyncio.create_task(self._settle(shape, batches, worker, rule, layers=layers))
            for worker in range(workers.count)
        ]
        try:
            runs = await asyncio.gather(*tasks)
            if workers.runs_solo(shape):  # and alone, on every worker's cores
                runs.append(await self._settle(shape, batches, 0, rule, True, layers))
        except BaseException as error:  # one worker failed: stop the others too
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if _out_of_memory(error):
                await workers.run(workers.runner.release_memory)
                return None
            raise
        steady = max(steady_seconds(seconds, rule) for seconds in runs)
        if layers is not None:
            steady *= (workers.runner.layer_count or layers) / layers
        spent = time.perf_counter() - shape_started
        count = sum(map(len, runs))
        lifecycle.warmed[shape] = WarmedShape(shape, steady * 1000.0, count, spent)
        self.metrics.warmup_shape_duration.labels(shape=shape.key).set(spent)
        self.metrics.warmup_shape_steady.labels(shape=shape.key).set(steady)
        log.info(
            "warmed %s: first %.1f ms, steady %.1f ms after %d runs on %d workers%s",
            shape.key,
            max(seconds[0] for seconds in runs) * 1000.0,
            steady * 1000.0,
            count,
            workers.count,
            "" if layers is None else f" ({layers} layer a run; steady scaled to every layer)",
        )
        return self.memory.peak()

    def _pass_model(self) -> PassModel:
        loaded = self.workers.runner.loaded
        return PassModel.of_folder(
            loaded.path, loaded.dtype.itemsize, self.workers.count, loaded.hidden_size
        )

    def _advice(self, stop: str, shape: Shape, need: int, report: MemoryReport) -> str:
        """Why the warmup stopped at `shape`, the numbers, and the fields that change it."""
        warmed = [item.shape for item in report.shapes if item.shape != shape]
        fits = max((item.tokens for item in warmed), default=0)
        advice = [
            f"lower batching.maxBatchTokens (to {fits} or less) or warmup.batchSizes"
            if fits
            else "lower warmup.sequenceBuckets or model.maxInputLength",
            "raise resources.limits.memory (to at least "
            f"{_gib(int(need / (1 - MEMORY_MARGIN)) + 1)})"
            if report.device == "cpu"
            else f"use a GPU of more than its {_gib(report.limit_bytes)} (nodeSelector)",
        ]
        if self.memory_policy != "fit":
            advice.append("or set warmup.memoryPolicy: fit to serve the shapes that fit")
        return (
            f"{stop} of {_gib(report.budget_bytes)}: the limit is {_gib(report.limit_bytes)} "
            f"({report.limit_source}) less {MEMORY_MARGIN:.0%}; the model took "
            f"{_gib(report.loaded_bytes)} loaded, the warmup up to {_gib(report.peak_bytes)}. "
            "To change it: " + ", ".join(advice)
        )

    def _cut(self, report: MemoryReport, left_out: list[Shape], why: str) -> MemoryReport:
        kept = [item.shape for item in report.shapes if item.shape not in left_out]
        tokens = max((shape.tokens for shape in kept), default=0)
        shapes = tuple(item for item in report.shapes if item.shape not in left_out)
        return replace(report, shapes=shapes, cut=PlanCut(tokens, tuple(sorted(left_out)), why))

    def _export(self, report: MemoryReport | None) -> None:
        if report is None:
            return
        self.metrics.memory_peak.set(report.peak_bytes)
        if report.limit_bytes is not None:
            self.metrics.memory_limit.set(report.limit_bytes)
            self.metrics.memory_headroom.set(report.limit_bytes - report.peak_bytes)

    async def _warm_kernels(self) -> None:
        """The kernels a planned shape does not reach: oneDNN's primitives for every row
        count a batch can bring (ModelRunner.warm_kernels), on every worker and on a solo
        batch's threads."""
        workers = self.workers
        started = time.perf_counter()
        await self.pacer.admit()
        runs = [
            workers.run(workers.runner.warm_kernels, None, worker=worker)
            for worker in range(workers.count)
        ]
        counts = await asyncio.gather(*runs)
        if workers.solo_threads:
            await self.pacer.admit()
            counts.append(await workers.run(workers.runner.warm_kernels, workers.solo_threads))
        if any(counts):
            log.info(
                "made oneDNN's kernels for %d row counts on %d thread teams in %.2fs",
                max(counts),
                len(counts),
                time.perf_counter() - started,
            )

    async def _capture_graphs(self, lifecycle: Lifecycle) -> None:
        """Capture every planned shape's graph on every worker, before any shape is settled,
        so that the settled latencies are the graphs' and a capture that fails (with
        --cuda-graphs auto) leaves every shape to the eager pass, none half-warmed."""
        workers = self.workers
        graphs = workers.runner.graphs
        if graphs is None:
            return
        from .backends.graphs import GraphCaptureError

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
        batches: list[list[Sequence[int]]],
        worker: int,
        rule: SettleRule,
        solo: bool = False,
        layers: int | None = None,
    ) -> list[float]:
        """Run `shape`'s first batch (every input full: the shape's memory peak and its
        steady latency) until its latency settles, then each other batch of the warmup's
        once (another route through the same shape, not timed)."""
        seconds: list[float] = []
        while not should_stop(seconds, rule):
            await self.pacer.admit()
            result = await self.workers.execute(batches[0], shape, worker, solo=solo, layers=layers)
            seconds.append(result.seconds)
        for inputs in batches[1:]:
            await self.pacer.admit()
            await self.workers.execute(inputs, shape, worker, solo=solo, layers=layers)
        return seconds


def _out_of_memory(error: BaseException) -> bool:
    """A CUDA allocation past the device's memory (torch.cuda.OutOfMemoryError)."""
    return type(error).__name__ == "OutOfMemoryError"
