"""The backend boundary, as text-embeddings-inference's `backends/core`: a forward pass of the
served model behind one interface (`Backend`), whichever runs it: warmgate's own padding-free
pass (packed.py), transformers' padded one (transformers.py), ONNX Runtime (ort.py), or the
CUDA graphs of the planned shapes around another backend (graphs.py). One is chosen when the
model's runner is built (the registry: backends/__init__.py); the runner above it knows which
shapes ran, not how.

Also the padded layout the padded passes share (`fill_padded`) and how each input's outputs
come back (`per_input`, `pool_starts`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from warmgate_contract.shapes import Shape

if TYPE_CHECKING:
    import torch

StaticForward = Callable[["torch.Tensor", "torch.Tensor", "torch.Tensor"], "torch.Tensor"]
"""(ids, attention mask, pooling mask: (rows, seq_len) int64) on the device -> (rows, size)
float32 finished vectors on the device: a pass with static shapes and no host
synchronisation, which a CUDA graph can capture."""


class Backend(Protocol):
    """One forward path of a loaded model, its pooling and module chain (head.py) included.
    Every method runs in a model thread."""

    @property
    def name(self) -> str:
        """/ready's forward.pass: "packed" (warmgate's padding-free pass) or "padded"."""
        ...

    @property
    def attention(self) -> str:
        """/ready's forward.attention: the attention the pass runs."""
        ...

    @property
    def layer_count(self) -> int | None:
        """The layers `forward(layers=...)` can shorten the pass to, or None: it runs whole."""
        ...

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
        """One batch as `shape` (its first len(batch) rows real inputs) on model worker
        `worker`: pooled, an (inputs, size) float32 array; else each input's (tokens, hidden)
        token states. `threads`: this pass's CPU threads (None: the worker's own); `layers`:
        the first ones only (warmup of a long pass)."""
        ...

    def route(self, shape: Shape, worker: int, pool: bool) -> str:
        """Which of the backend's passes `forward` runs for these: a shape is warm per pass
        (a CUDA graph and the eager pass beside it warm apart)."""
        ...

    def warm_kernels(self, threads: int | None) -> int:
        """Make the pass's kernels for every row count a batch can bring (models/linear.py's
        warm); the row counts run, 0 when there is nothing to make."""
        ...

    def static_forward(self) -> StaticForward | None:
        """The pass a CUDA graph captures, or None: this backend has none."""
        ...

    def details(self) -> dict[str, object]:
        """What /ready's forward report adds for this backend (its linear kernels, its ONNX
        Runtime sessions); empty when nothing."""
        ...


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """This thread's torch threads set to `threads` for the block (its team only: OpenMP's,
    MKL's local), then back; None leaves them."""
    if threads is None:
        yield
        return
    import torch

    own = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(own)


def pool_starts(batch: Sequence[Sequence[int]]) -> np.ndarray | None:
    """Each input's pool_from (pre.TokenIds), or None when every input pools all its tokens."""
    starts = np.fromiter((getattr(ids, "pool_from", 0) for ids in batch), np.int64, len(batch))
    return starts if starts.any() else None


def fill_padded(
    batch: Sequence[Sequence[int]],
    ids: np.ndarray,
    mask: np.ndarray,
    pool_mask: np.ndarray,
    pad_token_id: int,
    filler_token_id: int,
) -> None:
    """Lay `batch` out right-padded in (rows, seq_len) buffers: token ids, the attention mask
    and the pooling mask (the attention mask less each input's pool_from). Rows past the batch
    get one real token, `filler_token_id`: an all-masked row can turn attention into NaN."""
    ids.fill(pad_token_id)
    mask.fill(0)
    for row, tokens in enumerate(batch):
        ids[row, : len(tokens)] = tokens
        mask[row, : len(tokens)] = 1
    ids[len(batch) :, 0] = filler_token_id
    mask[len(batch) :, 0] = 1
    pool_mask[:] = mask
    for row, tokens in enumerate(batch):
        pool_mask[row, : getattr(tokens, "pool_from", 0)] = 0


def per_input(states: np.ndarray, batch: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """(tokens, hidden) states of the batch's inputs one after another, split by input (copied
    to the host in one piece, then cut)."""
    ends = np.cumsum([len(tokens) for tokens in batch])
    return np.split(states, ends[:-1])
