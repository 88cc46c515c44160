"""Bucketing for serving: the bucket an input lands in and the padded batch a group of inputs
runs as (the shape itself and the warmup plan are the contract's: `warmgate_contract.shapes`).
Pure functions only."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from warmgate_contract.shapes import Shape


def bucket_for(length: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds `length` tokens, or None when none does."""
    index = bisect.bisect_left(buckets, length)
    return buckets[index] if index < len(buckets) else None


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
