"""Padding-free forward pass for BERT-family encoders (all-MiniLM, bge, e5, ...) on a CPU.

A padded batch of n inputs at bucket L costs n x L tokens in every linear layer, which is where
almost all of the work is (about 21 of MiniLM's 22 MFLOP per token). Here the linear layers and
layer norms run on the real tokens only, packed into one (tokens, hidden) matrix; only attention
sees the padded (n, heads, L, head) layout, with padded keys masked. The query, key and value
projections are fused into one matrix multiplication. Same weights, same maths as the Hugging
Face forward pass (tests compare both with sentence-transformers), less work.

The weights come straight from the model folder (`config.json` and `model.safetensors`), so a
BERT-family model starts without importing transformers' modeling stack (several seconds of CPU
per pod start), or from an already loaded Hugging Face model.

Only on the CPU: on a GPU a matrix multiplication of a new row count is a new kernel choice,
and the warmed shapes must be the shapes that run. On the CPU the row count picks no kernel;
`make bench-server` probes token counts the warmup never ran (docs/benchmarks.md).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def supports_config(config: Mapping[str, Any]) -> str | None:
    """None when a model with this config.json can run packed, else why not."""
    if config.get("model_type") != "bert":
        return f"model type {config.get('model_type')!r} is not bert"
    if config.get("position_embedding_type", "absolute") != "absolute":
        return f"position embeddings {config['position_embedding_type']!r} are not absolute"
    if config.get("is_decoder"):
        return "a decoder"
    if config.get("hidden_act", "gelu") not in _ACTIVATIONS:
        return f"activation {config.get('hidden_act')!r} is not one of {', '.join(_ACTIVATIONS)}"
    return None


@dataclass(frozen=True)
class _Layer:
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor
    out_weight: torch.Tensor
    out_bias: torch.Tensor
    out_norm: tuple[torch.Tensor, torch.Tensor]
    inner_weight: torch.Tensor
    inner_bias: torch.Tensor
    output_weight: torch.Tensor
    output_bias: torch.Tensor
    output_norm: tuple[torch.Tensor, torch.Tensor]


class PackedBert:
    """A BERT encoder's weights and its padding-free forward pass (call it in inference mode)."""

    def __init__(self, state: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> None:
        why_not = supports_config(config)
        if why_not is not None:
            raise ValueError(f"cannot run this model packed: {why_not}")
        state = _canonical(state)
        self.hidden = int(config["hidden_size"])
        self.heads = int(config["num_attention_heads"])
        self.head_size = self.hidden // self.heads
        self.eps = float(config.get("layer_norm_eps", 1e-12))
        self.activation = _ACTIVATIONS[config.get("hidden_act", "gelu")]
        self.max_positions = int(config.get("max_position_embeddings", 512))
        try:
            self.word = state["embeddings.word_embeddings.weight"]
            self.position = state["embeddings.position_embeddings.weight"]
            self.token_type = state["embeddings.token_type_embeddings.weight"][0]
            self.embedding_norm = _norm(state, "embeddings.LayerNorm")
            self.layers = [
                _layer(state, f"encoder.layer.{index}.")
                for index in range(int(config["num_hidden_layers"]))
            ]
        except KeyError as exc:
            raise ValueError(f"cannot run this model packed: no weight {exc}") from None

    @classmethod
    def from_model(cls, model: Any) -> PackedBert:
        """From a loaded Hugging Face BertModel (its weights, not copies, except fused QKV)."""
        return cls(dict(model.state_dict()), model.config.to_dict())

    @classmethod
    def from_folder(cls, folder: Path, dtype: torch.dtype) -> PackedBert:
        """From `config.json` and `model.safetensors`; ValueError says why it cannot."""
        try:
            config = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read config.json: {exc}") from None
        why_not = supports_config(config)
        if why_not is not None:
            raise ValueError(f"cannot run this model packed: {why_not}")
        weights = folder / "model.safetensors"
        if not weights.is_file():
            raise ValueError("cannot run this model packed: no model.safetensors")
        from safetensors.torch import load_file

        state = {key: value.to(dtype) for key, value in load_file(str(weights)).items()}
        return cls(state, config)

    def __call__(
        self, batch: Sequence[Sequence[int]], seq_len: int, rows: int, pooling: str
    ) -> torch.Tensor:
        """Pooled (len(batch), hidden) float32 for `batch` laid out as `rows` x `seq_len`
        (`pooling` "none": (real tokens, hidden), the inputs' tokens one after another).

        Rows past len(batch) are padding rows of one token each (the first token of the first
        input), so attention runs at exactly the planned (rows, seq_len) shape.
        """
        count = len(batch)
        lengths = np.fromiter(map(len, batch), dtype=np.int64, count=count)
        if count < rows:
            batch = [*batch, *([batch[0][:1]] * (rows - count))]
            lengths = np.concatenate([lengths, np.ones(rows - count, dtype=np.int64)])
        starts = np.zeros(rows, dtype=np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        total = int(lengths.sum())
        row_of = np.repeat(np.arange(rows), lengths)
        position = np.arange(total) - starts[row_of]
        slot = torch.from_numpy(row_of * seq_len + position)  # index into (rows * seq_len)
        token_ids = torch.from_numpy(np.fromiter(chain.from_iterable(batch), np.int64, total))
        keys = torch.from_numpy(np.arange(seq_len)[None, :] < lengths[:, None])
        keys = keys[:, None, None, :]  # (rows, 1, 1, seq_len): which keys each row attends

        x = self.word[token_ids] + self.position[torch.from_numpy(position)] + self.token_type
        x = self._norm(x, self.embedding_norm)
        for layer in self.layers:
            x = self._layer(layer, x, slot, keys, rows, seq_len)

        real = int(starts[count - 1] + lengths[count - 1])
        x = x[:real]
        if pooling == "none":  # every real token's state, input after input
            return x.float()
        if pooling == "cls":
            return x[torch.from_numpy(starts[:count])].float()
        if pooling == "last":
            return x[torch.from_numpy(starts[:count] + lengths[:count] - 1)].float()
        sums = x.new_zeros(count, self.hidden).index_add_(0, torch.from_numpy(row_of[:real]), x)
        return (sums / torch.from_numpy(lengths[:count]).to(x.dtype)[:, None]).float()

    def _norm(self, x: torch.Tensor, norm: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.layer_norm(x, (self.hidden,), norm[0], norm[1], self.eps)

    def _layer(
        self,
        layer: _Layer,
        x: torch.Tensor,
        slot: torch.Tensor,
        keys: torch.Tensor,
        rows: int,
        seq_len: int,
    ) -> torch.Tensor:
        heads, size = self.heads, self.head_size
        qkv = F.linear(x, layer.qkv_weight, layer.qkv_bias)
        padded = qkv.new_zeros(rows * seq_len, qkv.shape[1])
        padded[slot] = qkv
        q, k, v = padded.view(rows, seq_len, 3, heads, size).permute(2, 0, 3, 1, 4)
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=keys)
        context = context.transpose(1, 2).reshape(rows * seq_len, heads * size)[slot]
        attended = F.linear(context, layer.out_weight, layer.out_bias) + x
        attended = self._norm(attended, layer.out_norm)
        inner = self.activation(F.linear(attended, layer.inner_weight, layer.inner_bias))
        output = F.linear(inner, layer.output_weight, layer.output_bias)
        return self._norm(output + attended, layer.output_norm)


def _canonical(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """BertModel key names: no `bert.` prefix (BertFor* checkpoints), LayerNorm weight/bias
    rather than the old gamma/beta."""
    out = {}
    for key, value in state.items():
        key = key.removeprefix("bert.")
        if key.endswith(".gamma"):
            key = key.removesuffix(".gamma") + ".weight"
        elif key.endswith(".beta"):
            key = key.removesuffix(".beta") + ".bias"
        out[key] = value.detach()
    return out


def _norm(state: Mapping[str, torch.Tensor], prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
    return state[prefix + ".weight"], state[prefix + ".bias"]


def _layer(state: Mapping[str, torch.Tensor], prefix: str) -> _Layer:
    own = prefix + "attention.self."
    return _Layer(
        qkv_weight=torch.cat([state[own + name + ".weight"] for name in ("query", "key", "value")]),
        qkv_bias=torch.cat([state[own + name + ".bias"] for name in ("query", "key", "value")]),
        out_weight=state[prefix + "attention.output.dense.weight"],
        out_bias=state[prefix + "attention.output.dense.bias"],
        out_norm=_norm(state, prefix + "attention.output.LayerNorm"),
        inner_weight=state[prefix + "intermediate.dense.weight"],
        inner_bias=state[prefix + "intermediate.dense.bias"],
        output_weight=state[prefix + "output.dense.weight"],
        output_bias=state[prefix + "output.dense.bias"],
        output_norm=_norm(state, prefix + "output.LayerNorm"),
    )
