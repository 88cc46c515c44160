"""Shape maths: sequence buckets, padded batch sizes and the warmup plan. Pure functions only."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple


class Shape(NamedTuple):
    """The padded tensor the model runs: `batch_size` rows of `seq_len` tokens."""

    batch_size: int
    seq_len: int

    @property
    def key(self) -> str:
        """The name used in metrics labels and maps, e.g. "8x64"."""
        return f"{self.batch_size}x{self.seq_len}"

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len

    def as_json(self) -> dict[str, int]:
        return {"batch_size": self.batch_size, "seq_len": self.seq_len}


def bucket_for(length: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds `length` tokens, or None when none does."""
    index = bisect.bisect_left(buckets, length)
    return buckets[index] if index < len(buckets) else None


@dataclass(frozen=True)
class WarmupPlan:
    shapes: tuple[Shape, ...]
    """Every shape to warm: the grid first (short sequences, small batches first), then profile."""
    ignored_profile_shapes: tuple[Shape, ...]
    """Profile shapes this configuration can never produce (unknown bucket, over a limit)."""


def plan_warmup(
    batch_sizes: Iterable[int],
    buckets: Sequence[int],
    max_batch_tokens: int,
    max_batch_size: int,
    profile_shapes: Iterable[Shape] = (),
) -> WarmupPlan:
    """Batch sizes x buckets within the token budget, plus the profile shapes that can occur.

    Nothing in the plan exceeds `max_batch_tokens` or `max_batch_size`: warmup never runs a
    shape bigger than serving may, so a plan that fits in memory at warmup fits at serving.
    """
    grid = [
        Shape(batch_size, seq_len)
        for seq_len in buckets
        for batch_size in sorted(set(batch_sizes))
        if batch_size <= max_batch_size and batch_size * seq_len <= max_batch_tokens
    ]
    planned = dict.fromkeys(grid)
    ignored: list[Shape] = []
    for shape in profile_shapes:
        fits = (
            shape.seq_len in buckets
            and 1 <= shape.batch_size <= max_batch_size
            and shape.tokens <= max_batch_tokens
        )
        if not fits:
            ignored.append(shape)
        else:
            planned.setdefault(shape, None)
    return WarmupPlan(shapes=tuple(planned), ignored_profile_shapes=tuple(ignored))


@dataclass(frozen=True)
class ShapePolicy:
    """Which padded shape a batch of inputs runs as, so every shape served is a planned one.

    With `pad_batch`, a batch of n inputs at bucket s runs as the smallest planned batch size
    for s that holds n, and the batcher never builds a batch bigger than the largest one.
    Without it, batches run at their real size (bounded by the limits) and may be cold.
    """

    buckets: tuple[int, ...]
    max_batch_size: int
    max_batch_tokens: int
    pad_batch: bool
    planned: frozenset[Shape]

    @classmethod
    def build(
        cls,
        buckets: Sequence[int],
        max_batch_size: int,
        max_batch_tokens: int,
        pad_batch: bool,
        plan: Iterable[Shape],
    ) -> ShapePolicy:
        return cls(tuple(buckets), max_batch_size, max_batch_tokens, pad_batch, frozenset(plan))

    def batch_sizes_for(self, seq_len: int) -> tuple[int, ...]:
        return tuple(sorted(shape.batch_size for shape in self.planned if shape.seq_len == seq_len))

    def capacity(self, seq_len: int) -> int:
        """The most inputs one batch at this bucket may hold."""
        limit = max(1, min(self.max_batch_size, self.max_batch_tokens // seq_len))
        if self.pad_batch:
            sizes = self.batch_sizes_for(seq_len)
            if sizes:
                return min(limit, sizes[-1])
        return limit

    def shape_for(self, count: int, seq_len: int) -> Shape:
        """The padded shape for `count` inputs whose longest fits `seq_len` (a bucket)."""
        if count < 1 or count > self.capacity(seq_len):
            raise ValueError(f"{count} inputs do not fit one batch at bucket {seq_len}")
        if self.pad_batch:
            sizes = self.batch_sizes_for(seq_len)
            index = bisect.bisect_left(sizes, count)
            if index < len(sizes):
                return Shape(sizes[index], seq_len)
        return Shape(count, seq_len)
