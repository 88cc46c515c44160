"""SPLADE: a sentence-transformers `SparseEncoder` folder (an `MLMTransformer`, then
`SpladePooling`) served as its sparse vectors, as `SparseEncoder.encode` computes them: the
masked-language-model head's logits of every token (a vocabulary-wide row each), then
log(1 + ReLU(logit)) (log1p twice for `log1p_relu`), then the largest (or the sum) over the
input's tokens, special tokens included; the non-zero entries are the vector, by token id.

The encoder runs as an embedder's does (the padding-free pass, or transformers' padded one);
the head runs on the pass's token states in the model thread, beside the pass, so warmup warms
it with every planned shape. A vocabulary-wide row per token is 120 KB for BERT's 30,522 ids:
the logits are made CHUNK tokens at a time across the batch's inputs (about 60 MB), never for
a whole batch at once.

The MLM head's weights are read from the checkpoint by their names in the family's
`*ForMaskedLM` (BERT's `cls.predictions`, RoBERTa's and XLM-R's `lm_head`, DistilBERT's
`vocab_*`); the decoder's matrix is the word embeddings where the checkpoint ties them (it then
holds no copy).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from . import checkpoint
from .errors import weight_names
from .model_folder import ModelConfigError, SpladeSettings
from .multi import MultiOutput

CHUNK = 512
"""Tokens whose vocabulary-wide logits are made at once."""

_GELU = {"gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
         "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}  # fmt: skip


@dataclass(frozen=True)
class _Names:
    """Where a family's `*ForMaskedLM` keeps its MLM head."""

    prefix: str
    """The base model's weights' prefix in such a checkpoint."""
    dense: str
    norm: str
    decoder: str
    biases: tuple[str, ...]
    """The decoder's bias, under each name the family's checkpoints have used."""
    activation_key: str | None
    """config.json's key naming the head's activation (None: GELU always, RoBERTa's)."""
    eps_key: str | None
    """config.json's key of the head's LayerNorm epsilon (None: 1e-12, DistilBERT's)."""


_BERT = _Names("bert.", "cls.predictions.transform.dense", "cls.predictions.transform.LayerNorm",
               "cls.predictions.decoder", ("cls.predictions.bias", "cls.predictions.decoder.bias"),
               "hidden_act", "layer_norm_eps")  # fmt: skip
_ROBERTA = _Names("roberta.", "lm_head.dense", "lm_head.layer_norm", "lm_head.decoder",
                  ("lm_head.bias", "lm_head.decoder.bias"), None, "layer_norm_eps")  # fmt: skip
_DISTILBERT = _Names("distilbert.", "vocab_transform", "vocab_layer_norm", "vocab_projector",
                     ("vocab_projector.bias",), "activation", None)  # fmt: skip
HEADS = {"bert": _BERT, "roberta": _ROBERTA, "xlm-roberta": _ROBERTA, "camembert": _ROBERTA,
         "distilbert": _DISTILBERT}  # fmt: skip
"""config.json model types whose MLM head this module reads."""


@dataclass(frozen=True)
class MlmHead:
    """The MLM head's weights (float32): dense -> activation -> LayerNorm -> decoder."""

    dense: tuple[torch.Tensor, torch.Tensor]
    activation: Any
    norm: tuple[torch.Tensor, torch.Tensor]
    eps: float
    decoder: torch.Tensor
    """(vocabulary, hidden)."""
    bias: torch.Tensor

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        x = self.activation(F.linear(x, *self.dense))
        x = F.layer_norm(x, x.shape[-1:], *self.norm, self.eps)
        return F.linear(x, self.decoder, self.bias)


def read_head(
    folder: Path,
    config: Mapping[str, Any],
    device: torch.device,
    embeddings: torch.Tensor | None = None,
) -> MlmHead:
    """The MLM head of the checkpoint in `folder` (config.json is `config`), or
    ModelConfigError naming what is missing. `embeddings`: the encoder's word embeddings as
    loaded; where config.json ties the decoder to them (transformers' *ForMaskedLM then reads
    them, whatever decoder weight the checkpoint also holds) and they are float32 on `device`,
    the decoder is that tensor, not a second copy of it (BERT's vocabulary: 94 MB)."""
    model_type = config.get("model_type")
    names = HEADS.get(str(model_type))
    if names is None:
        raise ModelConfigError(
            f"a SparseEncoder of model type {model_type!r}: this server reads the MLM head of "
            f"{', '.join(sorted(HEADS))} only"
        )

    def both(name: str) -> tuple[str, ...]:
        return tuple(f"{name}.{kind}" for kind in ("weight", "bias", "gamma", "beta"))

    word = f"{names.prefix}embeddings.word_embeddings.weight"
    tied = config.get("tie_word_embeddings", True) is not False
    shared = (
        embeddings
        if tied
        and embeddings is not None
        and embeddings.dtype == torch.float32
        and embeddings.device == device
        else None
    )
    wanted = {*both(names.dense), *both(names.norm), *names.biases}
    if shared is None:
        wanted |= {f"{names.decoder}.weight", word}
    try:
        state = checkpoint.load_some(folder, wanted)
    except checkpoint.NoCheckpoint as exc:
        raise ModelConfigError(str(exc)) from None

    def pair(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        weight = state.get(f"{name}.weight", state.get(f"{name}.gamma"))
        bias = state.get(f"{name}.bias", state.get(f"{name}.beta"))
        if weight is None or bias is None:
            raise ModelConfigError(
                f"a SparseEncoder's checkpoint lacks its MLM head: {name}.weight and "
                f"{name}.bias ({names.prefix.rstrip('.')}'s *ForMaskedLM names)"
            )
        return weight.float().to(device), bias.float().to(device)

    decoder = shared if shared is not None else state.get(f"{names.decoder}.weight")
    if decoder is None and tied:
        decoder = state.get(word)
    bias = next((state[name] for name in names.biases if name in state), None)
    if decoder is None or bias is None:
        absent = [f"{names.decoder}.weight"] * (decoder is None) + [names.biases[0]] * (
            bias is None
        )
        raise ModelConfigError(
            f"a SparseEncoder's checkpoint lacks its MLM decoder: {weight_names(absent)}"
        )
    hidden = int(config.get("dim") or config.get("hidden_size") or decoder.shape[1])
    act_name = str(config.get(names.activation_key, "gelu")) if names.activation_key else "gelu"
    activation = _GELU.get(act_name)
    if activation is None:
        raise ModelConfigError(f"config.json: the MLM head's activation {act_name!r} is not GELU")
    head = MlmHead(
        dense=pair(names.dense),
        activation=activation,
        norm=pair(names.norm),
        eps=float(config.get(names.eps_key, 1e-12)) if names.eps_key else 1e-12,
        decoder=decoder.float().to(device),
        bias=bias.float().to(device),
    )
    if head.dense[0].shape != (hidden, hidden) or head.decoder.shape[1] != hidden:
        raise ModelConfigError(
            f"a SparseEncoder's MLM head of {tuple(head.dense[0].shape)} and decoder "
            f"{tuple(head.decoder.shape)} does not take the encoder's {hidden}-wide states"
        )
    return head


class SpladeHead:
    """The sparse vectors of a SparseEncoder, from the pass's token states: per input a
    multi.MultiOutput whose token_ids and token_weights are the vector's non-zero ids and
    their weights (no dense vector; /embed_sparse renders them)."""

    unused = np.zeros(0, dtype=np.int64)
    """Ids left out of the vector: none (a SPLADE vector weighs the special tokens' ids too)."""

    def __init__(self, head: MlmHead, settings: SpladeSettings, device: torch.device) -> None:
        self.head = head
        self.settings = settings
        self.device = device
        self.vocabulary = int(head.decoder.shape[0])

    def __call__(
        self, states: Sequence[np.ndarray], batch: Sequence[Sequence[int]]
    ) -> list[MultiOutput]:
        with torch.inference_mode():
            return self._outputs(states)

    def _outputs(self, states: Sequence[np.ndarray]) -> list[MultiOutput]:
        """The batch's tokens CHUNK at a time across inputs (one matrix product per chunk, not
        per input), each token's weights reduced into its input's row."""
        lengths = torch.tensor([len(rows) for rows in states])
        x = torch.from_numpy(np.concatenate(states) if len(states) > 1 else states[0])
        x = x.to(self.device, torch.float32)
        owner = torch.repeat_interleave(torch.arange(len(states)), lengths).to(self.device)
        total = torch.zeros(len(states), self.vocabulary, device=self.device)
        for start in range(0, x.shape[0], CHUNK):
            weights = torch.log1p(torch.relu(self.head.logits(x[start : start + CHUNK])))
            if self.settings.activation == "log1p_relu":
                weights = torch.log1p(weights)
            rows = owner[start : start + CHUNK]
            if self.settings.pooling == "max":  # weights are >= 0, so a zero start is neutral
                total.scatter_reduce_(0, rows[:, None].expand_as(weights), weights, "amax")
            else:
                total.index_add_(0, rows, weights)
        out = []
        for row in total:
            ids = torch.nonzero(row).squeeze(-1)
            out.append(
                MultiOutput(
                    dense=np.zeros(0, dtype=np.float32),
                    token_ids=ids.cpu().numpy().astype(np.int64),
                    token_weights=row[ids].cpu().numpy(),
                    colbert=None,
                )
            )
        return out
