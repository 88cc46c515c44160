"""What every padding-free pass shares, whatever the family (models/bert.py, models/decoder.py):
a batch laid out packed (`Packing`: its real tokens one input after another, and the (rows,
seq_len) layout attention sees), the weights read from the model's folder (`read_folder`), the
refusal of a checkpoint of another architecture, and torch's variable-length (flash) attention
where it runs.

On a CPU attention sees a padded (n, heads, L', head) layout, with padded keys masked, L' the
batch's longest input rounded up to ATTENTION_ALIGN (not the bucket: a CPU picks no kernel per
shape, and the padded keys' work grows with the square of L'); on a CUDA device in half
precision variable-length attention runs on the packed tokens, so nothing is padded at all.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import checkpoint


class CheckpointMismatch(ValueError):
    """The weights are not this architecture's: some missing (`missing`: the pass would run
    with random weights there), or some left unused (it would run without them)."""

    def __init__(self, message: str, missing: bool) -> None:
        super().__init__(message)
        self.missing = missing


ATTENTION_ALIGN = 8
"""On a CPU, attention's padded length is the batch's longest input rounded up to this."""


@dataclass(frozen=True)
class Packing:
    """A batch laid out for a padding-free pass: its tokens one input after another, and the
    (rows, seq_len) layout attention sees."""

    count: int
    """Inputs of the batch (rows past it are padding rows)."""
    rows: int
    seq_len: int
    uniform: bool
    """Every row of one length: attention runs on the packed tokens' own layout."""
    lengths: np.ndarray
    starts: np.ndarray
    total: int
    row_of: np.ndarray
    """Each packed token's row."""
    position: np.ndarray
    """Each packed token's index in its input."""
    token_ids: np.ndarray

    @classmethod
    def of(cls, batch: Sequence[Sequence[int]], seq_len: int, rows: int, own_rows: bool) -> Packing:
        """`own_rows` (a CPU's padded keys): attention runs over the batch's own rows, padded
        to its longest input rounded up to ATTENTION_ALIGN rather than the bucket (the padded
        keys' work grows with the square of the padded length and is masked away, and a CPU
        chooses no kernel per shape), and inputs all of one length (a lone input above all)
        are not padded at all. Otherwise the planned (rows, seq_len), the rows past the batch
        one token each (the first token of the first input)."""
        count = len(batch)
        lengths = np.fromiter(map(len, batch), dtype=np.int64, count=count)
        uniform = False
        if own_rows:
            rows = count
            longest = int(lengths.max()) if count else 1
            uniform = count > 0 and int(lengths.min()) == longest
            seq_len = (
                longest
                if uniform
                else min(seq_len, -(-longest // ATTENTION_ALIGN) * ATTENTION_ALIGN)
            )
        if count < rows:
            batch = [*batch, *([batch[0][:1]] * (rows - count))]
            lengths = np.concatenate([lengths, np.ones(rows - count, dtype=np.int64)])
        starts = np.zeros(rows, dtype=np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        total = int(lengths.sum())
        row_of = np.repeat(np.arange(rows), lengths)
        return cls(
            count=count,
            rows=rows,
            seq_len=seq_len,
            uniform=uniform,
            lengths=lengths,
            starts=starts,
            total=total,
            row_of=row_of,
            position=np.arange(total) - starts[row_of],
            token_ids=np.fromiter(chain.from_iterable(batch), np.int64, total),
        )

    def bounds(self) -> np.ndarray:
        """The rows' cumulative token offsets (rows + 1, int32), as variable-length attention
        takes them."""
        return np.append(self.starts, self.total).astype(np.int32)

    def slots(self) -> np.ndarray:
        """Where each packed token sits in the padded (rows * seq_len) layout."""
        return self.row_of * self.seq_len + self.position

    def keys(self) -> np.ndarray:
        """Which keys each row attends in the padded layout: (rows, 1, 1, seq_len)."""
        return (np.arange(self.seq_len)[None, :] < self.lengths[:, None])[:, None, None, :]

    def packed_states(self, x: torch.Tensor) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        """The batch's own inputs' states of a pass's (tokens, hidden) `x` (the padding rows'
        left out), with each input's start and length."""
        real = int(self.starts[self.count - 1] + self.lengths[self.count - 1])
        return x[:real], self.starts[: self.count], self.lengths[: self.count]


def on_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array as a tensor on `device` (on a CPU, the same memory)."""
    tensor = torch.from_numpy(array)
    return tensor if device.type == "cpu" else tensor.to(device, non_blocking=True)


def read_folder(
    folder: Path,
    supports: Callable[[Mapping[str, Any]], str | None],
    dtype: torch.dtype,
    device: torch.device | str,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A model folder's checkpoint on `device` in `dtype`, and its config.json, where
    `supports` finds nothing against the config; else ValueError saying why."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read config.json: {exc}") from None
    why_not = supports(config)
    if why_not is not None:
        raise ValueError(f"cannot run this model packed: {why_not}")
    try:
        weights = checkpoint.load(folder)
    except checkpoint.NoCheckpoint as exc:
        raise ValueError(f"cannot run this model packed: {exc}") from None
    state = {key: value.to(device=device, dtype=dtype) for key, value in weights.items()}
    del weights
    return state, config


def varlen_attention(device: torch.device, dtype: torch.dtype) -> Callable[..., Any] | None:
    """torch's variable-length flash attention where it runs: CUDA, half precision."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch before 2.9: padded keys, as on a CPU
        return None
    return varlen_attn
