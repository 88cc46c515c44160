"""The serving engine: one pipeline for every request, built once per loaded model in the model
thread. The HTTP layer parses a request (schemas.py) and calls `embed`; nothing here knows HTTP.

- pre (pre.py): OpenAI ids back to text, the prompt, tokenizing, in the tokenizer threads;
- core: the one batcher (scheduler.py) and its model workers (workers.py), for pooled and
  per-token requests alike, with the same queue bound, deadlines and fault accounting; the
  workers run the model's forward path (runner.py, backends/);
- post: the model's module chain in the forward pass (head.py), then per request (post.py)
  dimensions, normalisation and similarity.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from warmgate_contract.shapes import Shape

from . import post
from .bucketing import ShapePolicy
from .config import ServerConfig
from .faults import FaultInjector
from .lifecycle import Lifecycle
from .loading import LoadedModel
from .memory import probe_for
from .metrics import Metrics
from .openai_ids import OpenAITokenIds
from .pacing import CpuPacer
from .pre import Preprocessor
from .runner import ModelRunner
from .scheduler import Scheduler, StageTimes
from .schemas import EmbedRequest, Output
from .serving import module_chain, multi_head, request_limits, resolve_settings
from .settle import SettleRule, default_rule
from .warming import Warmup
from .workers import Workers


@dataclass(frozen=True)
class Result:
    output: np.ndarray | list[np.ndarray]
    """What the request asked for (post.finish): its vectors, per input its token states, or
    its similarity scores."""
    prompt_tokens: int
    cold: bool
    """At least one of its batches ran its shape for the first time."""
    timing: StageTimes = field(default_factory=StageTimes)


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
        """`on_fault`, `on_success`: the scheduler's; `solo_threads`: the workers'."""
        self.config = config
        self.plan = tuple(plan)
        self.metrics = metrics
        self.settings = settings = resolve_settings(config, loaded)
        assert settings.max_input_length is not None
        head = module_chain(settings, loaded)
        self.runner = runner = ModelRunner(
            loaded,
            head,
            settings.max_input_length,
            packed=config.packing != "off",
            prompt=settings.default_prompt,
            include_prompt=settings.include_prompt,
            lowercase=settings.lowercase,
            backend=config.backend,
            multi=multi_head(settings, loaded, head),
        )
        runner.faults = faults
        if settings.logit_score is not None:  # a causal-LM re-ranker: its chat template
            from .pre import ChatPairs

            runner.tokenization.chat = ChatPairs(settings.default_prompt)
        self.workers = Workers(config, loaded, runner, model_threads, solo_threads)
        self.memory = probe_for(loaded.device, loaded.path)
        openai_ids = OpenAITokenIds.load(config.openai_token_ids)
        self.pre = Preprocessor(runner.tokenization, openai_ids, tokenizer_pool, metrics)
        self.limits = request_limits(
            config, settings, self.hidden_size, runner.vocab_size, openai_ids
        )
        """What requests are checked against (schemas.Limits)."""
        policy = ShapePolicy.build(
            config.sequence_buckets,
            config.max_batch_size,
            config.max_batch_tokens,
            config.pad_batch,
            self.plan,
        )
        self.scheduler = Scheduler(
            policy=policy,
            execute=self.workers.execute,
            metrics=metrics,
            max_wait_s=config.max_wait_ms / 1000.0,
            max_queued_inputs=max(
                config.max_concurrent_requests * config.max_batch_size,
                2 * config.max_client_batch_size,
            ),
            workers=self.workers.count,
            more_coming=lambda: self.pre.busy > 0,
            forward_timeout_s=config.forward_timeout,
            on_fault=on_fault,
            on_success=on_success,
            solo=self.workers.runs_solo,
            share_load=self.packed and loaded.device.type == "cpu",
        )

    @property
    def hidden_size(self) -> int:
        """The served vectors' dimension (after pooling and any Dense modules)."""
        return self.runner.head.output_size

    @property
    def max_input_length(self) -> int:
        return self.runner.max_input_length

    @property
    def packed(self) -> bool:
        """Whether the padding-free forward pass runs."""
        return self.runner.backend.name == "packed"

    @property
    def idle(self) -> bool:
        """No input queued or running."""
        return self.scheduler.idle

    def run_batcher(self) -> Awaitable[None]:
        """The batching loop (run it as a task until the server stops)."""
        return self.scheduler.run()

    def profile(self) -> dict[str, list[dict[str, int]]]:
        """The shapes served so far, with counts (the warmup profile format)."""
        return self.scheduler.profile()

    async def embed(self, request: EmbedRequest, record: bool = True) -> Result:
        """pre, core, post for one parsed request. Raises InputTooLong and InvalidTokenIds
        (pre), QueueFull and ModelFault (core). `record=False` keeps it out of the metrics and
        the served-shape profile (the server's own requests)."""
        token_ids, tokenize_seconds = await self.pre.token_ids(request, record)
        pooled = request.output is not Output.TOKENS
        embedded = await self.scheduler.submit(token_ids, record=record, pooled=pooled)
        embedded.timing.tokenize = tokenize_seconds
        output = post.finish(embedded.outputs, request)
        return Result(output, sum(map(len, token_ids)), embedded.cold, embedded.timing)

    async def warm(self, lifecycle: Lifecycle, rule: SettleRule | None = None) -> None:
        """Run every planned shape through the serving path on every model worker, smallest
        first, within the memory budget (warming.py), as the device's rule says (settle.py:
        on a CPU once cold and once timed, on a GPU until its latency settles). When the fit
        policy cut the plan, the batcher forms only the shapes that were warmed."""
        config = self.config
        warmup = Warmup(
            self.workers,
            self.plan,
            self.metrics,
            memory=self.memory,
            memory_policy=config.memory_policy,
            graphs_required=config.cuda_graphs == "on",
            pacer=CpuPacer(config.warmup_cpus if self.runner.loaded.device.type == "cpu" else 0),
        )
        await warmup.run(lifecycle, rule or default_rule(self.runner.loaded.device.type))
        cut = lifecycle.memory.cut if lifecycle.memory is not None else None
        if cut is not None:
            self.plan = tuple(shape for shape in self.plan if shape not in cut.shapes)
            lifecycle.planned = self.plan
            self.scheduler.policy = ShapePolicy.build(
                config.sequence_buckets,
                max(shape.batch_size for shape in self.plan),
                cut.max_batch_tokens,
                config.pad_batch,
                self.plan,
            )
