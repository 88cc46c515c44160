"""warmgate's own padding-free pass (models/: the BERT family, Qwen3, EmbeddingGemma): the
linear layers on the real tokens only, pooled by head.py on the packed states."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from warmgate_contract.shapes import Shape

from .base import StaticForward, per_input, pool_starts, torch_threads

if TYPE_CHECKING:
    from ..head import Head
    from ..models import PackedEncoder
    from ..models.classify import SequenceClassifier


class PackedBackend:
    name = "packed"

    def __init__(
        self, encoder: PackedEncoder, head: Head, classifier: SequenceClassifier | None = None
    ) -> None:
        self.encoder = encoder
        self.head = head
        self.classifier = classifier
        """A re-ranker's or classifier's head (models/classify.py): each input's logits,
        whatever `pool` asks."""

    @property
    def attention(self) -> str:
        return "variable-length (flash)" if self.encoder.varlen is not None else "padded keys"

    @property
    def layer_count(self) -> int | None:
        return len(self.encoder.kernels.first.layers)

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
        with torch_threads(threads), torch.inference_mode():
            states, starts, lengths = self.encoder.encode(
                batch, shape.seq_len, shape.batch_size, layers
            )
            if self.classifier is not None:
                return self.classifier(states, starts, batch).cpu().numpy()
            if not pool:  # every real token's state, input after input
                return per_input(states.float().cpu().numpy(), batch)
            pool_from = pool_starts(batch)
            return self.head.packed(states, starts, lengths, pool_from).cpu().numpy()

    def route(self, shape: Shape, worker: int, pool: bool) -> str:
        return "eager"

    def warm_kernels(self, threads: int | None) -> int:
        """On a CPU, oneDNN's primitives for every row count a batch can bring (a batch's rows
        are its real tokens, which the planned shapes do not cover); a GPU has none to make."""
        if self.encoder.device.type != "cpu":
            return 0
        from ..models.linear import warm

        with torch_threads(threads):
            return warm(self.encoder.kernels)

    def static_forward(self) -> StaticForward | None:
        if self.classifier is not None:  # a pair's token types are no input of the capture
            return None
        encoder, head = self.encoder, self.head

        def packed_forward(
            ids: torch.Tensor, mask: torch.Tensor, pool_mask: torch.Tensor
        ) -> torch.Tensor:
            return head.padded(encoder.dense(ids, mask), pool_mask)

        return packed_forward

    def details(self) -> dict[str, object]:
        return {"linear": self.encoder.kernels.as_json()}
