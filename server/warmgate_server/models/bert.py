"""BERT-family encoders (BERT: all-MiniLM, bge, e5; XLM-RoBERTa: bge-m3, multilingual-e5,
KURE; RoBERTa and CamemBERT; DistilBERT; MPNet: all-mpnet) run by warmgate's own forward passes.

A padded batch of n inputs at bucket L costs n x L tokens in every linear layer, which is where
almost all of the work is (about 21 of MiniLM's 22 MFLOP per token). The padding-free pass
(`encode`) runs the linear layers and layer norms on the real tokens only, packed into one
(tokens, hidden) matrix. Attention on a CPU sees a padded (n, heads, L', head) layout, with
padded keys masked, L' the batch's longest input rounded up to ATTENTION_ALIGN (not the bucket:
a CPU picks no kernel per shape, and the planned shape's padding rows are left out too:
packing.py); on a CUDA device in half precision it runs variable-length (flash)
attention on the packed tokens, so nothing is padded at all. The query, key and value
projections are fused into one matrix multiplication. Same weights, same maths as the Hugging
Face forward pass (tests compare both with sentence-transformers), less work.

The RoBERTa family differs from BERT in one place the forward pass sees: its position ids start
at `pad_token_id + 1` (so 514 position embeddings hold 512 tokens), and count only the tokens
that are not the padding token: a `<pad>` written in the text (its tokenizer makes it the
padding id) takes position `pad_token_id` and the tokens after it go on from where the count
was, as transformers' `create_position_ids_from_input_ids` numbers them. Its layers carry the
same weights under the same names. DistilBERT (msmarco-distilbert, multi-qa-distilbert,
distiluse-base-multilingual) is BERT's layer under other names (`transformer.layer.N.ffn.lin1`
for `encoder.layer.N.intermediate.dense`, `dim` for `hidden_size`, ...) without token type
embeddings: its checkpoint and config.json are read into BERT's names (`_DISTILBERT_NAMES`,
`bert_config`), so the same pass runs it. MPNet (all-mpnet-base-v2, multi-qa-mpnet) is BERT's
layer under other names too, without token type embeddings, its positions counted as RoBERTa's
(from 2), and one more term in attention: a relative position bias (32 buckets of the distance
between query and key, one value per head, shared by every layer) added to the scores. That
bias cannot go through variable-length flash attention, so MPNet attends over padded keys on a
GPU as on a CPU.

The static pass (`dense`) takes a padded (rows, L) batch already on the device and returns its
token states there, with no host synchronisation and no data-dependent shape: that is what a
CUDA graph captures (backends/graphs.py), one per warmed shape. Pooling and the modules after it are
head.py's.

The weights come straight from the model folder (`config.json` and its checkpoint in any of its
forms: checkpoint.py, read by packing.py), so a BERT-family model starts without importing
transformers' modeling stack (several seconds of CPU per pod start), or from an already loaded
Hugging Face model.
Every weight of the checkpoint must be used and none may be missing (the pooler, which no
embedding reads, aside).

On a CPU in fp32 the linear layers run through oneDNN with their weights reordered once, at
load, into its blocked layout (the primitive inductor's CPU freezing emits), the GELU fused
into the inner layer's matrix multiplication, or through MKL, whichever this CPU runs faster
for a pass's token count: measured at load (linear.py).

On a CPU the row count of a matrix multiplication picks no kernel, so the padding-free pass's
varying token counts are warm once its (rows, L) shapes are; `make bench-server` probes token
counts the warmup never ran (docs/benchmarks.md). On a GPU a new row count is a new kernel
choice: there the warmed shapes are served by CUDA graphs, and the padding-free pass serves
what has no graph (`--cuda-graphs off`, or a shape outside the plan).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import weight_names
from . import linear, packing
from .packing import CheckpointMismatch, Packing, on_device, read_folder

log = logging.getLogger(__name__)
_TANH_GELU = ((lambda x: F.gelu(x, approximate="tanh")), ("gelu", "tanh"))
# config.json's hidden_act: the torch function, and the same activation as a oneDNN post-op of
# the matrix multiplication before it (attr, algorithm).
_ACTIVATIONS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], tuple[str, str]]] = {
    "gelu": (F.gelu, ("gelu", "none")),  # the exact (erf) GELU
    "gelu_new": _TANH_GELU,
    "gelu_pytorch_tanh": _TANH_GELU,
    "relu": (F.relu, ("relu", "")),
}


LAYER_WEIGHTS = tuple(
    f"{part}.{kind}"
    for part in (
        "attention.self.query", "attention.self.key", "attention.self.value",
        "attention.output.dense", "attention.output.LayerNorm", "intermediate.dense",
        "output.dense", "output.LayerNorm",
    )
    for kind in ("weight", "bias")
)  # fmt: skip
"""The weights of one BERT layer (`encoder.layer.N.` + these), under BERT's names."""


# config.json model types this module runs.
MODEL_TYPES = ("bert", "xlm-roberta", "roberta", "camembert", "distilbert", "mpnet")
_ROBERTA_TYPES = ("xlm-roberta", "roberta", "camembert")
# Weights of the architecture that no embedding reads (BertModel's pooler), and buffers.
_NOT_READ = ("pooler.", "embeddings.position_ids", "embeddings.token_type_ids")


# DistilBERT's config.json keys for BERT's (DistilBertConfig's attribute_map and the rest), and
# its layers' weight names for BERT's: the same layer under other names.
_DISTILBERT_CONFIG = {"dim": "hidden_size", "n_heads": "num_attention_heads",
                      "n_layers": "num_hidden_layers", "hidden_dim": "intermediate_size",
                      "activation": "hidden_act"}  # fmt: skip
_DISTILBERT_LAYER_NORM_EPS = 1e-12  # fixed in DistilBERT's modeling code, not in config.json
_DISTILBERT_NAMES = (
    ("transformer.layer.", "encoder.layer."),
    (".attention.q_lin.", ".attention.self.query."),
    (".attention.k_lin.", ".attention.self.key."),
    (".attention.v_lin.", ".attention.self.value."),
    (".attention.out_lin.", ".attention.output.dense."),
    (".sa_layer_norm.", ".attention.output.LayerNorm."),
    (".ffn.lin1.", ".intermediate.dense."),
    (".ffn.lin2.", ".output.dense."),
    (".output_layer_norm.", ".output.LayerNorm."),
)
# MPNet's layers' weight names for BERT's, and its relative position bias (MPNetEncoder's).
_MPNET_NAMES = (
    (".attention.attn.q.", ".attention.self.query."),
    (".attention.attn.k.", ".attention.self.key."),
    (".attention.attn.v.", ".attention.self.value."),
    (".attention.attn.o.", ".attention.output.dense."),
    (".attention.LayerNorm.", ".attention.output.LayerNorm."),
)
_RENAMES = {"distilbert": _DISTILBERT_NAMES, "mpnet": _MPNET_NAMES}
_RELATIVE_BIAS = "encoder.relative_attention_bias.weight"
_MPNET_BUCKETS = 32  # MPNetEncoder.compute_position_bias's, whatever config.json says
_MPNET_MAX_DISTANCE = 128
# Families whose inputs have no token type embeddings.
_NO_TOKEN_TYPES = ("distilbert", "mpnet")
# The base model's prefix in a checkpoint of a task model (BertForMaskedLM, ...).
_BASE_PREFIXES = ("bert.", "roberta.", "distilbert.", "mpnet.")


def bert_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """config.json with BERT's keys: DistilBERT's `dim`, `n_heads`, `n_layers`, `hidden_dim`
    and `activation` under BERT's names, and its fixed layer norm epsilon; other families'
    as they are."""
    out = dict(config)
    if config.get("model_type") == "distilbert":
        for own, bert in _DISTILBERT_CONFIG.items():
            if own in config:
                out[bert] = config[own]
        out["layer_norm_eps"] = _DISTILBERT_LAYER_NORM_EPS
        out.setdefault("hidden_act", "gelu")
    return out


def position_offset(config: Mapping[str, Any]) -> int:
    """The first position id: pad_token_id + 1 for the RoBERTa family, 2 for MPNet (its
    embeddings' padding index is 1 whatever pad_token_id says), else 0."""
    if config.get("model_type") == "mpnet":
        return 2
    if config.get("model_type") in _ROBERTA_TYPES:
        return int(config.get("pad_token_id", 1)) + 1
    return 0


def supports_config(config: Mapping[str, Any]) -> str | None:
    """None when a model with this config.json can run packed, else why not."""
    if config.get("model_type") not in MODEL_TYPES:
        return f"model type {config.get('model_type')!r} is not one of {', '.join(MODEL_TYPES)}"
    config = bert_config(config)
    if config.get("sinusoidal_pos_embds"):
        # transformers may write sinusoids over the checkpoint's position embeddings: its own
        # forward pass serves such a model
        return "position embeddings are sinusoidal"
    buckets = config.get("relative_attention_num_buckets", _MPNET_BUCKETS)
    if config.get("model_type") == "mpnet" and buckets != _MPNET_BUCKETS:
        # MPNetEncoder buckets distances into 32 whatever the embedding holds
        return f"relative_attention_num_buckets {buckets} is not {_MPNET_BUCKETS}"
    for key in ("hidden_size", "num_attention_heads", "num_hidden_layers"):
        if not isinstance(config.get(key), int):
            return f"config.json has no {key}"
    if config.get("auto_map"):
        return "config.json's auto_map names custom code"
    if config.get("position_embedding_type", "absolute") != "absolute":
        return f"position embeddings {config['position_embedding_type']!r} are not absolute"
    if config.get("is_decoder"):
        return "a decoder"
    if config.get("hidden_act", "gelu") not in _ACTIVATIONS:
        return f"activation {config.get('hidden_act')!r} is not one of {', '.join(_ACTIVATIONS)}"
    return None


class PackedBert:
    """A BERT encoder's weights and its padding-free forward pass (call it in inference mode)."""

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
        state, self.task_head = _canonical(state, config.get("model_type"))
        """A *ForSequenceClassification checkpoint's `classifier.` weights (else empty); the
        base model's pooler is `pooler`. The pass reads neither: classify.py does."""
        self.pooler = {key: value for key, value in state.items() if key.startswith("pooler.")}
        config = bert_config(config)
        first = next(iter(state.values()))
        self.device = first.device
        self.dtype = first.dtype
        model_type = config.get("model_type")
        relative = model_type == "mpnet"
        self.varlen = None if relative else packing.varlen_attention(self.device, self.dtype)
        """Variable-length (flash) attention on the packed tokens, or None (padded keys)."""
        self.hidden = int(config["hidden_size"])
        self.heads = int(config["num_attention_heads"])
        self.head_size = self.hidden // self.heads
        self.eps = float(config.get("layer_norm_eps", 1e-12))
        self.offset = position_offset(config)
        self.max_positions = int(config.get("max_position_embeddings", 512)) - self.offset
        """Tokens per input the position embeddings hold."""
        embeddings = {"embeddings.word_embeddings.weight", "embeddings.position_embeddings.weight",
                      "embeddings.LayerNorm.weight", "embeddings.LayerNorm.bias"}  # fmt: skip
        # BERT's and RoBERTa's inputs have token type embeddings (all of type 0), DistilBERT's
        # and MPNet's none.
        token_types = model_type not in _NO_TOKEN_TYPES
        if token_types:
            embeddings.add("embeddings.token_type_embeddings.weight")
        if relative:
            embeddings.add(_RELATIVE_BIAS)
        layers = int(config["num_hidden_layers"])
        wanted = embeddings | {
            f"encoder.layer.{index}.{name}" for index in range(layers) for name in LAYER_WEIGHTS
        }
        unused = sorted(
            _own_name(key, model_type)
            for key in set(state) - wanted
            if not key.startswith(_NOT_READ)
        )
        if unused:
            raise CheckpointMismatch(
                f"the checkpoint has weights this architecture does not use: "
                f"{weight_names(unused)}",
                missing=False,
            )
        absent = sorted(_own_name(key, model_type) for key in wanted - set(state))
        if absent:
            raise CheckpointMismatch(f"the checkpoint lacks {weight_names(absent)}", missing=True)
        self.word = state["embeddings.word_embeddings.weight"]
        self.position = state["embeddings.position_embeddings.weight"]
        """Every position embedding: a position id indexes it as it is (RoBERTa's from
        pad_token_id + 1, a padding token's at pad_token_id)."""
        self.token_types = state["embeddings.token_type_embeddings.weight"] if token_types else None
        """Every token type's embedding: a pair's second text's tokens (a cross-encoder's
        input) take type 1, every other token type 0."""
        self.token_type = self.token_types[0] if self.token_types is not None else None
        self.relative_bias = (
            relative_bias(state[_RELATIVE_BIAS], self.max_positions) if relative else None
        )
        """MPNet's relative position bias, (heads, positions, positions): what attention adds
        to the scores of query i and key j; else None."""
        self.embedding_norm = _norm(state, "embeddings.LayerNorm")
        plain = [_layer(state, f"encoder.layer.{index}.") for index in range(layers)]
        activation, post_op = _ACTIVATIONS[config.get("hidden_act", "gelu")]
        self.kernels = linear.choose(
            plain, self.device, self.dtype, activation, post_op, linear_kernel, kept, largest_rows
        )
        """The linear layers' kernel for a pass of a given token count (linear.py); the plain
        weights are freed unless a kernel keeps them."""
        self.onednn = "onednn" in self.kernels.names
        """Some passes run their linear layers through oneDNN on reordered weights."""

    @classmethod
    def from_model(cls, model: Any) -> PackedBert:
        """From a loaded Hugging Face BertModel (its weights, not copies, except fused QKV)."""
        return cls(dict(model.state_dict()), model.config.to_dict())

    @classmethod
    def from_folder(
        cls,
        folder: Path,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        linear_kernel: str = "auto",
        kept: linear.Kept | None = None,
        largest_rows: int | None = None,
    ) -> PackedBert:
        """From `config.json` and the checkpoint (checkpoint.py: safetensors or
        pytorch_model.bin, sharded or not), onto `device`; ValueError says why it cannot."""
        return cls(
            *read_folder(folder, supports_config, dtype, device),
            linear_kernel,
            kept,
            largest_rows,
        )

    def encode(
        self, batch: Sequence[Sequence[int]], seq_len: int, rows: int, layers: int | None = None
    ) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        """The last hidden states of `batch` laid out as `rows` x `seq_len`, packed: (real
        tokens, hidden) in the weights' dtype, the inputs' tokens one after another, with each
        input's start and length (head.py pools them). Attention's layout is Packing.of's: on
        a GPU the planned shape (its kernels the warmup chose), on a CPU the batch's own rows
        (the linear layers run at the batch's token count either way). `layers`: run only the
        first ones (warmup: every layer runs the same kernels on the same shapes)."""
        device = self.device
        p = Packing.of(batch, seq_len, rows, device.type == "cpu" and self.varlen is None)
        if self.varlen is not None:
            attend = self._varlen_attend(on_device(p.bounds(), device), p.seq_len)
        elif p.uniform:
            attend = self._padded_attend(None, None, p.rows, p.seq_len)
        else:
            slot, keys = on_device(p.slots(), device), on_device(p.keys(), device)
            attend = self._padded_attend(slot, keys, p.rows, p.seq_len)

        position = self._position_ids(p.token_ids, p.position, p.starts, p.row_of)
        x = self.word[on_device(p.token_ids, device)] + self.position[on_device(position, device)]
        if self.token_types is not None:
            types = _token_types(batch, p)
            x = x + (
                self.token_type if types is None else self.token_types[on_device(types, device)]
            )
        x = self._norm(x, self.embedding_norm)
        kernel = self.kernels.for_rows(p.total)
        for layer in kernel.layers[:layers]:
            x = self._layer(kernel, layer, x, attend)
        return p.packed_states(x)

    def dense(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The (rows, seq_len, hidden) last hidden states of a padded (rows, seq_len) batch:
        token ids and its 0/1 attention mask, both on the weights' device. Every row needs at
        least one real token. Static shapes and no host synchronisation: a CUDA graph can
        capture it."""
        rows, seq_len = ids.shape
        if self.offset:  # the padding token's id is offset - 1: it counts no position
            real = ids != self.offset - 1
            positions = torch.cumsum(real, dim=1) * real + (self.offset - 1)
        else:
            positions = torch.arange(seq_len, device=ids.device)
        x = self.word[ids] + self.position[positions]
        if self.token_type is not None:
            x = x + self.token_type
        x = self._norm(x, self.embedding_norm).reshape(rows * seq_len, self.hidden)
        keys = mask.bool()[:, None, None, :]
        attend = self._padded_attend(None, keys, rows, seq_len)
        kernel = self.kernels.for_rows(rows * seq_len)
        for layer in kernel.layers:
            x = self._layer(kernel, layer, x, attend)
        return x.view(rows, seq_len, self.hidden)

    def _position_ids(
        self, token_ids: np.ndarray, index: np.ndarray, starts: np.ndarray, row_of: np.ndarray
    ) -> np.ndarray:
        """Each packed token's position id: its index in its input (BERT, DistilBERT), or, where
        position ids start past the padding token's id (RoBERTa, MPNet), that start plus the
        count of its input's tokens so far that are not the padding token, and the padding
        token's id for a padding token (transformers' create_position_ids_from_input_ids)."""
        if not self.offset:
            return index
        pad = self.offset - 1
        real = token_ids != pad
        if real.all():
            return index + self.offset
        counted = np.cumsum(real)
        before = np.concatenate([[0], counted])[starts]  # real tokens of the rows before
        return np.where(real, counted - before[row_of] + pad, pad)

    def _padded_attend(
        self, slot: torch.Tensor | None, keys: torch.Tensor | None, rows: int, seq_len: int
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """Attention in the padded (rows, heads, seq_len, head) layout. `slot`: where each
        packed token sits in it (None: the tokens are already in that layout: `dense`, or rows
        of one length); `keys`: which keys each row attends (None: all of them)."""
        heads, size = self.heads, self.head_size
        mask: torch.Tensor | None = keys
        if self.relative_bias is not None:
            bias = self.relative_bias[:, :seq_len, :seq_len].unsqueeze(0)
            mask = bias if keys is None else torch.where(keys, bias, float("-inf"))

        def attend(qkv: torch.Tensor) -> torch.Tensor:
            if slot is None:
                padded = qkv
            else:
                padded = qkv.new_zeros(rows * seq_len, qkv.shape[1])
                padded[slot] = qkv
            q, k, v = padded.view(rows, seq_len, 3, heads, size).permute(2, 0, 3, 1, 4)
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
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
        self,
        kernel: linear.Kernel,
        layer: linear.Layer,
        x: torch.Tensor,
        attend: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        context = attend(kernel.linear(x, layer.qkv_weight, layer.qkv_bias))
        attended = kernel.linear(context, layer.out_weight, layer.out_bias) + x
        attended = self._norm(attended, layer.out_norm)
        inner = kernel.activated(attended, layer.inner_weight, layer.inner_bias)
        output = kernel.linear(inner, layer.output_weight, layer.output_bias)
        return self._norm(output + attended, layer.output_norm)


def _token_types(batch: Sequence[Sequence[int]], p: packing.Packing) -> np.ndarray | None:
    """Each packed token's type: 1 from a pair's second text on (pre.TokenIds.type_from), else
    0; None when no input of the batch is a pair (every token of type 0)."""
    starts = [getattr(tokens, "type_from", None) for tokens in batch]
    if all(start is None for start in starts):
        return None
    first = np.full(p.rows, np.iinfo(np.int64).max, dtype=np.int64)
    for row, start in enumerate(starts):
        if start is not None:
            first[row] = start
    return (p.position >= first[p.row_of]).astype(np.int64)


def _canonical(
    state: Mapping[str, torch.Tensor], model_type: Any
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """BertModel key names: no `bert.`, `roberta.`, `distilbert.` or `mpnet.` prefix (BertFor*,
    RobertaFor*, DistilBertFor*, MPNetFor* checkpoints), LayerNorm weight/bias rather than the
    old gamma/beta, DistilBERT's and MPNet's layers under BERT's names. In a checkpoint whose
    base model's weights carry the prefix, the weights without it are its task head (an MLM
    head's `cls.`, `lm_head.`, `vocab_projector.`): left out, as transformers' AutoModel and
    sentence-transformers leave them, and logged; a sequence classifier's (`classifier.`) come
    back as the second dict (classify.py reads them)."""
    headed = any(key.startswith(_BASE_PREFIXES) for key in state)
    renames = _RENAMES.get(model_type, ())
    out, heads = {}, {}
    for key, value in state.items():
        if headed and not key.startswith(_BASE_PREFIXES):
            heads[key] = value.detach()
            continue
        for prefix in _BASE_PREFIXES:
            key = key.removeprefix(prefix)
        for own, bert in renames:
            key = key.replace(own, bert, 1)
        if key.endswith(".gamma"):
            key = key.removesuffix(".gamma") + ".weight"
        elif key.endswith(".beta"):
            key = key.removesuffix(".beta") + ".bias"
        out[key] = value.detach()
    if heads:
        log.info("left out the checkpoint's task head: %s", weight_names(sorted(heads)))
    # A sequence classifier's head is small and kept (classify.py reads it); an MLM head (a
    # vocabulary-sized matrix) is not.
    return out, {key: value for key, value in heads.items() if key.startswith("classifier.")}


def _own_name(key: str, model_type: Any) -> str:
    """A BERT weight name as the family's checkpoint names it (DistilBERT's and MPNet's own
    names)."""
    for own, bert in _RENAMES.get(model_type, ()):
        key = key.replace(bert, own, 1)
    return key


def relative_bias(weight: torch.Tensor, positions: int) -> torch.Tensor:
    """MPNet's relative position bias for sequences of up to `positions` tokens: (heads,
    positions, positions), entry (h, i, j) the bias head h adds to query i's score for key j.
    The buckets are MPNetEncoder.relative_position_bucket's, computed as it computes them on a
    CPU (float32; on a GPU it computes them there, where a logarithm one ulp off at a bucket's
    edge could move a distance to the next bucket): 8 exact distances each way, then
    logarithmic up to 128, 16 buckets a direction."""
    index = torch.arange(positions)
    n = index[:, None] - index[None, :]  # -(key - query), as MPNet's `n = -relative_position`
    half = _MPNET_BUCKETS // 2
    bucket = (n < 0).to(torch.long) * half
    n = n.abs()
    exact = half // 2
    large = exact + (
        torch.log(n.float() / exact) / math.log(_MPNET_MAX_DISTANCE / exact) * (half - exact)
    ).to(torch.long)
    large = torch.minimum(large, torch.full_like(large, half - 1))
    bucket += torch.where(n < exact, n, large)
    return weight[bucket.to(weight.device)].permute(2, 0, 1).contiguous()


def _norm(state: Mapping[str, torch.Tensor], prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
    return state[prefix + ".weight"], state[prefix + ".bias"]


def _layer(state: Mapping[str, torch.Tensor], prefix: str) -> linear.Layer:
    own = prefix + "attention.self."
    return linear.Layer(
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
