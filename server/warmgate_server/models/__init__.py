"""warmgate's own padding-free encoders, one module per family (bert.py: the BERT family;
decoder.py: Qwen3 and EmbeddingGemma), on what they share (packing.py, linear.py), and the
registry that picks a folder's encoder by its config.json model type (`packed_pass`).

Nothing here knows the server: a model's folder in, its token states out.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    import numpy as np
    import torch

    from .linear import Kept, Kernels


class PackedEncoder(Protocol):
    """What every family's padding-free encoder offers (bert.PackedBert, decoder.PackedDecoder)."""

    device: torch.device
    dtype: torch.dtype
    hidden: int
    max_positions: int
    varlen: Callable[..., torch.Tensor] | None
    """Variable-length (flash) attention on the packed tokens, or None (padded keys)."""
    kernels: Kernels
    """The linear layers' kernel for a pass of a given token count (linear.py)."""

    def encode(
        self, batch: Sequence[Sequence[int]], seq_len: int, rows: int, layers: int | None = None
    ) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        """(real tokens, hidden) last hidden states of `batch`, packed, with each input's start
        and length; `layers`: the first ones only."""
        ...

    def dense(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(rows, seq_len, hidden) last hidden states of a right-padded batch on the device,
        with static shapes and no host synchronisation (what a CUDA graph captures)."""
        ...


def packed_pass(
    path: Path,
    dtype: torch.dtype,
    device: torch.device | str,
    model_type: str | None,
    linear_kernel: str = "auto",
    kept: Kept | None = None,
    largest_rows: int | None = None,
) -> PackedEncoder:
    """warmgate's padding-free pass for the model in `path` whose config.json names
    `model_type`: PackedBert for the BERT family, PackedDecoder for Qwen3 and EmbeddingGemma.
    ValueError says why it cannot run one; packing.CheckpointMismatch, that the weights are not
    the architecture's."""
    from . import bert, decoder  # torch, imported no earlier than a load needs it

    families: dict[str | None, type[bert.PackedBert] | type[decoder.PackedDecoder]] = {
        **dict.fromkeys(bert.MODEL_TYPES, bert.PackedBert),
        **dict.fromkeys(decoder.MODEL_TYPES, decoder.PackedDecoder),
    }
    encoder = families.get(model_type)
    if encoder is None:
        raise ValueError(
            f"cannot run this model packed: model type {model_type!r} is not one of "
            f"{', '.join(map(str, families))}"
        )
    return encoder.from_folder(path, dtype, device, linear_kernel, kept, largest_rows)
