"""post: a request's answer from the outputs its batches left, per input. The model's module
chain (pooling, Dense, the folder's inner Normalize: head.py) already ran in the model thread,
batch by batch; what differs between requests sharing a batch is done here: Matryoshka
`dimensions`, the request's `normalize`, and sentence similarity. Pure numpy."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .schemas import EmbedRequest, Output


def normalized(vectors: np.ndarray) -> np.ndarray:
    """Each row scaled to unit L2 length (a zero row stays zero)."""
    norms = np.linalg.norm(vectors, axis=-1, keepdims=True)
    return vectors / np.maximum(norms, 1e-12)


def finish_vectors(vectors: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
    """Keep the first `dimensions` components (Matryoshka-style), then L2-normalise if asked."""
    if dimensions is not None:
        vectors = vectors[:, :dimensions]
    return normalized(vectors) if normalize else vectors


def dense_of(output: object) -> np.ndarray:
    """An input's pooled vector: the output itself, or the dense one of bge-m3's pass
    (multi.MultiOutput)."""
    return output if isinstance(output, np.ndarray) else output.dense  # type: ignore[attr-defined]


def finish(outputs: Sequence[np.ndarray], request: EmbedRequest) -> np.ndarray | list[np.ndarray]:
    """What `request` asked for, from its outputs in input order (pooled vectors, or token
    states for Output.TOKENS): (inputs, dims) vectors, per input its (tokens, hidden) states,
    or the first input's cosine similarity with each of the others."""
    if request.output is Output.TOKENS:
        return [normalized(states) for states in outputs] if request.normalize else list(outputs)
    if request.output is Output.MULTI:  # multi.MultiOutput per input: the route renders them
        return list(outputs)
    outputs = [dense_of(output) for output in outputs]
    vectors = np.stack(outputs)
    if request.output is Output.SCORES:
        return vectors
    if request.output is Output.SIMILARITY:
        unit = normalized(vectors)
        return unit[1:] @ unit[0]
    return finish_vectors(vectors, request.dimensions, request.normalize)
