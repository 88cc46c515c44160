"""CUDA graphs for the warmed plan: one graph per planned (batch size, bucket) shape.

warmgate knows before the first request every shape the batcher will ever run, which is what a
CUDA graph needs: warmup captures each planned shape's whole forward pass and pooling once
(static input buffers, one memory pool shared by the graphs of a model worker), and serving
replays the graph of the shape the batcher chose: one launch instead of hundreds, so the GPU
no longer waits for Python between kernels. A shape outside the plan has no graph; it runs
eagerly and counts as cold.

The graphs of one worker share a memory pool, so replaying one may overwrite another's output:
`run` copies the output to the host before it returns, and a worker replays one graph at a time.

What is captured is the static forward of the backend the graphs wrap (`GraphBackend`;
base.StaticForward): a padded (rows, seq_len) batch of token ids, its 0/1 attention mask and
the 0/1 mask of the tokens to pool on the device in, the finished float32 vectors out (pooling
and the modules after it: head.py), no host synchronisation. BERT-family, Qwen3 and
EmbeddingGemma models use warmgate's own (`PackedBert.dense`, `PackedDecoder.dense`:
right-padded, as this module pads); other models their transformers forward pass, which some
models cannot be captured with: with `--cuda-graphs auto` the server then serves eagerly and
says why, with `on` it fails its warmup with the reason.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from warmgate_contract.shapes import Shape

from .base import Backend, StaticForward, fill_padded

log = logging.getLogger(__name__)

Capture = Callable[
    [StaticForward, torch.Tensor, torch.Tensor, torch.Tensor, Any], tuple[torch.Tensor, Any]
]
"""(forward, static ids, static mask, static pooling mask, memory pool) -> (static output,
replay callable)."""


class GraphCaptureError(RuntimeError):
    """A shape's graph could not be captured (an operation that syncs with the host, memory)."""


# One capture at a time in the process: capturing while another thread launches work on the
# same device is an error in CUDA's global capture mode, and it keeps the pool accounting exact.
_CAPTURE_LOCK = threading.Lock()


def cuda_capture(
    forward: StaticForward, ids: torch.Tensor, mask: torch.Tensor, pooled: torch.Tensor, pool: Any
) -> tuple[torch.Tensor, Callable[[], None]]:
    """Capture `forward` on the static buffers as a CUDA graph in `pool`.

    The forward runs twice on a side stream first, as torch's documentation asks: cuBLAS and
    cuDNN pick their kernels and allocate their workspaces there, outside the graph."""
    device = ids.device
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            forward(ids, mask, pooled)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        output = forward(ids, mask, pooled)
    torch.cuda.synchronize(device)
    return output, graph.replay


def replay_eagerly(
    forward: StaticForward, ids: torch.Tensor, mask: torch.Tensor, pooled: torch.Tensor, pool: Any
) -> tuple[torch.Tensor, Callable[[], None]]:
    """Stands in for `cuda_capture` where no GPU exists (the CPU tests): the same static
    buffers and output, and a replay that runs `forward` on them again. Everything but the CUDA
    capture itself (buffer reuse, padding rows, which shapes have a graph) is then exercised."""
    output = forward(ids, mask, pooled)

    def replay() -> None:
        output.copy_(forward(ids, mask, pooled))

    return output, replay


@dataclass
class _Graph:
    ids: torch.Tensor
    mask: torch.Tensor
    pool_mask: torch.Tensor
    output: torch.Tensor
    replay: Callable[[], None]
    host_ids: np.ndarray
    host_mask: np.ndarray
    host_pool_mask: np.ndarray


@dataclass(frozen=True)
class GraphStats:
    captured: int
    memory_bytes: int
    """Device memory the graphs hold: their shared pools and static buffers."""
    capture_seconds: float

    def as_json(self) -> dict[str, float | int]:
        return {
            "captured": self.captured,
            "memory_bytes": self.memory_bytes,
            "capture_seconds": round(self.capture_seconds, 3),
        }


class GraphSet:
    """The graphs of every (model worker, planned shape), captured during warmup."""

    def __init__(
        self,
        forward: StaticForward,
        device: torch.device,
        pad_token_id: int,
        filler_token_id: int,
        capture: Capture = cuda_capture,
    ) -> None:
        self.forward = forward
        self.device = device
        self.pad_token_id = pad_token_id
        self.filler_token_id = filler_token_id
        """The one real token of a padding row (an all-masked row turns attention into NaN)."""
        self._capture = capture
        self._graphs: dict[tuple[int, Shape], _Graph] = {}
        self._pools: dict[int, Any] = {}
        self.memory_bytes = 0
        self.capture_seconds = 0.0

    def has(self, shape: Shape, worker: int) -> bool:
        return (worker, shape) in self._graphs

    @property
    def stats(self) -> GraphStats:
        return GraphStats(len(self._graphs), self.memory_bytes, self.capture_seconds)

    def capture(self, shape: Shape, worker: int) -> None:
        """Capture `shape`'s graph for `worker` (in that worker's thread, during warmup);
        GraphCaptureError says why it could not."""
        if self.has(shape, worker):
            return
        rows, seq_len = shape.batch_size, shape.seq_len
        with _CAPTURE_LOCK, torch.inference_mode():
            started = time.perf_counter()
            before = _reserved(self.device)
            pool = self._pools.get(worker)
            if pool is None and self.device.type == "cuda":
                pool = self._pools[worker] = torch.cuda.graph_pool_handle()
            host_ids, host_mask, host_pool = (
                np.empty((rows, seq_len), dtype=np.int64) for _ in range(3)
            )  # captured on filler rows only: every replay refills them
            fill_padded([], host_ids, host_mask, host_pool, self.pad_token_id, self.filler_token_id)
            ids, mask, pool_mask = (
                torch.from_numpy(host).to(self.device) for host in (host_ids, host_mask, host_pool)
            )
            try:
                output, replay = self._capture(self.forward, ids, mask, pool_mask, pool)
            except Exception as error:  # torch raises RuntimeError and friends, with the reason
                raise GraphCaptureError(
                    f"cannot capture a CUDA graph of shape {shape.key}: "
                    f"{type(error).__name__}: {error}"
                ) from error
            self._graphs[(worker, shape)] = _Graph(
                ids, mask, pool_mask, output, replay, host_ids, host_mask, host_pool
            )
            self.memory_bytes += max(_reserved(self.device) - before, 0)
            self.capture_seconds += time.perf_counter() - started

    def run(self, batch: Sequence[Sequence[int]], shape: Shape, worker: int) -> np.ndarray:
        """Replay `shape`'s graph on `batch` (its first len(batch) rows are real inputs, each
        at most shape.seq_len tokens): (len(batch), size) float32 on the host."""
        graph = self._graphs[(worker, shape)]
        count = len(batch)
        host_ids, host_mask, host_pool = graph.host_ids, graph.host_mask, graph.host_pool_mask
        fill_padded(batch, host_ids, host_mask, host_pool, self.pad_token_id, self.filler_token_id)
        with torch.inference_mode():
            graph.ids.copy_(torch.from_numpy(host_ids))
            graph.mask.copy_(torch.from_numpy(host_mask))
            graph.pool_mask.copy_(torch.from_numpy(host_pool))
            graph.replay()
            # To the host at once: the next replay of any graph of this pool may reuse it.
            return graph.output[:count].cpu().numpy()

    def clear(self) -> None:
        """Drop every graph and its memory (capture failed part-way; serve eagerly)."""
        self._graphs.clear()
        self._pools.clear()
        self.memory_bytes = 0
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _reserved(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return int(torch.cuda.memory_reserved(device))


class GraphBackend:
    """Another backend with the CUDA graphs of its planned shapes: a pooled pass of a shape
    with a graph on its worker replays it, every other pass runs the wrapped backend."""

    def __init__(self, inner: Backend, graphs: GraphSet) -> None:
        self.inner = inner
        self.graphs = graphs

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def attention(self) -> str:
        return self.inner.attention

    @property
    def layer_count(self) -> int | None:
        return self.inner.layer_count

    def forward(
        self,
        batch: Sequence[Sequence[int]],
        shape: Shape,
        *,
        worker: int,
        pool: bool,
        threads: int | None,
        layers: int | None,
    ) -> Sequence[np.ndarray]:
        if self.route(shape, worker, pool) == "graph":
            return self.graphs.run(batch, shape, worker)
        return self.inner.forward(
            batch, shape, worker=worker, pool=pool, threads=threads, layers=layers
        )

    def route(self, shape: Shape, worker: int, pool: bool) -> str:
        return (
            "graph"
            if pool and self.graphs.has(shape, worker)
            else self.inner.route(shape, worker, pool)
        )

    def warm_kernels(self, threads: int | None) -> int:
        return self.inner.warm_kernels(threads)

    def static_forward(self) -> StaticForward | None:
        return self.inner.static_forward()

    def details(self) -> dict[str, object]:
        return self.inner.details()
