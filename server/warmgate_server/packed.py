"""BERT-family encoders (all-MiniLM, bge, e5, ...) run by warmgate's own forward passes.

A padded batch of n inputs at bucket L costs n x L tokens in every linear layer, which is where
almost all of the work is (about 21 of MiniLM's 22 MFLOP per token). The padding-free pass
(`__call__`) runs the linear layers and layer norms on the real tokens only, packed into one
(tokens, hidden) matrix. Attention on a CPU sees the padded (n, heads, L, head) layout, with
padded keys masked; on a CUDA device in half precision it runs variable-length (flash)
attention on the packed tokens, so nothing is padded at all. The query, key and value
projections are fused into one matrix multiplication. Same weights, same maths as the Hugging
Face forward pass (tests compare both with sentence-transformers), less work.

The static pass (`dense`) takes a padded (rows, L) batch already on the device and pools it
there, with no host synchronisation and no data-dependent shape: that is what a CUDA graph
captures (graphs.py), one per warmed shape.

The weights come straight from the model folder (`config.json` and `model.safetensors`), so a
BERT-family model starts without importing transformers' modeling stack (several seconds of CPU
per pod start), or from an already loaded Hugging Face model.

On a CPU the row count of a matrix multiplication picks no kernel, so the padding-free pass's
varying token counts are warm once its (rows, L) shapes are; `make bench-server` probes token
counts the warmup never ran (docs/benchmarks.md). On a GPU a new row count is a new kernel
choice: there the warmed shapes are served by CUDA graphs, and the padding-free pass serves
what has no graph (`--cuda-graphs off`, or a shape outside the plan).
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
        first = next(iter(state.values()))
        self.device = first.device
        self.dtype = first.dtype
        self.varlen = _varlen_attention(self.device, self.dtype)
        """Variable-length (flash) attention on the packed tokens, or None (padded keys)."""
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
    def from_folder(
        cls, folder: Path, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> PackedBert:
        """From `config.json` and `model.safetensors`, onto `device`; ValueError says why it
        cannot."""
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

        state = {
            key: value.to(device=device, dtype=dtype)
            for key, value in load_file(str(weights)).items()
        }
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
        token_ids = np.fromiter(chain.from_iterable(batch), np.int64, total)
        if self.varlen is not None:
            bounds = np.append(starts, total).astype(np.int32)
            attend = self._varlen_attend(self._on_device(bounds), seq_len)
        else:
            slot = self._on_device(row_of * seq_len + position)  # index into (rows * seq_len)
            keys = self._on_device(np.arange(seq_len)[None, :] < lengths[:, None])
            keys = keys[:, None, None, :]  # (rows, 1, 1, seq_len): which keys each row attends
            attend = self._padded_attend(slot, keys, rows, seq_len)

        x = self.word[self._on_device(token_ids)] + self.position[self._on_device(position)]
        x = self._norm(x + self.token_type, self.embedding_norm)
        for layer in self.layers:
            x = self._layer(layer, x, attend)

        real = int(starts[count - 1] + lengths[count - 1])
        x = x[:real]
        if pooling == "none":  # every real token's state, input after input
            return x.float().cpu()
        if pooling == "cls":
            return x[self._on_device(starts[:count])].float().cpu()
        if pooling == "last":
            return x[self._on_device(starts[:count] + lengths[:count] - 1)].float().cpu()
        rows_of_real = self._on_device(row_of[:real])
        sums = x.new_zeros(count, self.hidden, dtype=torch.float32)
        sums.index_add_(0, rows_of_real, x.float())
        return (sums / self._on_device(lengths[:count]).float()[:, None]).cpu()

    def dense(self, ids: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
        """Pooled (rows, hidden) float32 of a padded (rows, seq_len) batch: token ids and its
        0/1 attention mask, both on the weights' device. Every row needs at least one real
        token. Static shapes and no host synchronisation: a CUDA graph can capture it."""
        rows, seq_len = ids.shape
        x = self.word[ids] + self.position[:seq_len] + self.token_type
        x = self._norm(x, self.embedding_norm).reshape(rows * seq_len, self.hidden)
        keys = mask.bool()[:, None, None, :]
        attend = self._padded_attend(None, keys, rows, seq_len)
        for layer in self.layers:
            x = self._layer(layer, x, attend)
        return pool_padded(x.view(rows, seq_len, self.hidden), mask, pooling)

    def _on_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        return tensor if self.device.type == "cpu" else tensor.to(self.device, non_blocking=True)

    def _padded_attend(
        self, slot: torch.Tensor | None, keys: torch.Tensor, rows: int, seq_len: int
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """Attention in the padded (rows, heads, seq_len, head) layout. `slot`: where each
        packed token sits in it (None: the tokens are already padded, `dense`)."""
        heads, size = self.heads, self.head_size

        def attend(qkv: torch.Tensor) -> torch.Tensor:
            if slot is None:
                padded = qkv
            else:
                padded = qkv.new_zeros(rows * seq_len, qkv.shape[1])
                padded[slot] = qkv
            q, k, v = padded.view(rows, seq_len, 3, heads, size).permute(2, 0, 3, 1, 4)
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=keys)
            context = context.transpose(1, 2).reshape(rows * seq_len, heads * size)
            return context if slot is None else context[slot]

        return attend

    def _varlen_attend(
        self, bounds: torch.Tensor, seq_len: int
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """Variable-length attention on the packed tokens: `bounds` are the rows' cumulative
        token offsets (rows + 1, int32)."""
        heads, size = self.heads, self.head_size
        varlen = self.varlen
        assert varlen is not None

        def attend(qkv: torch.Tensor) -> torch.Tensor:
            q, k, v = (part.contiguous() for part in qkv.view(-1, 3, heads, size).unbind(1))
            context = varlen(q, k, v, bounds, bounds, seq_len, seq_len)
            return context.reshape(-1, heads * size)

        return attend

    def _norm(self, x: torch.Tensor, norm: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.layer_norm(x, (self.hidden,), norm[0], norm[1], self.eps)

    def _layer(
        self, layer: _Layer, x: torch.Tensor, attend: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        context = attend(F.linear(x, layer.qkv_weight, layer.qkv_bias))
        attended = F.linear(context, layer.out_weight, layer.out_bias) + x
        attended = self._norm(attended, layer.out_norm)
        inner = self.activation(F.linear(attended, layer.inner_weight, layer.inner_bias))
        output = F.linear(inner, layer.output_weight, layer.output_bias)
        return self._norm(output + attended, layer.output_norm)


def pool_padded(hidden: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """(rows, hidden) float32 from right-padded (rows, seq_len, hidden) states and their 0/1
    mask: mean over real tokens, the first (cls) or the last real token. No host sync."""
    if pooling == "cls":
        return hidden[:, 0].float()
    if pooling == "last":
        last = mask.sum(dim=1) - 1
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last].float()
    weights = mask.unsqueeze(-1).float()
    return (hidden.float() * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)


def _varlen_attention(device: torch.device, dtype: torch.dtype) -> Callable[..., Any] | None:
    """torch's variable-length flash attention where it runs: CUDA, half precision."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch before 2.9: padded keys, as on a CPU
        return None
    return varlen_attn


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
