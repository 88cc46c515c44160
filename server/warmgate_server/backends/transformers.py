"""transformers' own forward pass (AutoModel), run padded: the backend of every model
warmgate has no padding-free pass for, and of `--packing off`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from warmgate_contract.shapes import Shape

from .base import StaticForward, fill_padded, per_input, torch_threads

if TYPE_CHECKING:
    from ..head import Head
    from ..loading import LoadedModel


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
                inputs["token_type_ids"] = torch.zeros_like(inputs["input_ids"])
            with torch.inference_mode():
                output = self.model(**inputs)
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

    def static_forward(self) -> StaticForward:
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
