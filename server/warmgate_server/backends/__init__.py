"""The served model's forward paths behind one interface (base.Backend), and the registry that
picks one when a runner is built: the first entry of BACKENDS that serves the loaded model as
the flags ask. A backend module is imported only when it is chosen (they import torch, and
ONNX Runtime's, onnxruntime)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .base import Backend, StaticForward

if TYPE_CHECKING:
    from ..head import Head
    from ..loading import LoadedModel


@dataclass(frozen=True)
class Wanted:
    """What the flags ask of the forward pass."""

    packed: bool = True
    """--packing auto or on: warmgate's padding-free pass where the load made one."""
    engine: str = "torch"
    """--backend: torch or onnxruntime."""


def _onnxruntime(loaded: LoadedModel, head: Head) -> Backend:
    from .ort import OrtBackend

    return OrtBackend(loaded, head)


def _packed(loaded: LoadedModel, head: Head) -> Backend:
    from .packed import PackedBackend

    assert loaded.packed is not None
    return PackedBackend(loaded.packed, head, loaded.classifier)


def _transformers(loaded: LoadedModel, head: Head) -> Backend:
    from .transformers import TransformersBackend

    return TransformersBackend(loaded, head)


@dataclass(frozen=True)
class Entry:
    name: str
    serves: Callable[[LoadedModel, Wanted], bool]
    build: Callable[[LoadedModel, Head], Backend]


BACKENDS = (
    Entry("onnxruntime", lambda loaded, wanted: wanted.engine == "onnxruntime", _onnxruntime),
    Entry("packed", lambda loaded, wanted: wanted.packed and loaded.packed is not None, _packed),
    Entry("transformers", lambda loaded, wanted: True, _transformers),
)
"""In order of preference. The CUDA graphs (graphs.GraphBackend) are no entry: they wrap the
chosen backend once warmup has planned them (Workers)."""


def choose(loaded: LoadedModel, head: Head, wanted: Wanted = Wanted()) -> Backend:
    """The backend that runs `loaded` as `wanted` asks, pooling with `head`. ValueError when
    none can (a padded pass asked of a model loaded packed only)."""
    entry = next(entry for entry in BACKENDS if entry.serves(loaded, wanted))
    return entry.build(loaded, head)


def graph_forward(loaded: LoadedModel, head: Head) -> StaticForward | None:
    """The static forward a CUDA graph captures for this model: warmgate's own for
    BERT-family, Qwen3 and EmbeddingGemma models, else the transformers model's forward pass;
    then `head` (head.py)."""
    return choose(loaded, head).static_forward()


__all__ = ["BACKENDS", "Backend", "StaticForward", "Wanted", "choose", "graph_forward"]
