"""The shape a model runs, and the warmup plan: which shapes a configuration can produce."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple


class Shape(NamedTuple):
    """The padded tensor the model runs: `batch_size` rows of `seq_len` tokens."""

    batch_size: int
    seq_len: int

    @property
    def key(self) -> str:
        """The name used in metrics labels, maps and messages, e.g. "8x64"."""
        return f"{self.batch_size}x{self.seq_len}"

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len

    def as_json(self) -> dict[str, int]:
        return {"batch_size": self.batch_size, "seq_len": self.seq_len}

    @classmethod
    def from_json(cls, item: Mapping[str, Any]) -> Shape:
        """`{"batch_size": 8, "seq_len": 64}`; ValueError unless both are positive integers."""
        batch_size, seq_len = item.get("batch_size"), item.get("seq_len")
        for value in (batch_size, seq_len):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"batch_size and seq_len must be positive integers: {item!r}")
        return cls(batch_size, seq_len)


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
