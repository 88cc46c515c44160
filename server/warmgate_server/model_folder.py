"""What the model folder says about how to embed with it, and what the flags override.

A sentence-transformers folder describes its own pipeline, read here the way
sentence-transformers reads it: `modules.json` lists the modules in order (a Transformer, a
Pooling, any Dense layers, a Normalize), each module's folder its configuration;
`config_sentence_transformers.json` holds the prompts, `sentence_bert_config.json` the input
limit and lowercasing. Both layouts found on the hub are read: the one sentence-transformers
writes today (module types under `sentence_transformers.base` and `.sentence_transformer`,
`{"pooling_mode": "cls"}`) and the older one (types under `sentence_transformers.models`,
boolean `pooling_mode_*_tokens` flags). A folder without modules.json may still be a decoder
(config.json), which embeds with its last token.

Anything this server cannot reproduce exactly is refused with a message naming the module,
the mode, the key or the field (ModelConfigError), never approximated: a module type other than
these four (matched by its full path), a pooling mode that cannot be read, a Dense layer that
reads or writes other features, custom code (an activation, a module, a model class) unless
--trust-remote-code allows it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import POOLINGS, ServerConfig

EMBED, RERANK, CLASSIFY = "embed", "rerank", "classify"
TASKS = (EMBED, RERANK, CLASSIFY)
"""What a served model does (--task, spec.model.task): embeds texts; scores (query, document)
pairs with a one-label cross-encoder; classifies texts or pairs into a classifier's labels."""
AMBIGUOUS = "ambiguous"
"""FolderSettings.task of a folder that could be either (resolve refuses it without --task)."""
SIGMOID = "torch.nn.modules.activation.Sigmoid"
IDENTITY = "torch.nn.modules.linear.Identity"
TANH = "torch.nn.modules.activation.Tanh"
ACTIVATIONS = {SIGMOID, IDENTITY, TANH}
"""The cross-encoder activations this server applies (sentence-transformers' defaults, and
Tanh); another is refused, naming it."""

# sentence-transformers' pooling mode names, and the server's (--pooling) for each.
ST_MODES = {
    "cls": "cls",
    "max": "max",
    "mean": "mean",
    "mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "weightedmean": "weightedmean",
    "lasttoken": "last",
}
# The older boolean flags, in the order sentence-transformers concatenates their vectors.
LEGACY_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}

# Module types by their full path (modules.json's `type`): the names sentence-transformers
# writes today, their package-level aliases, and the older `sentence_transformers.models` ones.
_MODULE_TYPES = {
    "Transformer": (
        "sentence_transformers.base.modules.transformer.Transformer",
        "sentence_transformers.base.modules.Transformer",
        "sentence_transformers.sentence_transformer.modules.Transformer",
        "sentence_transformers.models.Transformer",
    ),
    "Pooling": (
        "sentence_transformers.sentence_transformer.modules.pooling.Pooling",
        "sentence_transformers.sentence_transformer.modules.Pooling",
        "sentence_transformers.models.Pooling",
    ),
    "Dense": (
        "sentence_transformers.base.modules.dense.Dense",
        "sentence_transformers.base.modules.Dense",
        "sentence_transformers.sentence_transformer.modules.Dense",
        "sentence_transformers.models.Dense",
    ),
    "Normalize": (
        "sentence_transformers.base.modules.normalize.Normalize",
        "sentence_transformers.base.modules.Normalize",
        "sentence_transformers.sentence_transformer.modules.Normalize",
        "sentence_transformers.models.Normalize",
    ),
}
_SPARSE_TYPES = {
    "MLMTransformer": (
        "sentence_transformers.sparse_encoder.modules.mlm_transformer.MLMTransformer",
        "sentence_transformers.sparse_encoder.modules.MLMTransformer",
        "sentence_transformers.sparse_encoder.models.MLMTransformer",
    ),
    "SpladePooling": (
        "sentence_transformers.sparse_encoder.modules.splade_pooling.SpladePooling",
        "sentence_transformers.sparse_encoder.modules.SpladePooling",
        "sentence_transformers.sparse_encoder.models.SpladePooling",
    ),
}
"""A SparseEncoder's (SPLADE's) modules: its masked-language-model Transformer (the older
module; today a Transformer of transformer_task fill-mask) and its pooling (splade.py)."""
_CROSS_ENCODER_TYPES = {
    "LogitScore": (
        "sentence_transformers.cross_encoder.modules.logit_score.LogitScore",
        "sentence_transformers.cross_encoder.modules.LogitScore",
    ),
}
"""A CrossEncoder on a causal language model (Qwen3-Reranker's own form): its score is the
last token's logit of one token less another's (classify.py)."""
KIND_OF_TYPE = {
    path: kind
    for kinds in (_MODULE_TYPES, _SPARSE_TYPES, _CROSS_ENCODER_TYPES)
    for kind, paths in kinds.items()
    for path in paths
}

# config.json model types of decoder-only language models (embedding models built on them pool
# with the last token: e5-mistral, gte-Qwen2, Qwen3-Embedding, SFR, NV-Embed's base...).
_DECODER_TYPES = {
    "llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "gemma",
    "gemma2", "gemma3", "gemma3_text", "phi", "phi3", "gpt2", "gpt_neox", "gptj", "falcon",
    "olmo", "olmo2", "stablelm", "starcoder2", "mpt", "bloom", "opt",
}  # fmt: skip
# sentence_bert_config.json keys that change nothing the server computes (the rest, such as
# model_args or tokenizer_args, are refused: they change how the model or tokenizer loads).
_TRANSFORMER_KEYS = {
    "max_seq_length", "do_lower_case", "transformer_task", "modality_config",
    "module_output_name", "backend",
}  # fmt: skip
_FORWARD_MODALITY = {"text": {"method": "forward", "method_output_name": "last_hidden_state"}}
_LOGITS_MODALITY = {"text": {"method": "forward", "method_output_name": "logits"}}


class ModelConfigError(ValueError):
    """The folder asks for something this server cannot do; the message says what to change."""


@dataclass(frozen=True)
class DenseModule:
    """A Dense module: `activation(x @ weight.T + bias)` (+ x, or x through `residual`)."""

    path: str
    in_features: int
    out_features: int
    bias: bool
    activation: str
    """A torch.nn.Module class by its import path (torch.nn.modules.activation.Tanh, ...)."""
    residual: bool = False
    weights: Path | None = None
    """model.safetensors or pytorch_model.bin in the module's folder."""


@dataclass(frozen=True)
class NormalizeModule:
    path: str


Step = DenseModule | NormalizeModule

HEAD_FILES = {"sparse": "sparse_linear.pt", "colbert": "colbert_linear.pt"}
"""bge-m3's heads beside its encoder, by the output each gives, as FlagEmbedding saves and
loads them."""


@dataclass(frozen=True)
class MultiHeads:
    """bge-m3's outputs beyond the dense vector (multi.py): its lexical weights
    (`sparse_linear.pt`: hidden -> 1) and its ColBERT vectors (`colbert_linear.pt`: hidden ->
    hidden), each computed from the same pass's token states. None: the folder lacks it."""

    sparse: Path | None = None
    colbert: Path | None = None

    @property
    def outputs(self) -> tuple[str, ...]:
        return (
            ("dense",)
            + ("sparse",) * (self.sparse is not None)
            + (("colbert",) * (self.colbert is not None))
        )


SPLADE_POOLINGS = ("max", "sum")
SPLADE_ACTIVATIONS = ("relu", "log1p_relu")


@dataclass(frozen=True)
class SpladeSettings:
    """A SparseEncoder's SpladePooling (splade.py): the largest or the sum over the tokens of
    log(1 + ReLU(logit)) (log1p twice for log1p_relu)."""

    pooling: str = "max"
    activation: str = "relu"


def multi_heads(folder: Path) -> MultiHeads | None:
    """The folder's bge-m3 heads, or None where it has neither."""
    found = {part: folder / name for part, name in HEAD_FILES.items() if (folder / name).is_file()}
    return MultiHeads(**found) if found else None


@dataclass(frozen=True)
class LogitScore:
    """sentence-transformers' LogitScore after a causal language model: a pair's score is the
    logit of `true_token_id` at its prompt's last token, less that of `false_token_id` (None:
    the first alone). The pair is the model's chat template rendered over a `query` and a
    `document` message (the model's default prompt, if any, a `system` message first), as
    sentence-transformers' CrossEncoder renders it."""

    true_token_id: int
    false_token_id: int | None


@dataclass(frozen=True)
class FolderSettings:
    """What a sentence-transformers folder says (None: it says nothing)."""

    pooling: tuple[str, ...] | None = None
    """Server pooling names, in the order their vectors are concatenated."""
    pooling_source: str = ""
    normalize: bool | None = None
    normalize_source: str = ""
    steps: tuple[Step, ...] = ()
    """Modules after Pooling, in order, but a final Normalize (that is `normalize`)."""
    prompts: Mapping[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    include_prompt: bool = True
    """Pooling's include_prompt: false means the model pools without its prompt's tokens."""
    lowercase: bool = False
    """sentence_bert_config.json's do_lower_case: texts are lowercased before tokenizing."""
    max_seq_length: int | None = None
    decoder: str | None = None
    """The architecture when config.json describes a decoder-only model (decoder_name)."""
    model_type: str | None = None
    """config.json's model_type (None where it has none or cannot be read)."""
    task: str = EMBED
    """What the folder's own files say it does (TASKS): embed, or, for a cross-encoder or a
    `*ForSequenceClassification` checkpoint, rerank (one label) or classify (more)."""
    task_source: str = "modules.json pools token vectors (an embedding model)"
    activation: str | None = None
    """A cross-encoder's activation as its folder names it (an import path), else None: the
    default, Sigmoid for one label and Identity for more (sentence-transformers')."""
    labels: tuple[str, ...] = ()
    """A classifier's labels in id order (config.json's id2label)."""
    multi: MultiHeads | None = None
    """An embedder's sparse and ColBERT heads (bge-m3's), or None."""
    splade: SpladeSettings | None = None
    """A SparseEncoder's pooling: the model gives sparse vectors only (splade.py), or None."""
    logit_score: LogitScore | None = None
    """A CrossEncoder on a causal language model: the tokens whose logits score a pair, and
    its chat template renders each pair; else None."""


@dataclass(frozen=True)
class ModelSettings:
    """How this server embeds: each value with where it came from."""

    pooling_modes: tuple[str, ...]
    normalize: bool
    prompts: Mapping[str, str]
    default_prompt_name: str | None
    chosen_by: Mapping[str, str]
    prompt_text: str | None = None
    """--default-prompt: a text of the flag's own, instead of a named prompt."""
    max_input_length: int | None = None
    """Tokens per input the server accepts (set by the engine, which knows the buckets)."""
    include_prompt: bool = True
    steps: tuple[Step, ...] = ()
    lowercase: bool = False
    task: str = EMBED
    """TASKS: what the server does with the model (its routes answer that, the others 424)."""
    activation: str | None = None
    """A re-ranker's or classifier's activation (an import path; None: the default)."""
    labels: tuple[str, ...] = ()
    multi: MultiHeads | None = None
    """The sparse and ColBERT heads served beside the dense vector (an embedder's), or None."""
    splade: SpladeSettings | None = None
    """A SparseEncoder's pooling (its sparse vectors are all it gives), or None."""
    logit_score: LogitScore | None = None
    """A causal-LM re-ranker's scoring tokens (FolderSettings.logit_score), or None."""

    @property
    def outputs(self) -> tuple[str, ...]:
        """What the model gives: dense, and sparse and colbert where the folder has their
        heads (bge-m3's); a SparseEncoder (SPLADE) sparse only."""
        if self.splade is not None:
            return ("sparse",)
        return self.multi.outputs if self.multi is not None else ("dense",)

    @property
    def pooling(self) -> str:
        """The pooling as --pooling names it ("cls"; several modes joined: "cls+mean"); a
        SparseEncoder's "splade" (TEI's name)."""
        return "splade" if self.splade is not None else "+".join(self.pooling_modes)

    @property
    def default_prompt(self) -> str:
        """Text put before every input (the model's default prompt), or ""."""
        if self.prompt_text is not None:
            return self.prompt_text
        return self.prompts.get(self.default_prompt_name or "", "")

    def prompt_named(self, name: str) -> str:
        """The text of the model's prompt `name`; KeyError when it has none of that name."""
        return self.prompts[name]

    def as_json(self) -> dict[str, Any]:
        return {
            "pooling": self.pooling,
            "normalize": self.normalize,
            "modules": [_describe(step) for step in self.steps],
            "include_prompt": self.include_prompt,
            "lowercase": self.lowercase,
            "prompts": dict(self.prompts),
            "default_prompt_name": self.default_prompt_name,
            "default_prompt": self.default_prompt,
            "max_input_length": self.max_input_length,
            "task": self.task,
            "outputs": list(self.outputs),
            **(
                {"splade": {"pooling": self.splade.pooling, "activation": self.splade.activation}}
                if self.splade is not None
                else {}
            ),
            **(
                {
                    "logit_score": {
                        "true_token_id": self.logit_score.true_token_id,
                        "false_token_id": self.logit_score.false_token_id,
                    }
                }
                if self.logit_score is not None
                else {}
            ),
            **(
                {"activation": self.activation or "default", "labels": list(self.labels)}
                if self.task != EMBED
                else {}
            ),
            "chosen_by": dict(self.chosen_by),
        }


def _describe(step: Step) -> str:
    if isinstance(step, NormalizeModule):
        return f"Normalize ({step.path})"
    activation = step.activation.rsplit(".", 1)[-1]
    return f"Dense {step.in_features}->{step.out_features} {activation} ({step.path})"


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _required_json(path: Path, relative: str) -> dict[str, Any]:
    """A module's config.json: ModelConfigError when it is missing or not a JSON object."""
    try:
        value = json.loads(path.read_text())
    except OSError:
        raise ModelConfigError(f"{relative} is missing: the module cannot be read") from None
    except ValueError as exc:
        raise ModelConfigError(f"{relative} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ModelConfigError(f"{relative} is not a JSON object")
    return value


def pooling_modes(config: Mapping[str, Any], relative: str) -> tuple[str, ...]:
    """The server pooling names of a Pooling config in either layout, in concatenation order:
    `pooling_mode` (a string or a list) wins, as in sentence-transformers; else the boolean
    flags (none set: mean, sentence-transformers' default)."""
    if "pooling_mode" in config:
        raw = config["pooling_mode"]
        modes = [raw] if isinstance(raw, str) else raw
        if not isinstance(modes, list | tuple) or not modes:
            raise ModelConfigError(
                f"{relative}: pooling_mode {raw!r} is neither a mode nor a list of modes"
            )
        unknown = [mode for mode in modes if not isinstance(mode, str) or mode not in ST_MODES]
        if unknown:
            raise ModelConfigError(
                f"{relative}: pooling_mode {', '.join(map(repr, unknown))} is not a "
                f"sentence-transformers pooling ({', '.join(ST_MODES)})"
            )
        return tuple(ST_MODES[mode] for mode in modes)
    not_flags = [
        key for key in config if key.startswith("pooling_mode") and key not in LEGACY_FLAGS
    ]
    if not_flags:
        raise ModelConfigError(
            f"{relative}: {', '.join(not_flags)} is not a pooling sentence-transformers knows"
        )
    for key in LEGACY_FLAGS:
        if key in config and not isinstance(config[key], bool):
            raise ModelConfigError(f"{relative}: {key} is {config[key]!r}, not true or false")
    if not any(key in config for key in LEGACY_FLAGS):
        raise ModelConfigError(
            f"{relative} names no pooling mode (neither pooling_mode nor pooling_mode_*_tokens)"
        )
    chosen = tuple(ST_MODES[mode] for key, mode in LEGACY_FLAGS.items() if config.get(key))
    return chosen or ("mean",)  # every flag false: sentence-transformers pools with the mean


def _module_list(folder: Path) -> list[dict[str, Any]] | None:
    path = folder / "modules.json"
    if not path.is_file():
        return None
    modules = _read_json(path)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ModelConfigError("modules.json is not a list of modules")
    return modules


_CLASSIFY_MODALITY = {"text": {"method": "forward", "method_output_name": "logits"}}
_TEXT_GENERATION = {"transformer_task": "text-generation", "module_output_name": "causal_logits"}


def _transformer_settings(
    folder: Path,
    path: str,
    classifier: bool = False,
    fill_mask: bool = False,
    text_generation: bool = False,
) -> tuple[bool, int | None]:
    """(lowercase, max_seq_length) from the Transformer module's sentence_bert_config.json;
    `classifier`: a CrossEncoder's (sequence classification, its logits as scores);
    `fill_mask`: a SparseEncoder's (its MLM head's logits, splade.py); `text_generation`: a
    causal-LM CrossEncoder's (its causal logits, LogitScore's input)."""
    if path not in ("", "."):
        raise ModelConfigError(
            f"modules.json puts the Transformer in {path!r}: this server loads the model from "
            "the folder's root only"
        )
    config = _read_json(folder / "sentence_bert_config.json")
    if config is None and not text_generation:
        return False, None
    config = {} if config is None else config
    if not isinstance(config, dict):
        raise ModelConfigError("sentence_bert_config.json is not a JSON object")
    changing = sorted(
        key for key, value in config.items() if key not in _TRANSFORMER_KEYS and value
    )
    if changing:
        raise ModelConfigError(
            f"sentence_bert_config.json sets {', '.join(changing)}, which changes how the model "
            "or its tokenizer loads: this server does not apply it"
        )
    if text_generation:
        found = {key: config.get(key) for key in _TEXT_GENERATION}
        if found != _TEXT_GENERATION:
            raise ModelConfigError(
                f"sentence_bert_config.json: a causal-LM CrossEncoder's Transformer with "
                f"{json.dumps(found)}: this server scores with {json.dumps(_TEXT_GENERATION)} "
                "and the tokenizer's own chat template only"
            )
        length = config.get("max_seq_length")
        return bool(config.get("do_lower_case")), length if isinstance(length, int) else None
    if classifier:
        expected = (_CLASSIFY_MODALITY, "scores", "sequence-classification")
        found = (
            config.get("modality_config", _CLASSIFY_MODALITY),
            config.get("module_output_name", "scores"),
            config.get("transformer_task", "sequence-classification"),
        )
        if found != expected:
            raise ModelConfigError(
                f"sentence_bert_config.json: a CrossEncoder's Transformer with modality_config "
                f"{json.dumps(found[0])}, module_output_name {found[1]!r} and transformer_task "
                f"{found[2]!r}: this server scores with a sequence classifier's logits only"
            )
        length = config.get("max_seq_length")
        return bool(config.get("do_lower_case")), length if isinstance(length, int) else None
    if fill_mask:
        modality = config.get("modality_config", _LOGITS_MODALITY)
        if modality != _LOGITS_MODALITY or config.get("transformer_task") not in (
            None,
            "fill-mask",
        ):
            raise ModelConfigError(
                f"sentence_bert_config.json: a SparseEncoder's Transformer with "
                f"modality_config {json.dumps(modality)} and transformer_task "
                f"{config.get('transformer_task')!r}: this server pools an MLM head's logits "
                "(fill-mask) only"
            )
        length = config.get("max_seq_length")
        return bool(config.get("do_lower_case")), length if isinstance(length, int) else None
    modality = config.get("modality_config")
    if modality not in (None, _FORWARD_MODALITY):
        raise ModelConfigError(
            f"sentence_bert_config.json: modality_config {json.dumps(modality)} is not text "
            "through the model's forward pass: this server embeds text only"
        )
    if config.get("module_output_name") not in (None, "token_embeddings"):
        raise ModelConfigError(
            f"sentence_bert_config.json: module_output_name {config['module_output_name']!r}"
            " is not token_embeddings"
        )
    if config.get("transformer_task") not in (None, "feature-extraction"):
        raise ModelConfigError(
            f"sentence_bert_config.json: transformer_task {config['transformer_task']!r} is "
            "not feature-extraction"
        )
    if config.get("backend") not in (None, "torch"):
        raise ModelConfigError(f"sentence_bert_config.json: backend {config['backend']!r}")
    length = config.get("max_seq_length")
    return bool(config.get("do_lower_case")), length if isinstance(length, int) else None


def _dense(folder: Path, path: str, trust_remote_code: bool | None) -> DenseModule:
    relative = f"{path}/config.json"
    config = _required_json(folder / path / "config.json", relative)
    for key in ("module_input_name", "module_output_name"):
        if config.get(key, "sentence_embedding") != "sentence_embedding":
            raise ModelConfigError(
                f"{relative}: {key} {config[key]!r}: this server runs Dense modules on the "
                "pooled sentence embedding only"
            )
    try:
        in_features, out_features = int(config["in_features"]), int(config["out_features"])
    except (KeyError, TypeError, ValueError):
        raise ModelConfigError(f"{relative} has no in_features and out_features") from None
    activation = config.get("activation_function", "torch.nn.modules.activation.Tanh")
    if not isinstance(activation, str):
        raise ModelConfigError(f"{relative}: activation_function {activation!r} is not a path")
    if not activation.startswith("torch.") and not trust_remote_code:
        raise ModelConfigError(
            f"{relative}: activation_function {activation!r} is custom code: set "
            "spec.model.trustRemoteCode: true (--trust-remote-code) to run it (transformers "
            "has no class of its own for it)"
        )
    weights = next(
        (
            folder / path / name
            for name in ("model.safetensors", "pytorch_model.bin")
            if (folder / path / name).is_file()
        ),
        None,
    )
    if weights is None:
        raise ModelConfigError(f"{path}/ has no model.safetensors or pytorch_model.bin")
    return DenseModule(
        path=path,
        in_features=in_features,
        out_features=out_features,
        bias=config.get("bias", True) is not False,
        activation=activation,
        residual=config.get("use_residual", False) is True,
        weights=weights,
    )


def read_folder(folder: Path, trust_remote_code: bool | None = None) -> FolderSettings:
    """The folder's own settings; ModelConfigError for whatever this server cannot reproduce."""
    modules = _module_list(folder)
    st_config = _read_json(folder / "config_sentence_transformers.json") or {}
    model_config = _read_json(folder / "config.json")
    model_config = model_config if isinstance(model_config, dict) else {}
    model_type = model_config.get("model_type")
    prompts = st_config.get("prompts") if isinstance(st_config.get("prompts"), dict) else {}
    common = {
        "prompts": {str(k): str(v) for k, v in prompts.items()},
        "default_prompt_name": st_config.get("default_prompt_name") or None,
        "decoder": decoder_name(model_config),
        "model_type": model_type if isinstance(model_type, str) else None,
    }
    classifier = _classifier(model_config)
    if st_config.get("model_type") == "CrossEncoder":
        return _cross_encoder(folder, modules, st_config, model_config, common)
    types = [str(module.get("type", "")) for module in modules or ()]
    if st_config.get("model_type") == "SparseEncoder" or any(
        KIND_OF_TYPE.get(kind) in _SPARSE_TYPES for kind in types
    ):
        return _sparse_encoder(folder, modules, common)
    if modules is None:
        if classifier is not None:
            return _classifier_settings(model_config, classifier, common, "config.json")
        return FolderSettings(**common)
    kinds = []
    for module in modules:
        kind = KIND_OF_TYPE.get(str(module.get("type", "")))
        if kind is None:
            raise ModelConfigError(
                f"modules.json lists {module.get('type')!r} ({module.get('path') or 'the root'})"
                ": this server reproduces sentence-transformers' Transformer, Pooling, Dense and "
                "Normalize modules only, and would serve vectors unlike the model's own"
            )
        kinds.append(kind)
    if kinds[:1] != ["Transformer"] or kinds.count("Transformer") != 1:
        raise ModelConfigError(
            f"modules.json lists {', '.join(kinds)}: this server needs one Transformer, first"
        )
    lowercase, max_seq_length = _transformer_settings(folder, str(modules[0].get("path") or ""))
    rest = list(zip(kinds[1:], modules[1:], strict=True))
    if not rest or rest[0][0] != "Pooling":
        raise ModelConfigError(
            "modules.json has no Pooling after the Transformer: this server embeds with a "
            "pooled sentence vector only (token vectors are /embed_all's)"
        )
    pooling_path = str(rest[0][1].get("path") or "1_Pooling")
    relative = f"{pooling_path}/config.json"
    pooling_config = _required_json(folder / relative, relative)
    modes = pooling_modes(pooling_config, relative)
    include_prompt = pooling_config.get("include_prompt", True) is not False
    steps: list[Step] = []
    for kind, module in rest[1:]:
        path = str(module.get("path") or "")
        if kind == "Pooling" or kind == "Transformer":
            raise ModelConfigError(f"modules.json lists a second {kind} ({path})")
        if kind == "Dense":
            steps.append(_dense(folder, path, trust_remote_code))
        else:
            steps.append(NormalizeModule(path))
    normalize = bool(steps) and isinstance(steps[-1], NormalizeModule)
    if normalize:
        steps.pop()
    if classifier is not None:
        common["labels"] = _labels(model_config)
        common["task"] = AMBIGUOUS
        common["task_source"] = (
            f"modules.json pools token vectors (an embedding model) and config.json's "
            f"architectures name {classifier} (a classifier)"
        )
    return FolderSettings(
        multi=multi_heads(folder) if classifier is None else None,
        pooling=modes,
        pooling_source=relative,
        normalize=normalize,
        normalize_source="modules.json",
        steps=tuple(steps),
        include_prompt=include_prompt,
        lowercase=lowercase,
        max_seq_length=max_seq_length,
        **common,
    )


def _sparse_encoder(
    folder: Path, modules: list[dict[str, Any]] | None, common: dict[str, Any]
) -> FolderSettings:
    """A sentence-transformers SparseEncoder folder: a masked-language-model Transformer (a
    Transformer of transformer_task fill-mask, or the older MLMTransformer), then
    SpladePooling: SPLADE, served as its sparse vectors (splade.py). Any other SparseEncoder
    (inference-free SPLADE's Router, a SparseAutoEncoder) is refused, naming its modules."""
    kinds = [KIND_OF_TYPE.get(str(module.get("type", ""))) for module in modules or ()]
    if kinds not in (["Transformer", "SpladePooling"], ["MLMTransformer", "SpladePooling"]):
        listed = [str(module.get("type")) for module in modules or ()]
        raise ModelConfigError(
            f"a SparseEncoder whose modules.json lists {listed or 'nothing'}: this server "
            "serves SPLADE only (a fill-mask Transformer, then SpladePooling)"
        )
    assert modules is not None
    lowercase, max_seq_length = _transformer_settings(
        folder, str(modules[0].get("path") or ""), fill_mask=True
    )
    pooling_path = str(modules[1].get("path") or "1_SpladePooling")
    relative = f"{pooling_path}/config.json"
    config = _read_json(folder / relative)
    config = config if isinstance(config, dict) else {}
    pooling = config.get("pooling_strategy", "max")
    activation = config.get("activation_function", "relu")
    if pooling not in SPLADE_POOLINGS:
        raise ModelConfigError(
            f"{relative}: pooling_strategy {pooling!r} is not one SpladePooling computes "
            f"({', '.join(SPLADE_POOLINGS)})"
        )
    if activation not in SPLADE_ACTIVATIONS:
        raise ModelConfigError(
            f"{relative}: activation_function {activation!r} is not one SpladePooling "
            f"computes ({', '.join(SPLADE_ACTIVATIONS)})"
        )
    return FolderSettings(
        **{
            **common,
            "task_source": "config_sentence_transformers.json: a SparseEncoder (SPLADE)",
        },
        splade=SpladeSettings(pooling, activation),
        lowercase=lowercase,
        max_seq_length=max_seq_length,
    )


def _classifier(config: Mapping[str, Any]) -> str | None:
    """The `*ForSequenceClassification` architecture config.json names, or None."""
    names = [str(name) for name in config.get("architectures") or []]
    return next((name for name in names if name.endswith("ForSequenceClassification")), None)


def _labels(config: Mapping[str, Any]) -> tuple[str, ...]:
    """config.json's labels in id order (id2label; else num_labels LABEL_i)."""
    id2label = config.get("id2label")
    if isinstance(id2label, dict) and id2label:
        try:
            ordered = sorted((int(key), str(value)) for key, value in id2label.items())
        except (TypeError, ValueError):
            raise ModelConfigError("config.json: id2label's keys are not label ids") from None
        return tuple(label for _, label in ordered)
    count = config.get("num_labels")
    return tuple(f"LABEL_{index}" for index in range(count if isinstance(count, int) else 2))


def _checked_activation(activation: Any, source: str) -> str | None:
    """A cross-encoder's activation_fn as `source` names it, if this server applies it."""
    if activation is not None and activation not in ACTIVATIONS:
        raise ModelConfigError(
            f"{source}: activation_fn {activation!r} is not one this server applies "
            f"({', '.join(sorted(ACTIVATIONS))})"
        )
    return activation


def _classifier_settings(
    model_config: Mapping[str, Any],
    architecture: str,
    common: dict[str, Any],
    source: str,
    activation: Any = None,
    max_seq_length: int | None = None,
    lowercase: bool = False,
) -> FolderSettings:
    labels = _labels(model_config)
    if activation is None:  # an older CrossEncoder's, in config.json
        legacy = model_config.get("sentence_transformers")
        activation = legacy.get("activation_fn") if isinstance(legacy, dict) else None
    activation = _checked_activation(activation, source)
    task = RERANK if len(labels) == 1 else CLASSIFY
    kind = "one label: a re-ranker" if task == RERANK else f"{len(labels)} labels: a classifier"
    return FolderSettings(
        **{**common, "task": task, "task_source": f"{source}: {architecture}, {kind}"},
        activation=activation,
        labels=labels,
        max_seq_length=max_seq_length,
        lowercase=lowercase,
    )


def _cross_encoder(
    folder: Path,
    modules: list[dict[str, Any]] | None,
    st_config: Mapping[str, Any],
    model_config: Mapping[str, Any],
    common: dict[str, Any],
) -> FolderSettings:
    """A sentence-transformers CrossEncoder folder (config_sentence_transformers.json's
    model_type): one Transformer module that classifies, with its activation."""
    architecture = _classifier(model_config)
    causal = [str(name) for name in model_config.get("architectures") or []]
    if architecture is None and any(name.endswith("ForCausalLM") for name in causal):
        return _causal_cross_encoder(folder, modules, st_config, common, causal[0])
    if architecture is None:
        raise ModelConfigError(
            "config_sentence_transformers.json says CrossEncoder, but config.json's "
            f"architectures ({model_config.get('architectures')}) name no "
            "*ForSequenceClassification model"
        )
    lowercase, max_seq_length = False, None
    if modules is not None:
        kinds = [KIND_OF_TYPE.get(str(module.get("type", ""))) for module in modules]
        if kinds != ["Transformer"]:
            raise ModelConfigError(
                f"modules.json of a CrossEncoder lists {[m.get('type') for m in modules]}: "
                "this server scores with one Transformer module only"
            )
        lowercase, max_seq_length = _transformer_settings(
            folder, str(modules[0].get("path") or ""), classifier=True
        )
    return _classifier_settings(
        model_config,
        architecture,
        common,
        "config_sentence_transformers.json",
        st_config.get("activation_fn"),
        max_seq_length,
        lowercase,
    )


def _causal_cross_encoder(
    folder: Path,
    modules: list[dict[str, Any]] | None,
    st_config: Mapping[str, Any],
    common: dict[str, Any],
    architecture: str,
) -> FolderSettings:
    """Qwen3-Reranker's own form as sentence-transformers 6 saves it: a Transformer of
    transformer_task text-generation on a *ForCausalLM, then LogitScore; each pair rendered by
    the tokenizer's chat template (query and document messages)."""
    kinds = [KIND_OF_TYPE.get(str(module.get("type", ""))) for module in modules or ()]
    if kinds != ["Transformer", "LogitScore"]:
        listed = [str(module.get("type")) for module in modules or ()]
        raise ModelConfigError(
            f"a CrossEncoder on a causal language model ({architecture}) whose modules.json "
            f"lists {listed or 'nothing'}: this server scores such a model with a Transformer, "
            "then LogitScore (Qwen3-Reranker's form) only"
        )
    assert modules is not None
    _lowercase, length = _transformer_settings(  # the chat template's text as it is
        folder, str(modules[0].get("path") or ""), text_generation=True
    )
    score_path = str(modules[1].get("path") or "1_LogitScore")
    relative = f"{score_path}/config.json"
    score = _required_json(folder / relative, relative)
    true_id, false_id = score.get("true_token_id"), score.get("false_token_id")
    if (
        not isinstance(true_id, int)
        or not (false_id is None or isinstance(false_id, int))
        or score.get("module_input_name", "causal_logits") != "causal_logits"
    ):
        raise ModelConfigError(
            f"{relative}: true_token_id {true_id!r}, false_token_id {false_id!r} and "
            f"module_input_name {score.get('module_input_name')!r}: this server scores with "
            "token ids of the causal logits"
        )
    tokenizer_files = ("chat_template.jinja", "chat_template.json")
    tokenizer_config = _read_json(folder / "tokenizer_config.json")
    if not any((folder / name).is_file() for name in tokenizer_files) and not (
        isinstance(tokenizer_config, dict) and tokenizer_config.get("chat_template")
    ):
        raise ModelConfigError(
            "a causal-LM CrossEncoder without a chat template (chat_template.jinja or "
            "tokenizer_config.json's chat_template): sentence-transformers renders each "
            "(query, document) pair with it, and nothing else says how"
        )
    activation = _checked_activation(
        st_config.get("activation_fn"), "config_sentence_transformers.json"
    )
    kind = "its last token's logit of token " + (
        f"{true_id} less that of {false_id}" if false_id is not None else f"{true_id}"
    )
    return FolderSettings(
        **{
            **common,
            "task": RERANK,
            "task_source": (
                f"config_sentence_transformers.json: a CrossEncoder on {architecture} "
                f"(LogitScore: {kind}), a re-ranker"
            ),
        },
        activation=activation,
        labels=("LABEL_0",),
        max_seq_length=length,
        logit_score=LogitScore(true_id, false_id),
    )


def decoder_name(config: Mapping[str, Any]) -> str | None:
    """The architecture when config.json (`config`) describes a decoder-only model, else
    None."""
    architectures = [str(name) for name in config.get("architectures") or []]
    model_type = str(config.get("model_type") or "")
    decoder = (
        config.get("is_decoder") is True
        or model_type in _DECODER_TYPES
        or any(name.endswith(("ForCausalLM", "LMHeadModel")) for name in architectures)
    )
    if not decoder:
        return None
    return architectures[0] if architectures else model_type or "is_decoder"


def resolve(
    config: ServerConfig, folder: Path, found: FolderSettings | None = None
) -> ModelSettings:
    """The flags where given, else the folder's settings, else the defaults (mean pooling, or
    the last token for a decoder; normalised vectors). ModelConfigError when the two cannot
    agree (a --pooling whose width no Dense module takes, a prompt name the model lacks)."""
    if found is None:
        found = read_folder(folder, config.trust_remote_code)
    chosen_by: dict[str, str] = {}
    task = _task(config, found)
    chosen_by["task"] = "--task" if config.task != "auto" else found.task_source
    if config.pooling is not None:
        modes, chosen_by["pooling"] = (config.pooling,), "--pooling"
        if found.pooling is not None and len(found.pooling) != 1 and found.steps:
            raise ModelConfigError(
                f"--pooling {config.pooling}: the model's Dense modules take "
                f"{'+'.join(found.pooling)} pooled vectors; drop --pooling"
            )
    elif found.pooling is not None:
        modes, chosen_by["pooling"] = found.pooling, found.pooling_source
    elif found.decoder is not None:
        # Right-padded inputs: the last real token has seen the whole input.
        modes = ("last",)
        chosen_by["pooling"] = (
            f"config.json: a decoder ({found.decoder}) embeds with its last token"
        )
    else:
        modes, chosen_by["pooling"] = ("mean",), "default (the folder names no pooling)"
    if config.normalize is not None:
        normalize, chosen_by["normalize"] = config.normalize, "--normalize"
    elif found.normalize is not None:
        normalize, chosen_by["normalize"] = found.normalize, found.normalize_source
    else:
        normalize, chosen_by["normalize"] = True, "default (no modules.json)"
    if found.default_prompt_name and found.default_prompt_name not in found.prompts:
        raise ModelConfigError(
            f"config_sentence_transformers.json: default_prompt_name "
            f"{found.default_prompt_name!r} is not one of its prompts"
        )
    default_name, prompt_text = found.default_prompt_name, None
    chosen_by["prompt"] = (
        "config_sentence_transformers.json" if default_name else "default (no prompt)"
    )
    if config.default_prompt is not None:
        default_name, prompt_text = None, config.default_prompt
        chosen_by["prompt"] = "--default-prompt"
    elif config.default_prompt_name is not None:
        if config.default_prompt_name not in found.prompts:
            names = ", ".join(sorted(found.prompts)) or "none"
            raise ModelConfigError(
                f"--default-prompt-name {config.default_prompt_name!r}: the model's prompts "
                f"(config_sentence_transformers.json) are: {names}"
            )
        default_name = config.default_prompt_name
        chosen_by["prompt"] = "--default-prompt-name"
    assert all(mode in POOLINGS for mode in modes), modes
    return ModelSettings(
        pooling_modes=modes,
        normalize=normalize,
        prompts=found.prompts,
        default_prompt_name=default_name,
        chosen_by=chosen_by,
        prompt_text=prompt_text,
        include_prompt=found.include_prompt,
        steps=found.steps,
        lowercase=found.lowercase,
        task=task,
        activation=found.activation,
        labels=found.labels,
        multi=found.multi if task == EMBED else None,
        splade=found.splade,
        logit_score=found.logit_score,
    )


def _task(config: ServerConfig, found: FolderSettings) -> str:
    """--task where given (and the folder can do it), else the folder's own; a folder that
    could be either is refused, naming the field that decides."""
    wanted = config.task
    if wanted == "auto":
        if found.task == AMBIGUOUS:
            raise ModelConfigError(
                f"the folder could be served two ways ({found.task_source}): say which with "
                "--task embed or --task rerank|classify (an EmbeddingService's spec.model.task)"
            )
        return found.task
    if found.task == AMBIGUOUS:
        if wanted == EMBED:
            return EMBED
        labels = len(found.labels) or 1
        if (wanted == RERANK) != (labels == 1):
            raise ModelConfigError(
                f"--task {wanted}: the classifier has {labels} labels (a re-ranker has one)"
            )
        return wanted
    if wanted != found.task:
        raise ModelConfigError(
            f"--task {wanted}, but the folder is a {found.task} model ({found.task_source})"
        )
    return wanted
