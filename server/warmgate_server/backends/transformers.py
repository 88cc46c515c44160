"""transformers' own forward pass (AutoModel), run padded: the backend of every model
warmgate has no padding-free pass for, and of `--packing off`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from warmgate_contract.shapes import Shape

from ..model_folder import EMBED
from .base import StaticForward, fill_padded, per_input, torch_threads

if TYPE_CHECKING:
    from ..head import Head
    from ..loading import LoadedModel


def token_types(batch: Sequence[Sequence[int]], shape: Shape) -> np.ndarray:
    """(rows, seq_len) token type ids: 1 from each pair's second text on (TokenIds.type_from),
    else 0."""
    types = np.zeros(shape, dtype=np.int64)
    for row, tokens in enumerate(batch):
        start = getattr(tokens, "type_from", None)
        if start is not None:
            types[row, start : len(tokens)] = 1
    return types


class TransformersBackend:
    name = "padded"
    attention = "the model's own"
    layer_count = None

    def __init__(self, loaded: LoadedModel, head: Head) -> None:
        if loaded.model is None:
            raise ValueError("the padded forward pass needs a model loaded with --packing off")
        self.model: Any = loaded.model
        self.uses_token_type_ids = loaded.uses_token_type_ids
        self.device = loaded.device
        self.pad_token_id = loaded.pad_token_id
        self.filler_token_id = loaded.cls_token_id
        self.head = head
        self.scores = loaded.task != EMBED
        """A re-ranker or classifier: each input's logits, whatever `pool` asks."""

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
        """The whole pass (`layers` is the packed pass's), on `threads` torch threads."""
        with torch_threads(threads):
            count = len(batch)
            ids, mask, pool_mask = (np.empty(shape, dtype=np.int64) for _ in range(3))
            fill_padded(batch, ids, mask, pool_mask, self.pad_token_id, self.filler_token_id)
            device = self.device
            inputs = {
                "input_ids": torch.from_numpy(ids).to(device),
                "attention_mask": torch.from_numpy(mask).to(device),
            }
            if self.uses_token_type_ids:
                inputs["token_type_ids"] = torch.from_numpy(token_types(batch, shape)).to(device)
            with torch.inference_mode():
                output = self.model(**inputs)
                if self.scores:  # (inputs, labels): the head's logits, before any activation
                    return output.logits[:count].float().cpu().numpy()
                hidden = output[0][:count].float()
                if not pool:
                    states = [hidden[row, : len(tokens)] for row, tokens in enumerate(batch)]
                    return per_input(torch.cat(states).cpu().numpy(), batch)
                # Inputs are right-padded: "last" is each row's last real token.
                pooled = self.head.padded(hidden, torch.from_numpy(pool_mask[:count]).to(device))
                # .cpu() waits for the device, so the timing covers the whole forward pass.
                return pooled.cpu().numpy()

    def route(self, shape: Shape, worker: int, pool: bool) -> str:
        return "eager"

    def warm_kernels(self, threads: int | None) -> int:
        return 0

    def static_forward(self) -> StaticForward | None:
        if self.scores:  # a pair's token types are no input of the captured pass
            return None
        model, head, uses_token_types = self.model, self.head, self.uses_token_type_ids

        def model_forward(
            ids: torch.Tensor, mask: torch.Tensor, pool_mask: torch.Tensor
        ) -> torch.Tensor:
            inputs = {"input_ids": ids, "attention_mask": mask}
            if uses_token_types:
                inputs["token_type_ids"] = torch.zeros_like(ids)
            return head.padded(model(**inputs)[0], pool_mask)

        return model_forward

    def details(self) -> dict[str, object]:
        return {}
