"""core: the model workers. Each has a thread of its own, where the forward passes of its
batches and of the warmup run (never on the event loop); all share one runner, its weights and
its CUDA graphs. Also how forward passes run, as /ready and /info report it
(`forward_report`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from warmgate_contract.shapes import Shape

from .config import ServerConfig
from .errors import ModelLoadError
from .loading import LoadedModel
from .memory import Probe
from .runner import BatchResult, ModelRunner

T = TypeVar("T")
SOLO_TOKENS = 1024
"""The largest shape (rows x sequence length) that runs solo: single requests and small
batches, whose latency a person waits for; bigger ones are throughput, where the workers side by
side do as well, and settling them solo too would lengthen the warmup."""


class Workers:
    def __init__(
        self,
        config: ServerConfig,
        loaded: LoadedModel,
        runner: ModelRunner,
        threads: Sequence[ThreadPoolExecutor],
        solo_threads: int = 0,
    ) -> None:
        """`solo_threads`: the torch threads of a batch that runs solo, on every worker's
        cores (0: none does; cpus.ThreadPlan.solo_threads)."""
        self.runner = runner
        self._threads = tuple(threads)
        self._solo_threads = solo_threads
        self._backend = config.backend
        self._compile_cache = config.compile_cache
        self.graphs_mode, self.graphs_reason = self._plan_graphs(config, loaded)
        """Whether the planned shapes run as CUDA graphs ("on"/"off") and why not when off."""

    @property
    def count(self) -> int:
        return len(self._threads)

    @property
    def solo_threads(self) -> int:
        """The torch threads of a batch that runs solo (0: none does)."""
        return self._solo_threads

    def runs_solo(self, shape: Shape) -> bool:
        """Small shapes run solo when they are all there is to do (the latency of a lone
        request: about half on two cores); the warmup settles them that way too."""
        return self._solo_threads > 0 and shape.tokens <= SOLO_TOKENS

    async def run(self, function: Callable[..., T], *args: object, worker: int = 0) -> T:
        """`function(*args)` in `worker`'s thread."""
        executor = self._threads[worker]
        return await asyncio.get_running_loop().run_in_executor(executor, function, *args)

    async def execute(
        self,
        batch: list[Sequence[int]],
        shape: Shape,
        worker: int,
        *,
        solo: bool = False,
        pooled: bool = True,
        layers: int | None = None,
    ) -> BatchResult:
        """One batch's forward pass on `worker` (scheduler.Execute); `layers`: warmup's
        shortened pass (ModelRunner.execute)."""
        threads = self._solo_threads if solo else None
        runner = self.runner
        return await self.run(
            runner.execute, batch, shape, worker, pooled, threads, layers, worker=worker
        )

    def _plan_graphs(self, config: ServerConfig, loaded: LoadedModel) -> tuple[str, str]:
        if config.cuda_graphs == "off":
            return "off", "--cuda-graphs off"
        if loaded.device.type != "cuda":
            if config.cuda_graphs == "on":
                raise ModelLoadError(f"--cuda-graphs on: the device is {loaded.device}, not CUDA")
            return "off", f"the device is {loaded.device}"
        if not config.warmup:
            return "off", "--no-warmup: graphs are captured during warmup"
        if self.runner.multi is not None:
            return "off", "the model's sparse (and ColBERT) heads read every token's state"
        static_forward = self.runner.backend.static_forward()
        if static_forward is None:
            return "off", f"the {self.runner.backend.name} pass has no static forward to capture"
        from .backends.graphs import GraphSet

        self.runner.graphs = GraphSet(
            static_forward, loaded.device, loaded.pad_token_id, loaded.cls_token_id
        )
        return "on", ""

    def drop_graphs(self, reason: str) -> None:
        """Serve every shape eagerly from now on (a capture failed with --cuda-graphs auto)."""
        if self.runner.graphs is not None:
            self.runner.graphs.clear()
        self.runner.graphs = None
        self.graphs_mode, self.graphs_reason = "off", reason

    async def export_onnx(self, memory: Probe) -> None:
        """--backend onnxruntime, before any forward pass (the warmup's first step, or before
        /ready without a warmup): the model exported and opened in ONNX Runtime, a session for
        the workers' threads and one for solo batches', unless the export's peak would pass
        the memory limit (MemoryExceeded, before it starts). Does nothing otherwise."""
        if self._backend != "onnxruntime":
            return
        from .backends.ort_export import check_export_fits
        from .source import weights_bytes

        def check() -> None:  # on a cache hit there is no export, and no export peak
            check_export_fits(weights_bytes(self.runner.loaded.path), memory)

        cache = Path(self._compile_cache) if self._compile_cache else None
        await self.run(self.runner.export_onnx, self._solo_threads, cache, check)

    def forward_report(self) -> dict[str, object]:
        """How forward passes run: warmgate's own pass (packed) or the model's (padded), the
        attention it uses, the CUDA graphs (on or off, why off, and what they hold), and what
        the backend adds (its linear kernels, its ONNX Runtime sessions)."""
        backend = self.runner.backend
        graphs: dict[str, object] = {"mode": self.graphs_mode, "reason": self.graphs_reason}
        if self.runner.graphs is not None:
            graphs.update(self.runner.graphs.stats.as_json())
        return {
            "pass": backend.name,
            "backend": self._backend,
            "attention": backend.attention,
            "cuda_graphs": graphs,
            **backend.details(),
        }
