"""What the model folder says about how to embed with it, and what the flags override.

A sentence-transformers folder describes its own pipeline: `modules.json` lists the modules
(a Pooling module, and a Normalize module when the vectors are L2-normalised),
`1_Pooling/config.json` (or wherever modules.json points) says which pooling, and
`config_sentence_transformers.json` holds the prompts, `sentence_bert_config.json` the input
limit. A folder without them may still be a decoder (config.json), which embeds with its last
token. The server follows the folder unless a flag says otherwise, reports what it chose and
why, and refuses at start what it cannot compute (a max pooling, a Dense layer after pooling,
pooling that leaves the prompt out), rather than serving vectors that differ from the model's
own.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import POOLINGS, ServerConfig

# sentence-transformers' Pooling config keys, and the pooling each one means here.
_POOLING_MODES = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",
}
_UNSUPPORTED_MODES = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)


# Module types (the last part of modules.json's `type`) whose output this server reproduces.
_SERVED_MODULES = {"Transformer", "Pooling", "Normalize"}
# config.json model types of decoder-only language models (embedding models built on them pool
# with the last token: e5-mistral, gte-Qwen2, Qwen3-Embedding, SFR, NV-Embed's base...).
_DECODER_TYPES = {
    "llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "gemma",
    "gemma2", "gemma3", "gemma3_text", "phi", "phi3", "gpt2", "gpt_neox", "gptj", "falcon",
    "olmo", "olmo2", "stablelm", "starcoder2", "mpt", "bloom", "opt",
}  # fmt: skip


class ModelConfigError(ValueError):
    """The folder asks for something this server cannot do; the message says what to change."""


@dataclass(frozen=True)
class FolderSettings:
    """What a sentence-transformers folder says (None: it says nothing)."""

    pooling: str | None = None
    pooling_source: str = ""
    normalize: bool | None = None
    normalize_source: str = ""
    prompts: Mapping[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    include_prompt: bool = True
    """Pooling's include_prompt: false means the model pools without its prompt's tokens."""


@dataclass(frozen=True)
class ModelSettings:
    """How this server embeds: each value with where it came from."""

    pooling: str
    normalize: bool
    prompts: Mapping[str, str]
    default_prompt_name: str | None
    chosen_by: Mapping[str, str]
    prompt_text: str | None = None
    """--default-prompt: a text of the flag's own, instead of a named prompt."""
    max_input_length: int | None = None
    """Tokens per input the server accepts (set by the engine, which knows the buckets)."""

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
            "prompts": dict(self.prompts),
            "default_prompt_name": self.default_prompt_name,
            "default_prompt": self.default_prompt,
            "max_input_length": self.max_input_length,
            "chosen_by": dict(self.chosen_by),
        }


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_folder(folder: Path, check_pooling: bool = True) -> FolderSettings:
    """The folder's own settings; ModelConfigError for modules this server cannot reproduce,
    and (`check_pooling`) for a pooling no server mode matches."""
    modules = _read_json(folder / "modules.json")
    if not isinstance(modules, list):
        return FolderSettings()
    types = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    others = sorted(name for name in types if name not in _SERVED_MODULES)
    if others:
        listed = ", ".join(f"{name} ({types[name].get('path') or '?'})" for name in others)
        raise ModelConfigError(
            f"modules.json lists {listed}: this server reproduces Transformer, Pooling and "
            "Normalize modules only, and would serve vectors unlike the model's own"
        )
    pooling, pooling_source, include_prompt = None, "", True
    if "Pooling" in types:
        relative = f"{types['Pooling'].get('path') or '1_Pooling'}/config.json"
        config = _read_json(folder / relative) or {}
        include_prompt = config.get("include_prompt", True) is not False
        chosen = [mode for key, mode in _POOLING_MODES.items() if config.get(key)]
        unsupported = [key for key in _UNSUPPORTED_MODES if config.get(key)]
        if check_pooling and (unsupported or len(chosen) > 1):
            raise ModelConfigError(
                f"{relative} asks for {', '.join(unsupported + chosen)}: this server pools with "
                "one of mean, cls or last token; pass --pooling to choose one anyway"
            )
        if len(chosen) == 1:
            pooling, pooling_source = chosen[0], relative
    normalize = "Normalize" in types
    st_config = _read_json(folder / "config_sentence_transformers.json") or {}
    prompts = st_config.get("prompts") if isinstance(st_config.get("prompts"), dict) else {}
    return FolderSettings(
        pooling=pooling,
        pooling_source=pooling_source,
        normalize=normalize,
        normalize_source="modules.json",
        prompts={str(k): str(v) for k, v in prompts.items()},
        default_prompt_name=st_config.get("default_prompt_name") or None,
        include_prompt=include_prompt,
    )


def decoder_name(folder: Path) -> str | None:
    """The architecture when config.json describes a decoder-only model, else None."""
    config = _read_json(folder / "config.json")
    if not isinstance(config, dict):
        return None
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


def resolve(config: ServerConfig, folder: Path) -> ModelSettings:
    """The flags where given, else the folder's settings, else the defaults (mean pooling,
    normalised vectors). ModelConfigError when the folder's pooling is unsupported and no
    --pooling overrides it."""
    chosen_by: dict[str, str] = {}
    if config.pooling is not None:
        pooling, chosen_by["pooling"] = config.pooling, "--pooling"
        found = read_folder(folder, check_pooling=False)
    else:
        found = read_folder(folder)
        decoder = decoder_name(folder)
        if found.pooling is not None:
            pooling, chosen_by["pooling"] = found.pooling, found.pooling_source
        elif decoder is not None:
            # Right-padded inputs: the last real token has seen the whole input.
            pooling = "last"
            chosen_by["pooling"] = f"config.json: a decoder ({decoder}) embeds with its last token"
        else:
            pooling, chosen_by["pooling"] = "mean", "default (the folder names no pooling)"
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
    if not found.include_prompt and (found.prompts or prompt_text):
        raise ModelConfigError(
            "the Pooling config says include_prompt: false (pool without the prompt's tokens), "
            "which this server does not do: its vectors would differ from the model's own"
        )
    assert pooling in POOLINGS, pooling
    return ModelSettings(
        pooling=pooling,
        normalize=normalize,
        prompts=found.prompts,
        default_prompt_name=default_name,
        chosen_by=chosen_by,
        prompt_text=prompt_text,
    )
