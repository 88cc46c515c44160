"""Padding-free forward pass for BERT-family encoders (all-MiniLM, bge, e5, ...) on a CPU.

A padded batch of n inputs at bucket L costs n x L tokens in every linear layer, which is where
almost all of the work is (about 21 of MiniLM's 22 MFLOP per token). Here the linear layers and
layer norms run on the real tokens only, packed into one (tokens, hidden) matrix; only attention
sees the padded (n, heads, L, head) layout, with padded keys masked. The query, key and value
projections are fused into one matrix multiplication. Same weights, same maths as the Hugging
Face forward pass (the loader checks the two agree before serving), less work.

Only on the CPU: on a GPU a matrix multiplication of a new row count is a new kernel choice,
and the warmed shapes must be the shapes that run. On the CPU the row count picks no kernel
(the first request of a new token count is no slower than the next; `make bench-server`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F


def supports(model: Any) -> str | None:
    """None when `model` can run packed, else why not."""
    config = model.config
    if getattr(config, "model_type", None) != "bert":
        return f"model type {getattr(config, 'model_type', None)!r} is not bert"
    if getattr(config, "position_embedding_type", "absolute") != "absolute":
        return f"position embeddings {config.position_embedding_type!r} are not absolute"
    if getattr(config, "is_decoder", False):
        return "a decoder"
    if next(model.parameters()).device.type != "cpu":
        return "not on the CPU"
    layer = model.encoder.layer[0] if hasattr(model, "encoder") else None
    parts = (
        "attention.self.query",
        "attention.self.key",
        "attention.self.value",
        "attention.output.dense",
        "attention.output.LayerNorm",
        "intermediate.dense",
        "intermediate.intermediate_act_fn",
        "output.dense",
        "output.LayerNorm",
    )
    for part in parts:
        owner = layer
        for name in part.split("."):
            owner = getattr(owner, name, None)
        if owner is None:
            return f"not the BERT module layout (no encoder.layer[0].{part})"
    return None


class _Layer:
    def __init__(self, layer: Any) -> None:
        attention = layer.attention
        own = attention.self
        self.heads = int(own.num_attention_heads)
        self.head_size = int(own.attention_head_size)
        self.qkv_weight = torch.cat([own.query.weight, own.key.weight, own.value.weight]).detach()
        self.qkv_bias = torch.cat([own.query.bias, own.key.bias, own.value.bias]).detach()
        self.out = attention.output.dense
        self.out_norm = attention.output.LayerNorm
        self.intermediate = layer.intermediate.dense
        self.activation = layer.intermediate.intermediate_act_fn
        self.output = layer.output.dense
        self.output_norm = layer.output.LayerNorm


class PackedBert:
    def __init__(self, model: Any) -> None:
        why_not = supports(model)
        if why_not is not None:
            raise ValueError(f"cannot run this model packed: {why_not}")
        self.embeddings = model.embeddings
        self.layers = [_Layer(layer) for layer in model.encoder.layer]
        self.hidden = int(model.config.hidden_size)

    def __call__(
        self, batch: Sequence[Sequence[int]], seq_len: int, rows: int, pooling: str
    ) -> torch.Tensor:
        """Pooled (len(batch), hidden) float32 for `batch` laid out as `rows` x `seq_len`.

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
        token_ids = torch.from_numpy(np.fromiter(_chain(batch), dtype=np.int64, count=total))
        keys = torch.from_numpy(np.arange(seq_len)[None, :] < lengths[:, None])
        keys = keys[:, None, None, :]  # (rows, 1, 1, seq_len): which keys each row attends

        embeddings = self.embeddings
        x = embeddings.word_embeddings(token_ids)
        x = x + embeddings.position_embeddings(torch.from_numpy(position))
        x = x + embeddings.token_type_embeddings.weight[0]
        x = embeddings.LayerNorm(x)
        for layer in self.layers:
            x = self._layer(layer, x, slot, keys, rows, seq_len)

        x = x[: int(starts[count - 1] + lengths[count - 1])] if count < rows else x
        if pooling == "cls":
            return x[torch.from_numpy(starts[:count])].float()
        sums = x.new_zeros(count, self.hidden).index_add_(0, torch.from_numpy(row_of[: len(x)]), x)
        return (sums / torch.from_numpy(lengths[:count]).to(x.dtype)[:, None]).float()

    @staticmethod
    def _layer(
        layer: _Layer,
        x: torch.Tensor,
        slot: torch.Tensor,
        keys: torch.Tensor,
        rows: int,
        seq_len: int,
    ) -> torch.Tensor:
        heads, size = layer.heads, layer.head_size
        qkv = F.linear(x, layer.qkv_weight, layer.qkv_bias)
        padded = qkv.new_zeros(rows * seq_len, qkv.shape[1])
        padded[slot] = qkv
        q, k, v = padded.view(rows, seq_len, 3, heads, size).permute(2, 0, 3, 1, 4)
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=keys)
        context = context.transpose(1, 2).reshape(rows * seq_len, heads * size)[slot]
        attended = layer.out_norm(F.linear(context, layer.out.weight, layer.out.bias) + x)
        inner = layer.activation(layer.intermediate(attended))
        return layer.output_norm(layer.output(inner) + attended)


def _chain(batch: Sequence[Sequence[int]]):
    for ids in batch:
        yield from ids
