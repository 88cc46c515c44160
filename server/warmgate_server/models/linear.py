"""The packed pass's linear layers on a CPU in fp32: oneDNN on weights reordered once into
its blocked layout (the inner layer's GELU fused), or MKL (torch's `F.linear`) on the plain
weights, whichever this CPU runs faster, measured at load on the model's own matrices.

Neither always wins: on an AMD EPYC with AVX-512 oneDNN's fp32 kernels are well ahead of MKL's;
on an AVX2 EPYC MKL is ahead for a batch's row counts (a few hundred tokens and up) and oneDNN
for a lone short input; on an Ice Lake Xeon oneDNN is ahead up to a few hundred tokens and MKL
from about a thousand (at 3,808 tokens, 32 pairs of a re-ranker, oneDNN's three plain matrices
took 26% longer: the figures, docs/benchmarks.md). So at load the first layer's four matrices
are timed both ways at SMALL_ROWS, LARGE_ROWS and the largest pass the server's plan allows (up
to BIG_ROWS), on the model thread's own thread count, interleaved. Each row count takes the
faster kernel (oneDNN unless MKL is at least TIE faster, and for the largest pass MKL unless
oneDNN is: the choice should not flap with noise, and the largest pass is where a few percent
is capacity; its two kernels' rates differ by 5-14% on that Xeon), and serves the passes from
its own start: SMALL_ROWS's below SWITCH_ROWS tokens, LARGE_ROWS's from there, the largest's
from the geometric mean of it and LARGE_ROWS. When the kernels differ and the linear weights
are at most BOTH_LIMIT bytes, both are kept (a second copy of those weights); above the limit
the largest row count's kernel serves every pass (throughput decides capacity). The server's
`--linear onednn|mkl|aten` (`WARMGATE_LINEAR`; the older `WARMGATE_ONEDNN=0`: mkl) fixes the
kernel.

bfloat16 on a CPU is chosen the same way, between oneDNN on reordered weights and torch's own
`F.linear` (named `aten`: it is not MKL in bfloat16), where oneDNN has bfloat16 kernels for
this CPU (AVX512_BF16, AMX or AVX2 with VNNI-style emulation: torch says which). On a Zen 4
EPYC (AVX512_BF16) the reordered bfloat16 matrices beat both fp32 oneDNN and bfloat16
`F.linear` (the figures: docs/benchmarks.md, "bfloat16 on the CPU"). GPUs and float16 run
`F.linear` (cuBLAS).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
import torch.nn.functional as F

Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]

SMALL_ROWS = 16
"""A lone short input's tokens."""
LARGE_ROWS = 256
"""A batch's tokens (32 short sentences are about 300)."""
BIG_ROWS = 2048
"""The largest pass measured: a pass's tokens are at most --max-batch-tokens (16,384 by
default), but each timed run adds to every start without a warm state (a multilingual-e5-base-
sized layer at 2,048 tokens: about 0.2 s on one Ice Lake core, so 0.8 s for both kernels), and
from about a thousand tokens on the per-token rates stay as they are (this Ice Lake: MKL 5-14%
ahead from 2,048 to 4,608 tokens, oneDNN's rate at 4,096 within 1% of its rate at 3,584)."""
BIG_RUNS = 2
"""Timed runs at the largest row count, the faster of them kept, with no warmup run: a run is
long (tenths of a second), so a oneDNN primitive's making (milliseconds) and the noise of a
short run are small in it, and each run adds to every start without a warm state."""
SWITCH_ROWS = 64
"""Passes of fewer tokens take the small row count's kernel."""
BOTH_LIMIT = 512 * 2**20
"""Keep a second copy of the linear weights only up to this size (MiniLM's are 85 MB, an
XLM-R of multilingual-e5-base's shape 340 MB, bge-m3's 1.2 GB)."""
TIE = 0.05
"""How much faster MKL must be to take a short row count from oneDNN, and oneDNN to take the
largest pass from MKL."""
RUNS = 7
ONEDNN_WARM_ROWS = 128
"""oneDNN makes a primitive (a JIT kernel) the first time it meets a matrix shape, and keeps it:
on a 2-core EPYC (AVX2) the first call of one layer's four matrices at one row took 6.4 ms
against 0.6 ms after, and every new row count kept 2.7 MiB more for good (MiniLM's matrices;
MKL's first call costs neither). The packed pass's row count is the batch's real tokens, not
the planned shape's, so a first request at a row count no planned shape ran paid it, and a
server under varied traffic grew by 344 MiB over the row counts 3 to 128 alone. So oneDNN
runs at a bounded set of row counts (`onednn_rows`: the rows padded up, at most 12.5% more),
and warmup makes every one of them up to this count (`warm`): above it a pass is long enough
that the primitive is a few percent of it."""


def onednn_rows(rows: int) -> int:
    """The row count a oneDNN call runs at: `rows` padded up to a multiple of 4 up to 32, of 8
    up to 128, then of an eighth of its power of two (129 -> 144, 1000 -> 1024): 20 counts up
    to 128 and 8 more a doubling, where each count is a primitive made and kept."""
    if rows <= 32:
        step = 4
    elif rows <= 128:
        step = 8
    else:
        step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


@dataclass(frozen=True)
class Layer:
    """One layer's weights: query, key and value fused into one matrix. A bias is None where
    the layer has none, the norms () where the model keeps its own (Qwen3, Gemma 3: decoder.py,
    whose inner matrix is the gate and up projections fused)."""

    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    out_weight: torch.Tensor
    out_bias: torch.Tensor | None
    out_norm: tuple[torch.Tensor, ...]
    inner_weight: torch.Tensor
    inner_bias: torch.Tensor | None
    output_weight: torch.Tensor
    output_bias: torch.Tensor | None
    output_norm: tuple[torch.Tensor, ...]

    def matrices(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [
            (self.qkv_weight, self.qkv_bias),
            (self.out_weight, self.out_bias),
            (self.inner_weight, self.inner_bias),
            (self.output_weight, self.output_bias),
        ]


@dataclass(frozen=True)
class Kernel:
    """The layers' weights in one kernel's layout, and its two calls."""

    name: str
    layers: list[Layer]
    linear: Linear
    activated: Linear
    """The inner layer: its linear layer and the activation."""


@dataclass(frozen=True)
class Kernels:
    """The kernel a pass of a given token count takes, and why."""

    steps: tuple[tuple[int, Kernel], ...]
    """(from tokens, kernel), the first from 0, ascending: a pass takes the last step at or
    below its token count."""
    chosen_by: str
    measured_ms: dict[str, dict[int, float]] = field(default_factory=dict)
    """kernel -> tokens -> ms for one layer's four matrix multiplications (a median)."""

    @classmethod
    def one(cls, kernel: Kernel, chosen_by: str) -> Kernels:
        return cls(((0, kernel),), chosen_by)

    def for_rows(self, rows: int) -> Kernel:
        chosen = self.steps[0][1]
        for start, kernel in self.steps[1:]:
            if rows < start:
                break
            chosen = kernel
        return chosen

    @property
    def first(self) -> Kernel:
        return self.steps[0][1]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(kernel.name for _, kernel in self.steps))

    def as_json(self) -> dict[str, Any]:
        report: dict[str, Any] = {"kernels": list(self.names), "chosen_by": self.chosen_by}
        if len(self.names) > 1:
            report["from_tokens"] = {str(start): kernel.name for start, kernel in self.steps}
        if self.measured_ms:
            report["measured_ms"] = {
                name: {str(rows): round(ms, 3) for rows, ms in by_rows.items()}
                for name, by_rows in self.measured_ms.items()
            }
        return report


def warm(kernels: Kernels, rows: int = ONEDNN_WARM_ROWS) -> int:
    """Run each oneDNN kernel's first layer once at every row count up to `rows` that it runs
    at (`onednn_rows` of the counts it serves; the layers share their matrices' shapes, so one
    layer makes every layer's primitives), on the calling thread's torch threads; returns the
    row counts run."""
    served: dict[tuple[int, int], Kernel] = {}
    for count in range(1, rows + 1):
        kernel = kernels.for_rows(count)  # the steps up to `rows`
        if kernel.name == "onednn":
            served[(onednn_rows(count), id(kernel))] = kernel
    with torch.inference_mode():
        for (count, _), kernel in sorted(served.items(), key=lambda item: item[0][0]):
            for index, (weight, bias) in enumerate(kernel.layers[0].matrices()):
                x = torch.zeros(count, weight.shape[1], dtype=weight.dtype)
                call = kernel.activated if index == 2 else kernel.linear  # the inner layer's
                call(x, weight, bias)
    return len(served)


def _onednn_available(dtype: torch.dtype) -> bool:
    ops = torch.ops.mkldnn
    if not (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_linear_pointwise")
        and hasattr(ops, "_reorder_linear_weight")
    ):
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        supported = getattr(ops, "_is_mkldnn_bf16_supported", None)
        return bool(supported is not None and supported())
    return False


def mkl_kernel(layers: list[Layer], activation: Callable[[torch.Tensor], torch.Tensor]) -> Kernel:
    """torch's `F.linear` on the plain weights: MKL for fp32 on a CPU."""
    if not _is_cpu(layers):
        name = "torch"
    else:
        name = "mkl" if layers[0].qkv_weight.dtype == torch.float32 else "aten"
    return Kernel(
        name,
        layers,
        F.linear,
        lambda x, weight, bias: activation(F.linear(x, weight, bias)),
    )


def onednn_kernel(layers: list[Layer], post_op: tuple[str, str]) -> Kernel:
    """The layers with their four weight matrices reordered into oneDNN's blocked layout (new
    tensors: the plain ones are freed unless the caller holds them)."""
    reorder = torch.ops.mkldnn._reorder_linear_weight
    reordered = [
        replace(
            layer,
            qkv_weight=reorder(layer.qkv_weight, None),
            out_weight=reorder(layer.out_weight, None),
            inner_weight=reorder(layer.inner_weight, None),
            output_weight=reorder(layer.output_weight, None),
        )
        for layer in layers
    ]
    call = torch.ops.mkldnn._linear_pointwise
    attr, algorithm = post_op

    def padded(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *post: Any):
        rows = x.shape[0]
        wanted = onednn_rows(rows) if x.dim() == 2 else rows
        if wanted == rows:
            return call(x, weight, bias, *post)
        x = torch.cat((x, x.new_zeros(wanted - rows, x.shape[1])))
        return call(x, weight, bias, *post)[:rows]  # the leading rows: contiguous

    return Kernel(
        "onednn",
        reordered,
        lambda x, weight, bias: padded(x, weight, bias, "none", [], ""),
        lambda x, weight, bias: padded(x, weight, bias, attr, [], algorithm),
    )


def _is_cpu(layers: Sequence[Layer]) -> bool:
    return not layers or layers[0].qkv_weight.device.type == "cpu"


def measure(kernels: Sequence[Kernel], rows: Sequence[int], plain: Layer) -> dict[str, dict]:
    """ms per kernel and token count for `plain`'s four matrices (the kernels' first layer; the
    inner one with its activation, as a pass runs it), the kernels interleaved run by run:
    medians of RUNS timed runs after a warmup run, or above LARGE_ROWS tokens the faster of
    BIG_RUNS."""
    shapes = [weight.shape for weight, _ in plain.matrices()]
    dtype = plain.qkv_weight.dtype
    results: dict[str, dict[int, float]] = {kernel.name: {} for kernel in kernels}
    with torch.inference_mode():
        for count in rows:
            inputs = [torch.randn(count, shape[1], dtype=dtype) for shape in shapes]
            samples: dict[str, list[float]] = {kernel.name: [] for kernel in kernels}
            big = count > LARGE_ROWS
            for run in range(BIG_RUNS if big else RUNS + 1):
                for kernel in kernels:
                    calls = [kernel.linear, kernel.linear, kernel.activated, kernel.linear]
                    matrices = kernel.layers[0].matrices()
                    started = time.perf_counter()
                    for call, x, (weight, bias) in zip(calls, inputs, matrices, strict=True):
                        call(x, weight, bias)
                    if run or big:  # a short count's first run is its warmup
                        samples[kernel.name].append(time.perf_counter() - started)
            for name, seconds in samples.items():
                kept = min(seconds) if big else statistics.median(seconds)
                results[name][count] = kept * 1000.0
    return results


class Kept(Protocol):
    """Measurements an earlier start made (the server's warm_state.WarmState)."""

    def measured(self, what: Mapping[str, Any], measure: Callable[[], Any]) -> tuple[Any, bool]: ...


def choose(
    layers: list[Layer],
    device: torch.device,
    dtype: torch.dtype,
    activation: Callable[[torch.Tensor], torch.Tensor],
    post_op: tuple[str, str],
    wanted: str = "auto",
    kept: Kept | None = None,
    largest_rows: int | None = None,
) -> Kernels:
    """The kernels of the packed pass (see the module's docstring). `layers` hold the plain
    weights; what is not kept of them is freed when the caller lets them go. `wanted` is the
    server's --linear: auto measures (or takes what an earlier start on this CPU, torch and
    code measured for the same matrices and threads, from `kept`); onednn, mkl or aten is that
    kernel always (where the device and dtype have it). `largest_rows`: the most tokens a pass
    of the server's plan runs (measured up to BIG_ROWS; None or up to twice LARGE_ROWS: not
    measured apart)."""
    plain = mkl_kernel(layers, activation)
    if device.type != "cpu" or not _onednn_available(dtype):
        return Kernels.one(plain, f"{device.type}, {str(dtype)[6:]}: F.linear")
    if wanted in ("mkl", "aten"):
        return Kernels.one(plain, f"--linear {wanted}")
    onednn = onednn_kernel(layers, post_op)
    if wanted == "onednn":
        return Kernels.one(onednn, f"--linear {wanted}")
    rows = measured_rows(largest_rows)
    measured, reused = _measured(onednn, plain, layers[0], rows, kept)

    def faster(count: int) -> Kernel:
        mkl_ms, onednn_ms = measured[plain.name][count], measured["onednn"][count]
        if count > LARGE_ROWS:  # the plain weights unless oneDNN's reorder earns its keep
            return onednn if onednn_ms < mkl_ms * (1 - TIE) else plain
        return plain if mkl_ms < onednn_ms * (1 - TIE) else onednn

    starts = [0, SWITCH_ROWS, *(round(math.sqrt(LARGE_ROWS * count)) for count in rows[2:])]
    steps = [(start, faster(count)) for start, count in zip(starts, rows, strict=True)]
    weight_bytes = sum(
        weight.numel() * weight.element_size() for layer in layers for weight, _ in layer.matrices()
    )
    why = "measured"
    if len({id(kernel) for _, kernel in steps}) > 1 and weight_bytes > BOTH_LIMIT:
        steps = [(0, steps[-1][1])]
        why = f"measured; one copy of {weight_bytes / 2**20:.0f} MiB of linear weights"
    merged = [steps[0]]  # a step that takes the kernel before it is no step
    for start, kernel in steps[1:]:
        if kernel is not merged[-1][1]:
            merged.append((start, kernel))
    if reused:
        why += " (by an earlier start: the warm state)"
    return Kernels(tuple(merged), why, measured)


def measured_rows(largest_rows: int | None) -> tuple[int, ...]:
    """The token counts choose() times: SMALL_ROWS, LARGE_ROWS and the plan's largest pass (up
    to BIG_ROWS) where it is above twice LARGE_ROWS."""
    big = min(largest_rows or 0, BIG_ROWS)
    return (SMALL_ROWS, LARGE_ROWS, big) if big > 2 * LARGE_ROWS else (SMALL_ROWS, LARGE_ROWS)


def _measured(
    onednn: Kernel, plain: Kernel, layer: Layer, rows: tuple[int, ...], kept: Kept | None
) -> tuple[dict[str, dict[int, float]], bool]:
    """measure()'s timings of both kernels at `rows`, and whether `kept` had them from an
    earlier start."""
    if kept is None:
        return measure([onednn, plain], rows, layer), False
    what = {
        "measure": "linear",
        "kernels": [onednn.name, plain.name],
        "rows": list(rows),
        "threads": torch.get_num_threads(),
        "dtype": str(layer.qkv_weight.dtype),
        "matrices": [list(weight.shape) for weight, _ in layer.matrices()],
    }
    found, reused = kept.measured(
        what,
        lambda: {
            name: {str(count): ms for count, ms in by_rows.items()}
            for name, by_rows in measure([onednn, plain], rows, layer).items()
        },
    )
    try:
        timings = {
            name: {int(count): float(ms) for count, ms in by_rows.items()}
            for name, by_rows in found.items()
        }
        if all(set(timings[kernel.name]) == set(rows) for kernel in (onednn, plain)):
            return timings, reused
    except (AttributeError, KeyError, TypeError, ValueError):
        pass
    return measure([onednn, plain], rows, layer), False  # a kept entry of another form
