"""The memory need a shape will have, predicted from a model of the pass calibrated on the shapes
warmed before it (the needs memory.py's probe measured).

Warmup (warming.py) warms the plan from the smallest shape up and starts no shape predicted to go
past the budget (the limit less contract.report.MEMORY_MARGIN): so a plan too big for its pod
stops, with numbers, before the shape that would have killed it. The prediction starts from the
largest need measured so far (weights, runtime, allocator and threads: measured, not modelled)
and adds what the pass model (PassModel, from config.json) says the shape's activations grow
past those of the largest shape measured, times ACTIVATION_FACTOR, plus ACTIVATION_SLACK for
the allocator's steps; it never fits a line through the measured peaks, whose differences are the
allocator's noise at small shapes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from warmgate_contract.shapes import Shape

ACTIVATION_FACTOR = 2.5
"""How much a shape's need grows per byte of activations the pass model counts, past the
largest shape measured: freed activations stay in the allocator (glibc's per-thread arenas, the
CUDA caching allocator's blocks), kernels take scratch space, and the workers' peaks need not
coincide. Measured on a 2-core EPYC (MiniLM, the 15-shape plan, docs/benchmarks.md): the need
grew 1.8x the modelled activations from 32x128 to 32x256, 2.2x from 32x64 to 32x128, and 0.2x
from 32x256 to 32x512 (activations past glibc's mmap threshold go back to the system at once).
The growth per byte falls as shapes grow, so the largest shape measured is the anchor that
errs least: predicting every shape from the smallest one's need (as before, with 3.0) refused
the operator's own default plan for MiniLM at its default 1536Mi limit (32x256 "about 1.37 GiB"
of a 1.35 GiB budget; it needs 1.1)."""

ACTIVATION_SLACK = 32 * 2**20
"""Added to every prediction: at small shapes the need moves in the allocator's steps, not with
the activations (MiniLM: 51 MiB from 8x64 to 8x128, 3.4x their 15 MiB of activations)."""


def warm_order(plan: Sequence[Shape]) -> list[Shape]:
    """Smallest first (by tokens; of equal tokens, the bigger batch first, which measured
    larger): each shape is then predicted from smaller ones, and the first that would not fit
    stops the warmup before it runs."""
    return sorted(plan, key=lambda shape: (shape.tokens, -shape.batch_size))


@dataclass(frozen=True)
class PassModel:
    """The activations a forward pass holds at once, from the model's dimensions: a layer's
    attention (its input, the fused query-key-value states, their padded layout, the context
    and its copies: ten hidden states a token) or its MLP (input, output and two intermediate
    states), whichever is larger, on every worker at once. Attention scores are not counted:
    scaled_dot_product_attention computes them in blocks (on a CPU as on a GPU), and a model
    that materialises them (transformers' eager attention) is what the measured part of the
    prediction covers. Weights and the runtime are measured, not modelled."""

    hidden: int
    intermediate: int
    dtype_bytes: int
    workers: int = 1

    def activation_bytes(self, shape: Shape) -> int:
        per_token = max(10 * self.hidden, 2 * (self.hidden + self.intermediate))
        return self.workers * self.dtype_bytes * shape.tokens * per_token

    @classmethod
    def of_folder(
        cls, folder: Path, dtype_bytes: int, workers: int, hidden: int | None = None
    ) -> PassModel:
        """From config.json's dimensions under BERT's names (models.bert.bert_config reads
        DistilBERT's), a Gemma's from its text_config; what it lacks is taken as a
        transformer's usual ratio (the loaded model's width, four times that inside)."""
        from .models.bert import bert_config

        try:
            config = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError):
            config = {}
        config = bert_config(config.get("text_config", config)) if isinstance(config, dict) else {}

        def size(name: str) -> int | None:
            value = config.get(name)
            return value if isinstance(value, int) and value > 0 else None

        width = size("hidden_size") or hidden or 768
        return cls(width, size("intermediate_size") or 4 * width, dtype_bytes, workers)


def predict(measured: Sequence[tuple[Shape, int]], shape: Shape, model: PassModel) -> int | None:
    """The need `shape` will have: the largest need measured so far, plus ACTIVATION_FACTOR
    times what the pass model says its activations grow past those of the largest shape
    measured, plus ACTIVATION_SLACK. None before any shape was measured (the first is the
    plan's smallest; the loaded model's own need is checked before it)."""
    if not measured:
        return None
    need = max(need for _done, need in measured)
    reached = max(model.activation_bytes(done) for done, _need in measured)
    growth = max(0, model.activation_bytes(shape) - reached)
    return int(need + ACTIVATION_FACTOR * growth + ACTIVATION_SLACK)
