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
from .faults import FaultInjector
from .lifecycle import Lifecycle, WarmedShape
from .loading import LoadedModel
from .metrics import Metrics
from .openai_ids import OpenAITokenIds
from .runner import BatchResult, ModelRunner
from .scheduler import Embedded, Scheduler, StageTimes
from .shapes import ShapePolicy, bucket_for
from .warmup import SettleRule, should_stop, steady_seconds

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Embeddings:
    vectors: np.ndarray
    prompt_tokens: int
    cold: bool
    timing: StageTimes = field(default_factory=StageTimes)


@dataclass(frozen=True)
class TokenStates:
    """/embed_all's result: per input, its tokens' last hidden states."""

    vectors: list[np.ndarray]
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
        *,
        on_fault: Callable[[str, bool], None] = lambda error, hung: None,
        on_success: Callable[[], None] = lambda: None,
        faults: FaultInjector | None = None,
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
        self.runner.faults = faults
        self.openai_ids = OpenAITokenIds.load(config.openai_token_ids)
        """Decodes OpenAI token ids (tiktoken's) into text; None: ids are the model's own."""
        self.metrics = metrics
        self._model_threads = tuple(model_threads)
        self._tokenizer_thread = tokenizer_thread
        self.policy = policy = ShapePolicy.build(
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
            forward_timeout_s=config.forward_timeout,
            on_fault=self._fault(on_fault),
            on_success=on_success,
        )
        self._tokenizing = 0

    def _fault(self, report: Callable[[str, bool], None]) -> Callable[[str, bool], None]:
        def counted(error: str, hung: bool) -> None:
            self.metrics.model_faults.labels(kind="hung" if hung else "raised").inc()
            report(error, hung)

        return counted

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
        openai_ids: bool = False,
    ) -> Embeddings:
        """Tokenize (tokenizer thread), batch, run (model thread). Raises InputTooLong, and
        InvalidTokenIds for `openai_ids` inputs (OpenAI's ids, with --openai-token-ids)."""
        loop = asyncio.get_running_loop()
        self._tokenizing += 1
        started = time.monotonic()
        try:
            token_ids = await loop.run_in_executor(
                self._tokenizer_thread, self._tokenize, texts, truncate, truncate_left, openai_ids
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

    def _tokenize(
        self,
        texts: Sequence[str | Sequence[int]],
        truncate: bool,
        truncate_left: bool,
        openai_ids: bool,
    ) -> list[list[int]]:
        """In the tokenizer thread: OpenAI's ids back to text when asked, then the model's."""
        if openai_ids and self.openai_ids is not None:
            texts = self.openai_ids.texts(texts)
        return self.runner.tokenize(texts, truncate, truncate_left)

    async def embed_all(
        self, texts: Sequence[str | Sequence[int]], truncate: bool, truncate_left: bool
    ) -> TokenStates:
        """Every token's last hidden state per input (TEI's /embed_all: no pooling), in
        request order, with the token count and whether a shape ran cold. Runs on model worker
        0 in planned shapes (inputs grouped by bucket), next to the batcher's batches."""
        loop = asyncio.get_running_loop()
        token_ids = await loop.run_in_executor(
            self._tokenizer_thread, self._tokenize, texts, truncate, truncate_left, False
        )
        order = sorted(
            range(len(token_ids)),
            key=lambda index: bucket_for(len(token_ids[index]), self.policy.buckets) or 0,
        )
        states: list[np.ndarray | None] = [None] * len(token_ids)
        cold = False
        position = 0
        while position < len(order):
            bucket = bucket_for(len(token_ids[order[position]]), self.policy.buckets)
            assert bucket is not None  # tokenize kept every input within the largest bucket
            members = []
            while (
                position < len(order)
                and len(members) < self.policy.capacity(bucket)
                and bucket_for(len(token_ids[order[position]]), self.policy.buckets) == bucket
            ):
                members.append(order[position])
                position += 1
            shape = self.policy.shape_for(len(members), bucket)
            batch = [token_ids[index] for index in members]
            result = await self._in_model_thread(self.runner.execute, batch, shape, 0, False)
            cold = cold or result.first_time
            start = 0
            for index in members:
                length = len(token_ids[index])
                states[index] = result.vectors[start : start + length]
                start += length
        found = [state for state in states if state is not None]
        return TokenStates(found, sum(map(len, token_ids)), cold)

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
