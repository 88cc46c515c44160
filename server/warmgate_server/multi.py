"""bge-m3's three outputs from one forward pass: the dense vector (the model's own module chain,
head.py), the lexical weights (`sparse_linear.pt`) and the ColBERT vectors
(`colbert_linear.pt`), as FlagEmbedding's `BGEM3FlagModel.encode` computes them:

- sparse: each token's weight is ReLU(sparse_linear(state)); a token id's weight is the largest
  of its tokens' weights; the tokenizer's cls, eos, pad and unk tokens and zero weights are left
  out;
- colbert: colbert_linear of every token's state but the first (CLS), L2-normalised per token.

For a model with these heads every batch runs the same pass (runner.py): the token states once,
then all three outputs in the model thread, so a request for the dense vector and one for the
sparse weights share batches, and warmup warms what serves them. The heads are two small linear
layers; the sparse weights per id are made per request (routes.py), only for requests that
ask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .head import Head
from .model_folder import ModelConfigError, MultiHeads


@dataclass(frozen=True)
class MultiOutput:
    """One input's outputs (float32, on the host)."""

    dense: np.ndarray
    """(size,): the dense vector as the module chain left it (the request normalises)."""
    token_ids: np.ndarray
    """(tokens,) int64: the input's tokens, for the sparse weights per id."""
    token_weights: np.ndarray | None
    """(tokens,): each token's sparse weight, or None: the model has no sparse head."""
    colbert: np.ndarray | None
    """(tokens - 1, dim): unit ColBERT vectors of every token after the first, or None."""

    def lexical_weights(self, unused: np.ndarray) -> dict[int, float]:
        """{token id: weight} by id: each id's largest weight, the `unused` ids and zero
        weights left out (vectorised: the route makes it on the event loop)."""
        assert self.token_weights is not None
        keep = (self.token_weights > 0) & ~np.isin(self.token_ids, unused)
        ids, inverse = np.unique(self.token_ids[keep], return_inverse=True)
        best = np.zeros(len(ids), dtype=self.token_weights.dtype)
        np.maximum.at(best, inverse, self.token_weights[keep])
        return dict(zip(ids.tolist(), best.tolist(), strict=True))


def _linear(path, hidden: int, out_features: int | None, device: torch.device):
    """(weight, bias) of a torch Linear's state dict saved at `path`, checked against the
    encoder's width."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a pickle torch refuses, a truncated file
        raise ModelConfigError(f"{path.name}: cannot be read as a state dict: {exc}") from None
    if not isinstance(state, dict) or set(state) != {"weight", "bias"}:
        keys = ", ".join(sorted(state)) if isinstance(state, dict) else type(state).__name__
        raise ModelConfigError(
            f"{path.name}: a Linear's weight and bias expected (FlagEmbedding's layout), "
            f"found {keys}"
        )
    weight, bias = state["weight"], state["bias"]
    rows = out_features if out_features is not None else weight.shape[0]
    if tuple(weight.shape) != (rows, hidden) or tuple(bias.shape) != (rows,):
        raise ModelConfigError(
            f"{path.name}: weight {tuple(weight.shape)} and bias {tuple(bias.shape)} do not "
            f"take the encoder's {hidden}-wide token states"
            + (f" to {out_features}" if out_features is not None else "")
        )
    return weight.float().to(device), bias.float().to(device)


class MultiHead:
    """The sparse and ColBERT heads of a bge-m3 folder, beside its dense Head."""

    def __init__(
        self, heads: MultiHeads, dense: Head, hidden: int, device: torch.device, unused: set[int]
    ) -> None:
        self.dense = dense
        self.device = device
        self.unused = np.array(sorted(unused), dtype=np.int64)
        """Token ids the sparse weights leave out (the tokenizer's cls, eos, pad and unk)."""
        sparse, colbert = heads.sparse, heads.colbert
        self.sparse = None if sparse is None else _linear(sparse, hidden, 1, device)
        self.colbert = None if colbert is None else _linear(colbert, hidden, None, device)

    def __call__(
        self, states: Sequence[np.ndarray], batch: Sequence[Sequence[int]]
    ) -> list[MultiOutput]:
        """Every output of each input from its (tokens, hidden) states."""
        with torch.inference_mode():
            return self._outputs(states, batch)

    def _outputs(
        self, states: Sequence[np.ndarray], batch: Sequence[Sequence[int]]
    ) -> list[MultiOutput]:
        lengths = np.fromiter((len(tokens) for tokens in batch), np.int64, len(batch))
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
        x = torch.from_numpy(np.concatenate(states) if len(states) > 1 else states[0])
        x = x.to(self.device)
        pool_from = np.fromiter((getattr(t, "pool_from", 0) for t in batch), np.int64, len(batch))
        dense = self.dense.packed(x, starts, lengths, pool_from if pool_from.any() else None)
        weights = colbert = None
        if self.sparse is not None:
            weights = torch.relu(F.linear(x, *self.sparse)).squeeze(-1).cpu().numpy()
        if self.colbert is not None:
            colbert = F.normalize(F.linear(x, *self.colbert), dim=-1).cpu().numpy()
        dense_rows = dense.cpu().numpy()
        out = []
        for row, (start, length) in enumerate(zip(starts.tolist(), lengths.tolist(), strict=True)):
            end = start + length
            out.append(
                MultiOutput(
                    dense=dense_rows[row],
                    token_ids=np.asarray(batch[row], dtype=np.int64),
                    token_weights=None if weights is None else weights[start:end],
                    colbert=None if colbert is None else colbert[start + 1 : end],
                )
            )
        return out


def unused_ids(tokenizer: object) -> set[int]:
    """The ids FlagEmbedding leaves out of the sparse weights: the tokenizer's cls, eos, pad and
    unk tokens (those it has)."""
    found = (getattr(tokenizer, f"{name}_token_id", None) for name in ("cls", "eos", "pad", "unk"))
    return {int(token) for token in found if token is not None}
