"""--backend onnxruntime: the transformers model exported to ONNX (ort_export.py) and run
padded by ONNX Runtime, on the CPU.

The export is the warmup's first step (Workers.export_onnx), so it counts in warmup_seconds;
until then the padded pass runs the torch model. Once exported, the torch model is let go
(LoadedModel.release_model): the weights are held once, by ONNX Runtime.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from warmgate_contract.shapes import Shape

from .base import StaticForward, fill_padded, per_input

if TYPE_CHECKING:
    from ..head import Head
    from ..loading import LoadedModel
    from .ort_export import OrtModel
    from .transformers import TransformersBackend


class OrtBackend:
    name = "padded"
    layer_count = None

    def __init__(self, loaded: LoadedModel, head: Head) -> None:
        from .transformers import TransformersBackend

        self.loaded = loaded
        self.head = head
        self.exported: OrtModel | None = None
        """The model in ONNX Runtime, once `export` ran."""
        self._torch: TransformersBackend | None = TransformersBackend(loaded, head)
        """The torch model's padded pass, until the export."""

    @property
    def attention(self) -> str:
        return "ONNX Runtime's" if self.exported is not None else "the model's own"

    def export(
        self,
        solo_threads: int,
        cache: Path | None = None,
        before_export: Callable[[], None] | None = None,
    ) -> float:
        """Export the model (or open its export in `cache`) and open its ONNX Runtime
        sessions, one for a model worker's threads and one for solo batches'; from then on
        every pass runs there and the torch model is let go. Returns the seconds taken."""
        import torch

        from .ort_export import export

        loaded = self.loaded
        threads = torch.get_num_threads()  # a model worker's (load_model set it)
        self.exported = export(
            loaded.model, loaded.uses_token_type_ids, threads, solo_threads, cache, before_export
        )
        self._torch = None
        loaded.release_model()
        return self.exported.export_seconds

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
        """`threads`: ONNX Runtime's session for that many threads (None: the worker's)."""
        import torch

        if self.exported is None:
            assert self._torch is not None
            return self._torch.forward(
                batch, shape, worker=worker, pool=pool, threads=threads, layers=layers
            )
        count = len(batch)
        ids, mask, pool_mask = (np.empty(shape, dtype=np.int64) for _ in range(3))
        fill_padded(batch, ids, mask, pool_mask, self.loaded.pad_token_id, self.loaded.cls_token_id)
        hidden = torch.from_numpy(self.exported.run(ids, mask, threads)[:count])
        with torch.inference_mode():
            if not pool:
                states = [hidden[row, : len(tokens)] for row, tokens in enumerate(batch)]
                return per_input(torch.cat(states).numpy(), batch)
            return self.head.padded(hidden, torch.from_numpy(pool_mask[:count])).numpy()

    def route(self, shape: Shape, worker: int, pool: bool) -> str:
        return "eager"

    def warm_kernels(self, threads: int | None) -> int:
        return 0

    def static_forward(self) -> StaticForward | None:
        return None  # ONNX Runtime runs on the CPU, where no CUDA graph is captured

    def details(self) -> dict[str, object]:
        exported = self.exported
        if exported is None:
            return {}
        return {
            "onnxruntime": {
                "export_seconds": round(exported.export_seconds, 2),
                "session_threads": list(exported.thread_counts),
                "cache": exported.cache,
                "cache_entry": exported.cache_path or None,
            }
        }
