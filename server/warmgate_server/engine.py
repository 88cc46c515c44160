"""The serving engine: the runner behind its threads, the batcher, warmup. The HTTP layer calls
`embed`; nothing here knows HTTP."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from warmgate_contract.report import WARMING
from warmgate_contract.shapes import Shape

from . import modelconfig
from .config import ServerConfig
from .errors import ModelLoadError
from .lifecycle import Lifecycle, WarmedShape
from .loading import LoadedModel
from .metrics import Metrics
from .runner import BatchResult, ModelRunner
from .scheduler import Embedded, Scheduler, StageTimes
from .shapes import ShapePolicy
from .warmup import SettleRule, should_stop, steady_seconds

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Embeddings:
    vectors: np.ndarray
    prompt_tokens: int
    cold: bool
    timing: StageTimes = field(default_factory=StageTimes)


def finish_vectors(vectors: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
    """Keep the first `dimensions` components (Matryoshka-style), then L2-normalise if asked."""
    if dimensions is not None:
        vectors = vectors[:, :dimensions]
    if normalize:
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        vectors = vectors / np.maximum(norms, 1e-12)
    return vectors


class Engine:
    def __init__(
        self,
        config: ServerConfig,
        loaded: LoadedModel,
        plan: Sequence[Shape],
        metrics: Metrics,
        model_threads: Sequence[ThreadPoolExecutor],
        tokenizer_thread: ThreadPoolExecutor,
    ) -> None:
        max_input_length = min(
            config.max_input_length or loaded.model_max_length, config.largest_bucket
        )
        positions = loaded.max_positions
        if positions is not None and max_input_length > positions:
            raise ModelLoadError(
                f"--max-input-length {max_input_length} is above this model's "
                f"{positions} positions: lower --max-input-length (and the buckets above it)"
            )
        try:
            self.settings = modelconfig.resolve(config, loaded.path)
        except modelconfig.ModelConfigError as error:
            raise ModelLoadError(str(error)) from None
        self.config = config
        self.loaded = loaded
        self.plan = tuple(plan)
        self.runner = ModelRunner(
            loaded,
            self.settings.pooling,
            max_input_length,
            packed=config.packing != "off",
            prompt=self.settings.default_prompt,
        )
        self.metrics = metrics
        self._model_threads = tuple(model_threads)
        self._tokenizer_thread = tokenizer_thread
        policy = ShapePolicy.build(
            config.sequence_buckets,
            config.max_batch_size,
            config.max_batch_tokens,
            config.pad_batch,
            self.plan,
        )
        self.scheduler = Scheduler(
            policy=policy,
            execute=self._execute,
            metrics=metrics,
            max_wait_s=config.max_wait_ms / 1000.0,
            max_queued_inputs=max(
                config.max_concurrent_requests * config.max_batch_size,
                2 * config.max_client_batch_size,
            ),
            workers=len(self._model_threads),
            more_coming=lambda: self._tokenizing > 0,
        )
        self._tokenizing = 0

    @property
    def hidden_size(self) -> int:
        return self.loaded.hidden_size

    @property
    def max_input_length(self) -> int:
        return self.runner.max_input_length

    @property
    def workers(self) -> int:
        return len(self._model_threads)

    @property
    def packed(self) -> bool:
        """Whether the padding-free forward pass runs."""
        return self.runner.packed is not None

    def profile(self) -> dict[str, list[dict[str, int]]]:
        """The shapes served so far, with counts (the warmup profile format)."""
        return self.scheduler.profile()

    async def _in_model_thread(
        self, function: Callable[..., T], *args: object, worker: int = 0
    ) -> T:
        executor = self._model_threads[worker]
        return await asyncio.get_running_loop().run_in_executor(executor, function, *args)

    async def _execute(
        self, batch: list[Sequence[int]], shape: Shape, worker: int = 0
    ) -> BatchResult:
        return await self._in_model_thread(self.runner.execute, batch, shape, worker, worker=worker)

    async def embed(
        self,
        texts: Sequence[str | Sequence[int]],
        truncate: bool = False,
        truncate_left: bool = False,
        record: bool = True,
    ) -> Embeddings:
        """Tokenize (tokenizer thread), batch, run (model thread). Raises InputTooLong."""
        loop = asyncio.get_running_loop()
        self._tokenizing += 1
        started = time.monotonic()
        try:
            token_ids = await loop.run_in_executor(
                self._tokenizer_thread, self.runner.tokenize, texts, truncate, truncate_left
            )
        finally:
            self._tokenizing -= 1
        tokenize_seconds = time.monotonic() - started
        if record:
            for ids in token_ids:
                self.metrics.input_tokens.observe(len(ids))
        embedded: Embedded = await self.scheduler.submit(token_ids, record=record)
        embedded.timing.tokenize = tokenize_seconds
        return Embeddings(
            embedded.vectors, sum(map(len, token_ids)), embedded.cold, embedded.timing
        )

    async def warm(self, lifecycle: Lifecycle, rule: SettleRule | None = None) -> None:
        """Run every planned shape through the serving path until its latency settles, on
        every model worker (side by side, as under load); a shape counts as warm once all
        workers have settled it, and its steady latency is the slowest worker's."""
        rule = rule or SettleRule()
        started = time.perf_counter()
        for shape in self.plan:
            if lifecycle.phase != WARMING:  # draining or failed: stop warming
                return
            inputs = await self._in_model_thread(self.runner.warmup_inputs, shape)
            shape_started = time.perf_counter()
            tasks = [
                asyncio.create_task(self._settle(shape, inputs, worker, rule))
                for worker in range(self.workers)
            ]
            try:
                runs = await asyncio.gather(*tasks)
            except BaseException:  # one worker failed (out of memory...): stop the others too
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
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
                self.workers,
            )
        lifecycle.warmup_seconds = time.perf_counter() - started
        self.metrics.warmup_duration.set(lifecycle.warmup_seconds)

    async def _settle(
        self, shape: Shape, inputs: list[Sequence[int]], worker: int, rule: SettleRule
    ) -> list[float]:
        seconds: list[float] = []
        while not should_stop(seconds, rule):
            result = await self._execute(inputs, shape, worker)
            seconds.append(result.seconds)
        return seconds
