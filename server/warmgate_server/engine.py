"""The serving engine: the runner behind its threads, the batcher, warmup. The HTTP layer calls
`embed`; nothing here knows HTTP."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from warmgate_contract.report import WARMING, WarmedShape
from warmgate_contract.shapes import Shape

from . import modelconfig
from .config import ServerConfig
from .errors import ModelLoadError
from .faults import FaultInjector
from .lifecycle import Lifecycle
from .loading import LoadedModel
from .metrics import Metrics
from .openai_ids import OpenAITokenIds
from .runner import BatchResult, ModelRunner
from .scheduler import Embedded, Scheduler, StageTimes
from .shapes import ShapePolicy, bucket_for
from .warmup import SettleRule, should_stop, steady_seconds

if TYPE_CHECKING:
    from .head import Head

log = logging.getLogger(__name__)
T = TypeVar("T")
SOLO_TOKENS = 1024
"""The largest shape (rows x sequence length) that runs solo: single requests and small
batches, whose latency a person waits for; bigger ones are throughput, where the workers side by
side do as well, and settling them solo too would lengthen the warmup."""


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
        tokenizer_pool: ThreadPoolExecutor,
        *,
        on_fault: Callable[[str, bool], None] = lambda error, hung: None,
        on_success: Callable[[], None] = lambda: None,
        faults: FaultInjector | None = None,
        solo_threads: int = 0,
    ) -> None:
        """`solo_threads`: the torch threads of a batch that runs solo, on every worker's
        cores (0: none does; cpus.ThreadPlan.solo_threads)."""
        if config.max_input_length:
            max_input_length, length_source = config.max_input_length, "--max-input-length"
        else:
            max_input_length = loaded.model_max_length
            length_source = loaded.model_max_length_source
        if max_input_length > config.largest_bucket:
            max_input_length = config.largest_bucket
            length_source = "the largest of --sequence-buckets"
        positions = loaded.max_positions
        if positions is not None and max_input_length > positions:
            raise ModelLoadError(
                f"--max-input-length {max_input_length} is above this model's "
                f"{positions} positions: lower --max-input-length (and the buckets above it)"
            )
        try:
            settings = modelconfig.resolve(config, loaded.path, loaded.folder)
            head = self._head(settings, loaded)
        except modelconfig.ModelConfigError as error:
            raise ModelLoadError(str(error)) from None
        self.settings = replace(
            settings,
            max_input_length=max_input_length,
            chosen_by={**settings.chosen_by, "max_input_length": length_source},
        )
        self.config = config
        self.loaded = loaded
        self.plan = tuple(plan)
        self.runner = ModelRunner(
            loaded,
            head,
            max_input_length,
            packed=config.packing != "off",
            prompt=self.settings.default_prompt,
            include_prompt=self.settings.include_prompt,
            lowercase=self.settings.lowercase,
        )
        self.runner.faults = faults
        self.graphs_mode, self.graphs_reason = self._plan_graphs(config, loaded)
        """Whether the planned shapes run as CUDA graphs ("on"/"off") and why not when off."""
        self.openai_ids = OpenAITokenIds.load(config.openai_token_ids)
        """Decodes OpenAI token ids (tiktoken's) into text; None: ids are the model's own."""
        self.metrics = metrics
        self._model_threads = tuple(model_threads)
        self._solo_threads = solo_threads
        self._tokenizer_pool = tokenizer_pool
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
            solo=self._runs_solo,
        )
        self._tokenizing = 0

    @staticmethod
    def _head(settings: modelconfig.ModelSettings, loaded: LoadedModel) -> Head:
        """The load's Head when this config resolves the same module chain (the server's own
        case); else one for this config (tests that share a loaded model)."""
        head = loaded.head
        if head is not None and (head.modes, head.steps) == (
            settings.pooling_modes,
            settings.steps,
        ):
            return head
        from .head import Head

        return Head(settings.pooling_modes, settings.steps, loaded.hidden_size, loaded.device)

    def _plan_graphs(self, config: ServerConfig, loaded: LoadedModel) -> tuple[str, str]:
        if config.cuda_graphs == "off":
            return "off", "--cuda-graphs off"
        if loaded.device.type != "cuda":
            if config.cuda_graphs == "on":
                raise ModelLoadError(f"--cuda-graphs on: the device is {loaded.device}, not CUDA")
            return "off", f"the device is {loaded.device}"
        if not config.warmup:
            return "off", "--no-warmup: graphs are captured during warmup"
        from .graphs import GraphSet, graph_forward

        self.runner.graphs = GraphSet(
            graph_forward(loaded, self.runner.head),
            loaded.device,
            loaded.pad_token_id,
            loaded.cls_token_id,
        )
        return "on", ""

    def graphs_report(self) -> dict[str, object]:
        """/ready's and /info's `cuda_graphs`: on or off, why off, and what the graphs hold."""
        report: dict[str, object] = {"mode": self.graphs_mode, "reason": self.graphs_reason}
        if self.runner.graphs is not None:
            report.update(self.runner.graphs.stats.as_json())
        return report

    def _fault(self, report: Callable[[str, bool], None]) -> Callable[[str, bool], None]:
        def counted(error: str, hung: bool) -> None:
            self.metrics.model_faults.labels(kind="hung" if hung else "raised").inc()
            report(error, hung)

        return counted

    @property
    def hidden_size(self) -> int:
        """The served vectors' dimension (after pooling and any Dense modules)."""
        return self.runner.head.output_size

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

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def idle(self) -> bool:
        """No input queued or running."""
        return self.scheduler.idle

    def run_batcher(self) -> Awaitable[None]:
        """The batching loop (run it as a task until the server stops)."""
        return self.scheduler.run()

    async def tokens(
        self, texts: Sequence[str], add_special_tokens: bool, prompt: str | None = None
    ) -> list[list[dict]]:
        """TEI's /tokenize: each text's tokens with their text and byte spans."""
        return await self._in_tokenizer_pool(self.runner.tokens, texts, add_special_tokens, prompt)

    async def decode(self, ids: Sequence[Sequence[int]], skip_special_tokens: bool) -> list[str]:
        """TEI's /decode: token ids back to text."""
        return await self._in_tokenizer_pool(self.runner.decode, ids, skip_special_tokens)

    async def _in_tokenizer_pool(self, function: Callable[..., T], *args: object) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_pool, function, *args)

    def forward_report(self) -> dict[str, object]:
        """How forward passes run: warmgate's own pass (packed) or the model's (padded), the
        attention it uses, and the CUDA graphs."""
        packed = self.runner.packed
        if packed is None:
            attention = "the model's own"
        elif packed.varlen is not None:
            attention = "variable-length (flash)"
        else:
            attention = "padded keys"
        return {
            "pass": "packed" if packed is not None else "padded",
            "attention": attention,
            "cuda_graphs": self.graphs_report(),
        }

    def profile(self) -> dict[str, list[dict[str, int]]]:
        """The shapes served so far, with counts (the warmup profile format)."""
        return self.scheduler.profile()

    async def _in_model_thread(
        self, function: Callable[..., T], *args: object, worker: int = 0
    ) -> T:
        executor = self._model_threads[worker]
        return await asyncio.get_running_loop().run_in_executor(executor, function, *args)

    def _runs_solo(self, shape: Shape) -> bool:
        """Small shapes run solo when they are all there is to do (the latency of a lone
        request: about half on two cores); the warmup settles them that way too."""
        return self._solo_threads > 0 and shape.tokens <= SOLO_TOKENS

    async def _execute(
        self, batch: list[Sequence[int]], shape: Shape, worker: int = 0, solo: bool = False
    ) -> BatchResult:
        threads = self._solo_threads if solo else None
        return await self._in_model_thread(
            self.runner.execute, batch, shape, worker, True, threads, worker=worker
        )

    async def embed(
        self,
        texts: Sequence[str | Sequence[int]],
        truncate: bool = False,
        truncate_left: bool = False,
        record: bool = True,
        openai_ids: bool = False,
        prompt: str | None = None,
    ) -> Embeddings:
        """Tokenize (tokenizer thread), batch, run (model thread). Raises InputTooLong, and
        InvalidTokenIds for `openai_ids` inputs (OpenAI's ids, with --openai-token-ids).
        Texts get `prompt` before them (None: the model's default prompt)."""
        self._tokenizing += 1
        started = time.monotonic()
        try:
            token_ids = await self._in_tokenizer_pool(
                self._tokenize, texts, truncate, truncate_left, openai_ids, prompt
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
        prompt: str | None = None,
    ) -> list[list[int]]:
        """In the tokenizer thread: OpenAI's ids back to text when asked, then the model's."""
        if openai_ids and self.openai_ids is not None:
            texts = self.openai_ids.texts(texts)
        return self.runner.tokenize(texts, truncate, truncate_left, prompt=prompt)

    async def embed_all(
        self,
        texts: Sequence[str | Sequence[int]],
        truncate: bool,
        truncate_left: bool,
        prompt: str | None = None,
    ) -> TokenStates:
        """Every token's last hidden state per input (TEI's /embed_all: no pooling), in
        request order, with the token count and whether a shape ran cold. Runs on model worker
        0 in planned shapes (inputs grouped by bucket), next to the batcher's batches."""
        token_ids = await self._in_tokenizer_pool(
            self._tokenize, texts, truncate, truncate_left, False, prompt
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
        await self._capture_graphs(lifecycle)
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
            if self._runs_solo(shape):  # and alone, on every worker's cores
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
                self.workers,
            )
        lifecycle.warmup_seconds = time.perf_counter() - started
        self.metrics.warmup_duration.set(lifecycle.warmup_seconds)

    async def _capture_graphs(self, lifecycle: Lifecycle) -> None:
        """Capture every planned shape's graph on every worker, before any shape is settled,
        so that the settled latencies are the graphs' and a capture that fails (with
        --cuda-graphs auto) leaves every shape to the eager pass, none half-warmed."""
        graphs = self.runner.graphs
        if graphs is None:
            return
        from .graphs import GraphCaptureError

        try:
            for shape in self.plan:
                if lifecycle.phase != WARMING:
                    return
                for worker in range(self.workers):
                    await self._in_model_thread(self.runner.capture, shape, worker, worker=worker)
        except GraphCaptureError as error:
            if self.config.cuda_graphs == "on":
                raise ModelLoadError(f"--cuda-graphs on: {error}") from None
            log.warning("serving eagerly, without CUDA graphs: %s", error)
            graphs.clear()
            self.runner.graphs = None
            self.graphs_mode, self.graphs_reason = "off", str(error)
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
            result = await self._execute(inputs, shape, worker, solo)
            seconds.append(result.seconds)
        return seconds
