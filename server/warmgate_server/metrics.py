"""Prometheus metrics, one registry per app (never the global one, so apps in one process and
tests do not share counters)."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Enum,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from warmgate_contract.report import PHASES
from warmgate_contract.shapes import Shape

CONTENT_TYPE = CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.http_requests = Counter(
            "warmgate_http_requests",
            "HTTP requests by endpoint and status code.",
            ["endpoint", "status"],
            registry=registry,
        )
        self.http_duration = Histogram(
            "warmgate_http_request_duration_seconds",
            "HTTP request duration by endpoint and status code.",
            ["endpoint", "status"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.embedding_duration = Histogram(
            "warmgate_embedding_request_duration_seconds",
            "Successful embedding request duration; phase=cold when it ran a shape for the first "
            "time in this process.",
            ["endpoint", "phase"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.input_tokens = Histogram(
            "warmgate_request_input_tokens",
            "Tokens per input, special tokens included.",
            buckets=(8, 16, 32, 64, 128, 256, 512, 1024, 2048, 8192),
            registry=registry,
        )
        self.in_flight = Gauge(
            "warmgate_requests_in_flight", "Embedding requests being served.", registry=registry
        )
        self.queue_depth = Gauge(
            "warmgate_queue_depth", "Inputs waiting for a batch.", registry=registry
        )
        self.model_faults = Counter(
            "warmgate_model_faults",
            "Forward passes for traffic that raised or ran past --forward-timeout, by kind.",
            ["kind"],
            registry=registry,
        )
        self.rejected = Counter(
            "warmgate_requests_rejected",
            "Embedding requests refused before any work (overloaded, not ready).",
            ["reason"],
            registry=registry,
        )
        self.batch_size = Histogram(
            "warmgate_batch_size",
            "Real inputs per batch (before batch-size padding).",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=registry,
        )
        self.batch_tokens = Histogram(
            "warmgate_batch_tokens",
            "Padded tokens per batch (batch size x bucket).",
            buckets=(32, 128, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536),
            registry=registry,
        )
        self.padding_ratio = Histogram(
            "warmgate_padding_ratio",
            "Share of a batch's tokens that are padding.",
            buckets=(0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
            registry=registry,
        )
        self.inference_duration = Histogram(
            "warmgate_inference_duration_seconds",
            "Forward pass duration by shape; phase=cold for the first run of a shape while "
            "serving.",
            ["shape", "phase"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.inference_cpu = Counter(
            "warmgate_inference_cpu_seconds",
            "CPU time of the model threads' forward passes while serving. Divided by "
            "warmgate_inference_duration_seconds_sum: the share of forward-pass time spent "
            "computing; well below 1, the pod waits for a CPU (neighbours, its CPU limit).",
            registry=registry,
        )
        self.cold_hits = Counter(
            "warmgate_cold_hits",
            "Batches that ran a shape for the first time on their model worker while serving "
            "(zero after warmup for every planned shape).",
            registry=registry,
        )
        self.batches = Counter(
            "warmgate_batches", "Served batches by phase.", ["phase"], registry=registry
        )
        self.warmup_duration = Gauge(
            "warmgate_warmup_duration_seconds", "Whole warmup duration.", registry=registry
        )
        self.warmup_shape_peak = Gauge(
            "warmgate_warmup_shape_peak_bytes",
            "Memory peak while each shape warmed on every worker (process resident memory on a "
            "CPU, the CUDA allocator's reserved memory on a GPU).",
            ["shape"],
            registry=registry,
        )
        self.memory_peak = Gauge(
            "warmgate_memory_peak_bytes",
            "The highest memory the warmup reached (the same measure).",
            registry=registry,
        )
        self.memory_limit = Gauge(
            "warmgate_memory_limit_bytes",
            "What the process may use: the container's cgroup limit, or the GPU's memory "
            "(absent when nothing limits it).",
            registry=registry,
        )
        self.memory_headroom = Gauge(
            "warmgate_memory_headroom_bytes",
            "The limit less the warmup's peak.",
            registry=registry,
        )
        self.warmup_shape_duration = Gauge(
            "warmgate_warmup_shape_duration_seconds",
            "Time spent warming each shape.",
            ["shape"],
            registry=registry,
        )
        self.warmup_shape_steady = Gauge(
            "warmgate_warmup_shape_steady_seconds",
            "Steady forward latency of each warmed shape.",
            ["shape"],
            registry=registry,
        )
        self.cuda_graph_memory = Gauge(
            "warmgate_cuda_graph_memory_bytes",
            "Device memory held by the planned shapes' CUDA graphs (0: no graphs).",
            registry=registry,
        )
        self.ready = Gauge("warmgate_ready", "1 when /ready answers 200.", registry=registry)
        self.phase = Enum(
            "warmgate_phase", "Lifecycle phase.", states=list(PHASES), registry=registry
        )
        self.phase.state("loading")
        self.cold_hits.inc(0)
        for phase in ("cold", "warm"):
            self.batches.labels(phase=phase).inc(0)

    def set_phase(self, phase: str) -> None:
        self.phase.state(phase)
        self.ready.set(1 if phase == "ready" else 0)

    def observe_batch(
        self,
        shape: Shape,
        real_inputs: int,
        real_tokens: int,
        seconds: float,
        cold: bool,
        cpu_seconds: float = 0.0,
    ) -> None:
        phase = "cold" if cold else "warm"
        self.batch_size.observe(real_inputs)
        self.batch_tokens.observe(shape.tokens)
        self.padding_ratio.observe(1.0 - real_tokens / shape.tokens)
        self.inference_duration.labels(shape=shape.key, phase=phase).observe(seconds)
        self.inference_cpu.inc(cpu_seconds)
        self.batches.labels(phase=phase).inc()
        if cold:
            self.cold_hits.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
