"""Decoder-shaped embedding models run by warmgate's own padding-free forward pass, as
bert.py runs the BERT family: Qwen3 (Qwen3-Embedding-0.6B, -4B, -8B and their fine-tunes) and
Gemma 3 with bidirectional attention (EmbeddingGemma).

A Qwen3 layer is a decoder's: RMSNorm before attention and before the MLP, query and key
projections each normalised per head (q_norm, k_norm) and rotated by their position (RoPE),
grouped-query attention (fewer key/value heads than query heads), causal, and a SwiGLU MLP
(down(silu(gate(x)) * up(x))); a final RMSNorm. EmbeddingGemma's layer (Gemma3TextModel with
use_bidirectional_attention) is the same with Gemma's differences: its RMSNorms scale by
(1 + weight) in float32, each sublayer's output is normalised again before the residual add
(four norms a layer), the embeddings are scaled by sqrt(hidden), attention scores by
query_pre_attn_scalar ** -0.5, the MLP's gate takes GELU (tanh), attention runs both ways, and
its sliding layers (five of six) see only the keys at most `sliding_window` / 2 positions away
(transformers reads it so), each layer type rotating with its own RoPE base.

The pass runs the linear layers and norms on the real tokens only, packed into one (tokens,
hidden) matrix, the query, key and value projections fused into one matrix multiplication and
the gate and up projections into another; attention sees the inputs padded to the batch's
longest (rounded up to ATTENTION_ALIGN), right-padded: causal attention alone keeps Qwen3's
real queries off the padding, Gemma's mask the padded keys. On a CUDA device in half
precision both run torch's variable-length (flash) attention on the packed tokens instead, with
grouped key/value heads and a window: causal for Qwen3, Gemma's sliding one on its sliding
layers. Positions count from 0 in each input: transformers numbers a left-padded input's tokens
from the padding's width on, and RoPE's scores depend only on the distance between query and
key (and the window on the distance too), so the states are the same (the tests compare them
with transformers' and the vectors with sentence-transformers').

What this pass does not run falls back to transformers' (packing auto), with the reason
logged: Qwen3's sliding-window attention, RoPE scaling (a rope_type other than default), other
activations, a causal Gemma 3, attention logit soft-capping, custom code. The weights come
straight from the folder (checkpoint.py); every weight must be used and none may be missing (a
causal LM's `lm_head`, which no embedding reads, aside). On a CPU in fp32 the linear layers take
oneDNN or MKL as measured at load (linear.py). On a GPU the static pass (`dense`, padded keys
at the planned shape) is what CUDA graphs capture; the padding-free pass serves what has no
graph.

What one family does its own way (its norms and their places, its activation, causal or both
ways, Gemma's scalings, what its config.json may say) is its `Family`; the pass itself is one.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import weight_names
from . import linear, packing
from .packing import CheckpointMismatch, Packing, on_device, read_folder

log = logging.getLogger(__name__)

QWEN3, GEMMA3 = "qwen3", "gemma3_text"
MODEL_TYPES = (QWEN3, GEMMA3)
"""config.json model types this module runs."""
FULL, SLIDING = "full_attention", "sliding_attention"
# Weights no embedding reads: a causal LM's head, and buffers of older checkpoints.
_NOT_READ = ("lm_head.", "rotary_emb.")
_TASK_HEAD = ("score.",)
"""A *ForSequenceClassification's head (its logits from the last real token's state)."""
_PROJECTIONS = ("q_proj", "k_proj", "v_proj")
_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_GELU_TANH = ("gelu_pytorch_tanh",)
# Gemma3TextConfig's defaults, for configs that leave them out.
_GEMMA_THETA, _GEMMA_LOCAL_THETA, _GEMMA_PATTERN = 1_000_000.0, 10_000.0, 6


def _theta(parameters: Any, fallback: Any) -> float | str:
    """One layer type's RoPE base from its rope_parameters (or `fallback`), or why not."""
    if isinstance(parameters, Mapping):
        if parameters.get("rope_type", "default") != "default":
            return f"RoPE type {parameters.get('rope_type')!r} is not the default"
        if parameters.get("partial_rotary_factor", 1.0) != 1.0:
            return "a partial rotary factor"
        theta = parameters.get("rope_theta", fallback)
    else:
        theta = fallback
    if not isinstance(theta, int | float) or theta <= 0:
        return f"rope_theta {theta!r}"
    return float(theta)


def rope_thetas(config: Mapping[str, Any]) -> dict[str, float] | str:
    """Each layer type's RoPE base from config.json (transformers 5's rope_parameters, one for
    all layers or one per layer type; or the older rope_theta and Gemma's
    rope_local_base_freq, with rope_scaling), or why this pass cannot rotate as the model
    does."""
    family = FAMILIES[config["model_type"]]
    parameters = config.get("rope_parameters")
    if not isinstance(parameters, Mapping):
        scaling = config.get("rope_scaling")
        if scaling and (scaling.get("rope_type") or scaling.get("type")) != "default":
            return f"RoPE scaling {scaling!r}"
    if isinstance(parameters, Mapping) and FULL in parameters:  # one per layer type
        per_type = {kind: parameters.get(kind) for kind in (FULL, SLIDING)}
    else:
        per_type = {FULL: parameters, SLIDING: parameters}
    thetas: dict[str, float] = {}
    for kind, fallback in (
        (FULL, config.get("rope_theta", family.rope_theta)),
        (SLIDING, config.get("rope_local_base_freq", _GEMMA_LOCAL_THETA)),
    ):
        if not family.sliding and kind == SLIDING:
            continue
        theta = _theta(per_type[kind], fallback)
        if isinstance(theta, str):
            return theta
        thetas[kind] = theta
    return thetas


def layer_kinds(config: Mapping[str, Any]) -> list[str]:
    """Each layer's attention: full or sliding (Gemma's layer_types, or its older
    sliding_window_pattern: every sixth layer full)."""
    layers = int(config["num_hidden_layers"])
    kinds = config.get("layer_types")
    if kinds:
        return list(kinds)[:layers]
    if not FAMILIES[config["model_type"]].sliding:
        return [FULL] * layers
    pattern = int(config.get("sliding_window_pattern") or _GEMMA_PATTERN)
    return [SLIDING if (index + 1) % pattern else FULL for index in range(layers)]


def supports_config(config: Mapping[str, Any]) -> str | None:
    """None when a Qwen3 or bidirectional Gemma 3 model with this config.json can run packed,
    else why not."""
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        return f"model type {model_type!r} is not one of {', '.join(MODEL_TYPES)}"
    for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size"):
        if not isinstance(config.get(key), int):
            return f"config.json has no {key}"
    if config.get("auto_map"):
        return "config.json's auto_map names custom code"
    why_not = FAMILIES[model_type].supports(config, layer_kinds(config))
    if why_not is not None:
        return why_not
    thetas = rope_thetas(config)
    if isinstance(thetas, str):
        return thetas
    return None


def _qwen3_supports(config: Mapping[str, Any], kinds: list[str]) -> str | None:
    if config.get("hidden_act", "silu") != "silu":
        return f"activation {config.get('hidden_act')!r} is not silu"
    if config.get("use_sliding_window"):
        return "sliding-window attention"
    if any(kind != FULL for kind in kinds):
        return f"layer types {sorted(set(kinds))} are not all full_attention"
    if config.get("use_bidirectional_attention"):
        return "bidirectional attention"
    return None


def _gemma3_supports(config: Mapping[str, Any], kinds: list[str]) -> str | None:
    activation = config.get("hidden_activation") or config.get("hidden_act")
    if activation not in _GELU_TANH:
        return f"activation {activation!r} is not gelu_pytorch_tanh"
    if not config.get("use_bidirectional_attention"):
        return "a causal Gemma 3 (EmbeddingGemma attends both ways)"
    if config.get("attn_logit_softcapping") is not None:
        return "attention logit soft-capping"
    if not set(kinds) <= {FULL, SLIDING}:
        return f"layer types {sorted(set(kinds))}"
    if SLIDING in kinds and not isinstance(config.get("sliding_window"), int):
        return "sliding layers without a sliding_window"
    if not isinstance(config.get("query_pre_attn_scalar", 256), int | float):
        return f"query_pre_attn_scalar {config.get('query_pre_attn_scalar')!r}"
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3RMSNorm's arithmetic: normalised in float32, back to the input's dtype, then
    scaled by the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def gemma_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma3RMSNorm's arithmetic: normalised and scaled by (1 + weight) in float32, then back
    to the input's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).type_as(x)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class LayerNorms(NamedTuple):
    """One layer's norm weights by the place they take in it; None where the family has no
    norm there (Qwen3 normalises no sublayer's output)."""

    input: torch.Tensor
    pre_mlp: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    post_attention: torch.Tensor | None = None
    post_mlp: torch.Tensor | None = None


@dataclass(frozen=True)
class Family:
    """What one decoder family does its own way; the pass (PackedDecoder) is the same."""

    model_type: str
    norms: Mapping[str, str]
    """A layer's norm weights (`layers.N.` + these + `.weight`) and their places (LayerNorms)."""
    norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    activation: Callable[[torch.Tensor], torch.Tensor]
    """The MLP gate's."""
    bidirectional: bool
    """Attends both ways, the padded keys masked; else causally (with right padding that alone
    keeps the real queries off the padding)."""
    scaled: bool
    """Gemma's scalings: the embeddings by sqrt(hidden), the attention scores by
    query_pre_attn_scalar ** -0.5 (else 1 / sqrt(head size))."""
    sliding: bool
    """Layers may attend within a window (with a RoPE base of their own)."""
    rope_theta: float
    """The full layers' RoPE base where config.json states none."""
    supports: Callable[[Mapping[str, Any], list[str]], str | None]
    """None when this pass runs a model of the family with this config.json (and these layer
    kinds), else why not."""


QWEN3_FAMILY = Family(
    model_type=QWEN3,
    norms={"input_layernorm": "input", "post_attention_layernorm": "pre_mlp",
           "self_attn.q_norm": "q", "self_attn.k_norm": "k"},
    norm=rms_norm,
    activation=F.silu,
    bidirectional=False,
    scaled=False,
    sliding=False,
    rope_theta=10000.0,
    supports=_qwen3_supports,
)  # fmt: skip
GEMMA3_FAMILY = Family(
    model_type=GEMMA3,
    norms={"input_layernorm": "input", "post_attention_layernorm": "post_attention",
           "pre_feedforward_layernorm": "pre_mlp", "post_feedforward_layernorm": "post_mlp",
           "self_attn.q_norm": "q", "self_attn.k_norm": "k"},
    norm=gemma_norm,
    activation=_gelu_tanh,
    bidirectional=True,
    scaled=True,
    sliding=True,
    rope_theta=_GEMMA_THETA,
    supports=_gemma3_supports,
)  # fmt: skip
FAMILIES = {family.model_type: family for family in (QWEN3_FAMILY, GEMMA3_FAMILY)}


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class PackedDecoder:
    """A Qwen3 or EmbeddingGemma model's weights and its padding-free forward pass (call it in
    inference mode). The same interface as bert.PackedBert: from_folder, encode, dense,
    hidden, max_positions, varlen, kernels."""

    def __init__(
        self,
        state: Mapping[str, torch.Tensor],
        config: Mapping[str, Any],
        linear_kernel: str = "auto",
        kept: linear.Kept | None = None,
        largest_rows: int | None = None,
    ) -> None:
        """`linear_kernel`: the server's --linear; `kept`: an earlier start's measurements;
        `largest_rows`: the most tokens a pass of the server's plan runs (linear.choose)."""
        why_not = supports_config(config)
        if why_not is not None:
            raise ValueError(f"cannot run this model packed: {why_not}")
        self.family = family = FAMILIES[str(config["model_type"])]
        state, self.task_head = _canonical(state)
        """A *ForSequenceClassification checkpoint's `score.weight` (else empty): classify.py
        reads it."""
        pad = config.get("pad_token_id")
        self.pad_token_id = int(pad) if isinstance(pad, int) else None
        """config.json's pad token: a classifier's logits are those of each input's last token
        that is not it (transformers' *ForSequenceClassification)."""
        first = next(iter(state.values()))
        self.device = first.device
        self.dtype = first.dtype
        self.varlen = _windowed_varlen(self.device, self.dtype)
        """Variable-length (flash) attention on the packed tokens, with a window (causal, or
        Gemma's sliding one) and grouped key/value heads, or None (padded keys)."""
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
        self.kinds = layer_kinds(config)
        """Each layer's attention: FULL or SLIDING (Gemma's local layers)."""
        # Gemma3TextConfig reads a bidirectional model's sliding_window as half of it, plus one
        # (EmbeddingGemma's 512: keys at most 256 positions away on either side).
        self.window = int(config["sliding_window"]) // 2 + 1 if SLIDING in self.kinds else None
        """A sliding layer's query sees the keys less than this many positions away."""
        self.scale = (
            float(config.get("query_pre_attn_scalar", 256)) ** -0.5 if family.scaled else None
        )
        """Attention's score scale (None: 1 / sqrt(head size))."""
        self.embed_scale = (
            torch.tensor(self.hidden**0.5).to(self.device, self.dtype) if family.scaled else None
        )
        self.norm = family.norm
        self.activation = family.activation
        layers = len(self.kinds)
        bias = bool(config.get("attention_bias", False))
        per_layer = [f"self_attn.{name}.weight" for name in (*_PROJECTIONS, "o_proj")]
        per_layer += [f"{name}.weight" for name in (*family.norms, *_MLP)]
        if bias:
            per_layer += [f"self_attn.{name}.bias" for name in (*_PROJECTIONS, "o_proj")]
        wanted = {"embed_tokens.weight", "norm.weight"}
        wanted |= {f"layers.{index}.{name}" for index in range(layers) for name in per_layer}
        missing = sorted(wanted - set(state))
        if missing:
            raise CheckpointMismatch(f"the checkpoint lacks {weight_names(missing)}", missing=True)
        unused = sorted(key for key in set(state) - wanted if not key.startswith(_NOT_READ))
        if unused:
            raise CheckpointMismatch(
                f"the checkpoint has weights this architecture does not use: "
                f"{weight_names(unused)}",
                missing=False,
            )
        self.embed = state["embed_tokens.weight"]
        self.final_norm = state["norm.weight"]
        self.norms: list[LayerNorms] = []
        """Each layer's norm weights, by their places in it."""
        plain = []
        for index in range(layers):
            own = f"layers.{index}."
            attn = own + "self_attn."
            self.norms.append(
                LayerNorms(
                    **{place: state[f"{own}{name}.weight"] for name, place in family.norms.items()}
                )
            )
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
        thetas = rope_thetas(config)
        assert not isinstance(thetas, str)
        self.rope = {kind: self._rope(thetas[kind]) for kind in set(self.kinds)}
        """Each layer type's (cos, sin) of every position."""
        self.kernels = linear.choose(
            plain,
            self.device,
            self.dtype,
            lambda x: x,
            ("none", ""),
            linear_kernel,
            kept,
            largest_rows,
        )
        """The linear layers' kernel for a pass of a given token count (models/linear.py)."""

    @classmethod
    def from_folder(
        cls,
        folder: Path,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        linear_kernel: str = "auto",
        kept: linear.Kept | None = None,
        largest_rows: int | None = None,
    ) -> PackedDecoder:
        """From `config.json` and the checkpoint, onto `device`; ValueError says why it
        cannot."""
        return cls(
            *read_folder(folder, supports_config, dtype, device),
            linear_kernel,
            kept,
            largest_rows,
        )

    def encode(
        self, batch: Sequence[Sequence[int]], seq_len: int, rows: int, layers: int | None = None
    ) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        """The last hidden states of `batch`, packed: (real tokens, hidden), with each input's
        start and length (as PackedBert.encode, `layers` too). On a CPU attention runs over the
        batch's own rows padded to its longest input (rounded up to ATTENTION_ALIGN; inputs of
        one length not padded at all); on a GPU over the planned (rows, seq_len), the rows past the
        batch one token each (variable-length attention: the packed tokens themselves)."""
        device = self.device
        p = Packing.of(batch, seq_len, rows, device.type == "cpu" and self.varlen is None)
        if self.varlen is not None:
            bounds = on_device(p.bounds(), device)
            attend = {kind: self._varlen_attend(bounds, p.seq_len, kind) for kind in self.rope}
        else:
            slot, keys = None, None
            if not p.uniform:
                slot = on_device(p.slots(), device)
                if self.family.bidirectional:  # the padded keys masked (causal: right padding)
                    keys = on_device(p.keys(), device)
            attend = {kind: self._attend(slot, keys, p.rows, p.seq_len, kind) for kind in self.rope}
        where = on_device(p.position, device)
        rope = {kind: (cos[where], sin[where]) for kind, (cos, sin) in self.rope.items()}
        x = self._embed(on_device(p.token_ids, device))
        kernel = self.kernels.for_rows(p.total)
        stack = list(zip(kernel.layers, self.norms, self.kinds, strict=True))
        for layer, norms, kind in stack[:layers]:
            x = self._layer(kernel, layer, norms, x, *rope[kind], attend[kind])
        return p.packed_states(self.norm(x, self.final_norm, self.eps))

    def dense(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The (rows, seq_len, hidden) last hidden states of a right-padded (rows, seq_len)
        batch on the weights' device, `mask` its 0/1 attention mask (with right padding causal
        attention alone keeps Qwen3's real tokens off the padding). Static shapes and no host
        synchronisation: a CUDA graph can capture it."""
        rows, seq_len = ids.shape
        x = self._embed(ids).reshape(rows * seq_len, self.hidden)
        rope = {
            kind: (cos[:seq_len].repeat(rows, 1), sin[:seq_len].repeat(rows, 1))
            for kind, (cos, sin) in self.rope.items()
        }
        keys = mask.bool()[:, None, None, :] if self.family.bidirectional else None
        attend = {kind: self._attend(None, keys, rows, seq_len, kind) for kind in self.rope}
        kernel = self.kernels.for_rows(rows * seq_len)
        for layer, norms, kind in zip(kernel.layers, self.norms, self.kinds, strict=True):
            x = self._layer(kernel, layer, norms, x, *rope[kind], attend[kind])
        return self.norm(x, self.final_norm, self.eps).view(rows, seq_len, self.hidden)

    def _rope(self, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of every position, as transformers' rotary embeddings compute them
        (float32, then the states' dtype): (positions, head) with each frequency twice."""
        size = self.head_size
        inv_freq = 1.0 / (theta ** (torch.arange(0, size, 2, dtype=torch.int64).float() / size))
        freqs = torch.arange(self.max_positions, dtype=torch.float32)[:, None] * inv_freq[None]
        angles = torch.cat([freqs, freqs], dim=-1)
        return angles.cos().to(self.device, self.dtype), angles.sin().to(self.device, self.dtype)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed[ids]
        return x if self.embed_scale is None else x * self.embed_scale

    def _attend(
        self, slot: torch.Tensor | None, keys: torch.Tensor | None, rows: int, seq_len: int,
        kind: str,
    ) -> Attend:  # fmt: skip
        """Grouped-query attention in the right-padded (rows, heads, seq_len, head) layout:
        causal (Qwen3), or both ways over the keys `keys` allows ((rows, 1, 1, seq_len), None:
        all), within the window on a sliding layer (Gemma). `slot`: where each packed token
        sits in the layout (None: already in it)."""
        heads, groups, size = self.heads, self.heads // self.kv_heads, self.head_size
        mask = keys
        if kind == SLIDING and self.window is not None and seq_len > self.window:
            index = torch.arange(seq_len, device=self.device)
            band = (index[:, None] - index[None, :]).abs() < self.window
            mask = band if keys is None else keys & band
        causal, scale = not self.family.bidirectional, self.scale

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
            context = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, scale=scale
            )
            context = context.transpose(1, 2).reshape(rows * seq_len, heads * size)
            return context if slot is None else context[slot]

        return attend

    def _varlen_attend(self, bounds: torch.Tensor, seq_len: int, kind: str) -> Attend:
        """Variable-length attention on the packed tokens: `bounds` are the rows' cumulative
        token offsets (rows + 1, int32). The window (keys to the left, to the right; -1: all):
        causal for Qwen3; both ways for Gemma, within `window` - 1 on a sliding layer."""
        varlen, width, scale = self.varlen, self.heads * self.head_size, self.scale
        assert varlen is not None
        if not self.family.bidirectional:
            window = (-1, 0)
        elif kind == SLIDING and self.window is not None:
            window = (self.window - 1, self.window - 1)
        else:
            window = (-1, -1)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            context = varlen(q, k, v, bounds, bounds, seq_len, seq_len,
                             scale=scale, window_size=window, enable_gqa=True)  # fmt: skip
            return context.reshape(-1, width)

        return attend

    def _layer(
        self,
        kernel: linear.Kernel,
        layer: linear.Layer,
        norms: LayerNorms,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: Attend,
    ) -> torch.Tensor:
        norm, eps = self.norm, self.eps
        tokens, size = x.shape[0], self.head_size
        qkv = kernel.linear(norm(x, norms.input, eps), layer.qkv_weight, layer.qkv_bias)
        q, k, v = qkv.split([self.heads * size, self.kv_heads * size, self.kv_heads * size], dim=-1)
        q = _rotate(norm(q.view(tokens, self.heads, size), norms.q, eps), cos, sin)
        k = _rotate(norm(k.view(tokens, self.kv_heads, size), norms.k, eps), cos, sin)
        context = attend(q, k, v.reshape(tokens, self.kv_heads, size))
        attended = kernel.linear(context, layer.out_weight, layer.out_bias)
        post_attention, post_mlp = norms.post_attention, norms.post_mlp
        x = x + (attended if post_attention is None else norm(attended, post_attention, eps))
        gate_up = kernel.linear(norm(x, norms.pre_mlp, eps), layer.inner_weight, None)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        out = kernel.linear(self.activation(gate) * up, layer.output_weight, None)
        return x + (out if post_mlp is None else norm(out, post_mlp, eps))


def _windowed_varlen(device: torch.device, dtype: torch.dtype) -> Callable[..., Any] | None:
    """torch's variable-length flash attention where it runs (CUDA, half precision) and takes
    a window, a scale and grouped key/value heads (torch 2.10 on), else None."""
    varlen = packing.varlen_attention(device, dtype)
    if varlen is None:
        return None
    try:
        parameters = inspect.signature(varlen).parameters
    except (TypeError, ValueError):
        return None
    return varlen if {"window_size", "enable_gqa", "scale"} <= set(parameters) else None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on (tokens, heads, head) states with each token's (tokens, head) cos and sin, as
    transformers' apply_rotary_pos_emb (rotate_half: the second half negated, then the
    first)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def _canonical(
    state: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Qwen3Model's and Gemma3TextModel's key names: without the `model.` prefix of a
    *ForCausalLM checkpoint (whose `lm_head` is then left out, as transformers' AutoModel
    leaves it) or a *ForSequenceClassification one, whose head (`score.weight`: a re-ranker
    converted from Qwen3-Reranker, a classifier) comes back as the second dict (classify.py
    reads it)."""
    prefixed = any(key.startswith("model.") for key in state)
    out, head = {}, {}
    for key, value in state.items():
        if prefixed and not key.startswith("model."):
            if key.startswith(_TASK_HEAD):
                head[key] = value.detach()
            elif not key.startswith(_NOT_READ):
                out[key] = value.detach()  # reported as unused
            continue
        out[key.removeprefix("model.")] = value.detach()
    return out, head
