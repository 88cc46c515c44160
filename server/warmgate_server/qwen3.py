"""Qwen3 embedding models (Qwen3-Embedding-0.6B, -4B, -8B and their fine-tunes) run by
warmgate's own padding-free forward pass, as packed.py runs the BERT family.

A Qwen3 layer is a decoder's: RMSNorm before attention and before the MLP, query and key
projections each normalised per head (q_norm, k_norm) and rotated by their position (RoPE),
grouped-query attention (fewer key/value heads than query heads), causal, and a SwiGLU MLP
(down(silu(gate(x)) * up(x))); a final RMSNorm. The pass runs the linear layers and norms on
the real tokens only, packed into one (tokens, hidden) matrix, the query, key and value
projections fused into one matrix multiplication and the gate and up projections into
another; attention sees the inputs padded to the batch's longest (rounded up to
ATTENTION_ALIGN), right-padded so that causal attention alone keeps every real query off the
padding; on a CUDA device in half precision it runs torch's variable-length (flash) attention
on the packed tokens instead, with a causal window and grouped key/value heads.
Positions count from 0 in each input: transformers numbers a left-padded input's
tokens from the padding's width on, and RoPE's scores depend only on the distance between
query and key, so the states are the same (the tests compare them with transformers' and the
vectors with sentence-transformers').

What this pass does not run falls back to transformers' (packing auto), with the reason
logged: sliding-window attention, RoPE scaling (rope_type other than default), an activation
other than SiLU, custom code. The weights come straight from the folder (checkpoint.py); every
weight must be used and none may be missing (a causal LM's `lm_head`, which no embedding
reads, aside). On a CPU in fp32 the linear layers take oneDNN or MKL as measured at load
(linear.py). On a GPU the static pass (`dense`, padded keys at the planned shape) is what
CUDA graphs capture; the padding-free pass serves what has no graph.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from . import linear
from .errors import weight_names
from .packed import CheckpointMismatch, Packing, read_folder

log = logging.getLogger(__name__)

MODEL_TYPE = "qwen3"
# Weights no embedding reads: a causal LM's head, and buffers of older checkpoints.
_NOT_READ = ("lm_head.", "rotary_emb.")
_PROJECTIONS = ("q_proj", "k_proj", "v_proj")
# A layer's norms, in the order PackedQwen3.norms holds them, and its MLP.
_NORMS = ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm")
_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def rope_theta(config: Mapping[str, Any]) -> float | str:
    """RoPE's base from config.json (transformers 5's rope_parameters, or the older rope_theta
    with rope_scaling), or why this pass cannot rotate as the model does."""
    parameters = config.get("rope_parameters")
    if isinstance(parameters, Mapping):
        if parameters.get("rope_type", "default") != "default":
            return f"RoPE type {parameters.get('rope_type')!r} is not the default"
        if parameters.get("partial_rotary_factor", 1.0) != 1.0:
            return "a partial rotary factor"
        theta = parameters.get("rope_theta", config.get("rope_theta"))
    else:
        scaling = config.get("rope_scaling")
        if scaling and (scaling.get("rope_type") or scaling.get("type")) != "default":
            return f"RoPE scaling {scaling!r}"
        theta = config.get("rope_theta", 10000.0)
    if not isinstance(theta, int | float) or theta <= 0:
        return f"rope_theta {theta!r}"
    return float(theta)


def supports_config(config: Mapping[str, Any]) -> str | None:
    """None when a Qwen3 model with this config.json can run packed, else why not."""
    if config.get("model_type") != MODEL_TYPE:
        return f"model type {config.get('model_type')!r} is not {MODEL_TYPE!r}"
    for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size"):
        if not isinstance(config.get(key), int):
            return f"config.json has no {key}"
    if config.get("auto_map"):
        return "config.json's auto_map names custom code"
    if config.get("hidden_act", "silu") != "silu":
        return f"activation {config.get('hidden_act')!r} is not silu"
    if config.get("use_sliding_window"):
        return "sliding-window attention"
    layer_types = config.get("layer_types") or []
    if any(kind != "full_attention" for kind in layer_types):
        return f"layer types {sorted(set(layer_types))} are not all full_attention"
    if config.get("use_bidirectional_attention"):
        return "bidirectional attention"
    theta = rope_theta(config)
    if isinstance(theta, str):
        return theta
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3RMSNorm's arithmetic: normalised in float32, back to the input's dtype, then
    scaled by the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class PackedQwen3:
    """A Qwen3 model's weights and its padding-free forward pass (call it in inference mode).
    The same interface as packed.PackedBert: from_folder, encode, dense, hidden,
    max_positions, varlen, kernels."""

    def __init__(self, state: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> None:
        why_not = supports_config(config)
        if why_not is not None:
            raise ValueError(f"cannot run this model packed: {why_not}")
        state = _canonical(state)
        first = next(iter(state.values()))
        self.device = first.device
        self.dtype = first.dtype
        self.varlen = _causal_varlen(self.device, self.dtype)
        """Variable-length (flash) attention on the packed tokens, causal, with grouped
        key/value heads, or None (padded keys)."""
        self.hidden = int(config["hidden_size"])
        self.heads = int(config["num_attention_heads"])
        self.kv_heads = int(config.get("num_key_value_heads") or self.heads)
        if self.heads % self.kv_heads:
            raise ValueError(
                f"cannot run this model packed: {self.heads} query heads are not a multiple of "
                f"{self.kv_heads} key/value heads"
            )
        self.head_size = int(config.get("head_dim") or self.hidden // self.heads)
        self.eps = float(config.get("rms_norm_eps", 1e-6))
        self.max_positions = int(config.get("max_position_embeddings", 32768))
        """Tokens per input the model was made for (RoPE itself has no table to run out of)."""
        layers = int(config["num_hidden_layers"])
        bias = bool(config.get("attention_bias", False))
        per_layer = [f"self_attn.{name}.weight" for name in (*_PROJECTIONS, "o_proj")]
        per_layer += [f"{name}.weight" for name in (*_NORMS, *_MLP)]
        if bias:
            per_layer += [f"self_attn.{name}.bias" for name in (*_PROJECTIONS, "o_proj")]
        wanted = {"embed_tokens.weight", "norm.weight"}
        wanted |= {f"layers.{index}.{name}" for index in range(layers) for name in per_layer}
        missing = sorted(wanted - set(state))
        if missing:
            raise CheckpointMismatch(f"the checkpoint lacks the weight {missing[0]!r}")
        unused = sorted(key for key in set(state) - wanted if not key.startswith(_NOT_READ))
        if unused:
            raise CheckpointMismatch(
                f"the checkpoint has weights this architecture does not use: {weight_names(unused)}"
            )
        self.embed = state["embed_tokens.weight"]
        self.final_norm = state["norm.weight"]
        self.norms: list[tuple[torch.Tensor, ...]] = []
        """Each layer's (input norm, post-attention norm, q_norm, k_norm) weights."""
        plain = []
        for index in range(layers):
            own = f"layers.{index}."
            attn = own + "self_attn."
            self.norms.append(tuple(state[own + name + ".weight"] for name in _NORMS))
            plain.append(
                linear.Layer(
                    qkv_weight=torch.cat([state[f"{attn}{p}.weight"] for p in _PROJECTIONS]),
                    qkv_bias=(
                        torch.cat([state[f"{attn}{p}.bias"] for p in _PROJECTIONS])
                        if bias
                        else None
                    ),
                    out_weight=state[attn + "o_proj.weight"],
                    out_bias=state[attn + "o_proj.bias"] if bias else None,
                    out_norm=(),
                    inner_weight=torch.cat(
                        [state[own + "mlp.gate_proj.weight"], state[own + "mlp.up_proj.weight"]]
                    ),
                    inner_bias=None,
                    output_weight=state[own + "mlp.down_proj.weight"],
                    output_bias=None,
                    output_norm=(),
                )
            )
        self.intermediate = int(config["intermediate_size"])
        theta = rope_theta(config)
        assert isinstance(theta, float)
        # cos and sin of every position, as Qwen3RotaryEmbedding computes them (float32, then
        # the states' dtype): (positions, head) with each frequency twice.
        size = self.head_size
        inv_freq = 1.0 / (theta ** (torch.arange(0, size, 2, dtype=torch.int64).float() / size))
        freqs = torch.arange(self.max_positions, dtype=torch.float32)[:, None] * inv_freq[None]
        angles = torch.cat([freqs, freqs], dim=-1)
        self.cos = angles.cos().to(self.device, self.dtype)
        self.sin = angles.sin().to(self.device, self.dtype)
        self.kernels = linear.choose(plain, self.device, self.dtype, lambda x: x, ("none", ""))
        """The linear layers' kernel for a pass of a given token count (linear.py)."""
        self.onednn = "onednn" in self.kernels.names

    @classmethod
    def from_folder(
        cls, folder: Path, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> PackedQwen3:
        """From `config.json` and the checkpoint, onto `device`; ValueError says why it
        cannot."""
        return cls(*read_folder(folder, supports_config, dtype, device))

    def encode(
        self, batch: Sequence[Sequence[int]], seq_len: int, rows: int
    ) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        """The last hidden states of `batch`, packed: (real tokens, hidden), with each input's
        start and length (as PackedBert.encode). On a CPU attention runs over the batch's own
        rows padded to its longest input (rounded up to ATTENTION_ALIGN; inputs of one length
        not padded at all); on a GPU over the planned (rows, seq_len), the rows past the
        batch one token each (variable-length attention: the packed tokens themselves)."""
        p = Packing.of(batch, seq_len, rows, self.device.type == "cpu" and self.varlen is None)
        if self.varlen is not None:
            bounds = self._on_device(np.append(p.starts, p.total).astype(np.int32))
            attend = self._varlen_attend(bounds, p.seq_len)
        elif p.uniform:
            attend = self._attend(None, p.rows, p.seq_len)
        else:
            slot = self._on_device(p.row_of * p.seq_len + p.position)  # into (rows * seq_len)
            attend = self._attend(slot, p.rows, p.seq_len)
        where = self._on_device(p.position)
        cos, sin = self.cos[where], self.sin[where]
        x = self.embed[self._on_device(p.token_ids)]
        kernel = self.kernels.for_rows(p.total)
        for layer, norms in zip(kernel.layers, self.norms, strict=True):
            x = self._layer(kernel, layer, norms, x, cos, sin, attend)
        return p.packed_states(rms_norm(x, self.final_norm, self.eps))

    def dense(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The (rows, seq_len, hidden) last hidden states of a right-padded (rows, seq_len)
        batch on the weights' device (`mask` is its 0/1 attention mask: with right padding,
        causal attention alone keeps the real tokens off the padding). Static shapes and no
        host synchronisation: a CUDA graph can capture it."""
        rows, seq_len = ids.shape
        x = self.embed[ids].reshape(rows * seq_len, self.hidden)
        cos = self.cos[:seq_len].repeat(rows, 1)
        sin = self.sin[:seq_len].repeat(rows, 1)
        attend = self._attend(None, rows, seq_len)
        kernel = self.kernels.for_rows(rows * seq_len)
        for layer, norms in zip(kernel.layers, self.norms, strict=True):
            x = self._layer(kernel, layer, norms, x, cos, sin, attend)
        return rms_norm(x, self.final_norm, self.eps).view(rows, seq_len, self.hidden)

    def _on_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        return tensor if self.device.type == "cpu" else tensor.to(self.device, non_blocking=True)

    def _attend(
        self, slot: torch.Tensor | None, rows: int, seq_len: int
    ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        """Causal grouped-query attention in the right-padded (rows, heads, seq_len, head)
        layout; `slot`: where each packed token sits in it (None: already in it)."""
        heads, groups, size = self.heads, self.heads // self.kv_heads, self.head_size

        def layout(part: torch.Tensor) -> torch.Tensor:
            if slot is not None:
                padded = part.new_zeros(rows * seq_len, *part.shape[1:])
                padded[slot] = part
                part = padded
            return part.view(rows, seq_len, part.shape[1], size).transpose(1, 2)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            q, k, v = layout(q), layout(k), layout(v)
            if groups > 1:  # transformers' repeat_kv: each key/value head serves `groups`
                k = k.repeat_interleave(groups, dim=1)
                v = v.repeat_interleave(groups, dim=1)
            context = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            context = context.transpose(1, 2).reshape(rows * seq_len, heads * size)
            return context if slot is None else context[slot]

        return attend

    def _varlen_attend(
        self, bounds: torch.Tensor, seq_len: int
    ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        """Causal variable-length attention on the packed tokens: `bounds` are the rows'
        cumulative token offsets (rows + 1, int32)."""
        varlen, width = self.varlen, self.heads * self.head_size
        assert varlen is not None

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            context = varlen(q, k, v, bounds, bounds, seq_len, seq_len,
                             window_size=(-1, 0), enable_gqa=True)  # fmt: skip
            return context.reshape(-1, width)

        return attend

    def _layer(
        self,
        kernel: linear.Kernel,
        layer: linear.Layer,
        norms: tuple[torch.Tensor, ...],
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        input_norm, post_norm, q_norm, k_norm = norms
        tokens, size = x.shape[0], self.head_size
        qkv = kernel.linear(rms_norm(x, input_norm, self.eps), layer.qkv_weight, layer.qkv_bias)
        q, k, v = qkv.split([self.heads * size, self.kv_heads * size, self.kv_heads * size], dim=-1)
        q = _rotate(rms_norm(q.view(tokens, self.heads, size), q_norm, self.eps), cos, sin)
        k = _rotate(rms_norm(k.view(tokens, self.kv_heads, size), k_norm, self.eps), cos, sin)
        context = attend(q, k, v.reshape(tokens, self.kv_heads, size))
        x = x + kernel.linear(context, layer.out_weight, layer.out_bias)
        gate_up = kernel.linear(rms_norm(x, post_norm, self.eps), layer.inner_weight, None)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return x + kernel.linear(F.silu(gate) * up, layer.output_weight, None)


def _causal_varlen(device: torch.device, dtype: torch.dtype) -> Callable[..., Any] | None:
    """torch's variable-length flash attention where it runs (CUDA, half precision) and takes
    a causal window and grouped key/value heads (torch 2.10 on), else None."""
    from . import packed

    varlen = packed._varlen_attention(device, dtype)
    if varlen is None:
        return None
    try:
        parameters = inspect.signature(varlen).parameters
    except (TypeError, ValueError):
        return None
    return varlen if {"window_size", "enable_gqa"} <= set(parameters) else None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on (tokens, heads, head) states with each token's (tokens, head) cos and sin, as
    transformers' apply_rotary_pos_emb (rotate_half: the second half negated, then the
    first)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def _canonical(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Qwen3Model's key names: without the `model.` prefix of a Qwen3ForCausalLM checkpoint
    (whose `lm_head` is then left out, as transformers' AutoModel leaves it)."""
    prefixed = any(key.startswith("model.") for key in state)
    out = {}
    for key, value in state.items():
        if prefixed and not key.startswith("model."):
            if not key.startswith(_NOT_READ):
                out[key] = value.detach()  # reported as unused
            continue
        out[key.removeprefix("model.")] = value.detach()
    return out
