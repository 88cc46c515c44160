"""What the model folder says about how to embed with it, and what the flags override.

A sentence-transformers folder describes its own pipeline: `modules.json` lists the modules
(a Pooling module, and a Normalize module when the vectors are L2-normalised),
`1_Pooling/config.json` (or wherever modules.json points) says which pooling, and
`config_sentence_transformers.json` holds the prompts. The server follows the folder unless a
flag says otherwise, reports what it chose and why, and refuses at start a pooling it cannot
compute, rather than serving vectors that differ from the model's own.
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


@dataclass(frozen=True)
class ModelSettings:
    """How this server embeds: each value with where it came from."""

    pooling: str
    normalize: bool
    prompts: Mapping[str, str]
    default_prompt_name: str | None
    chosen_by: Mapping[str, str]

    @property
    def default_prompt(self) -> str:
        """Text put before every input (the model's default prompt), or ""."""
        return self.prompts.get(self.default_prompt_name or "", "")

    def as_json(self) -> dict[str, Any]:
        return {
            "pooling": self.pooling,
            "normalize": self.normalize,
            "prompts": dict(self.prompts),
            "default_prompt_name": self.default_prompt_name,
            "chosen_by": dict(self.chosen_by),
        }


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_folder(folder: Path) -> FolderSettings:
    """The folder's own settings; ModelConfigError for a pooling no server mode matches."""
    modules = _read_json(folder / "modules.json")
    if not isinstance(modules, list):
        return FolderSettings()
    types = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    pooling, pooling_source = None, ""
    if "Pooling" in types:
        relative = f"{types['Pooling'].get('path') or '1_Pooling'}/config.json"
        config = _read_json(folder / relative) or {}
        chosen = [mode for key, mode in _POOLING_MODES.items() if config.get(key)]
        unsupported = [key for key in _UNSUPPORTED_MODES if config.get(key)]
        if unsupported or len(chosen) > 1:
            raise ModelConfigError(
                f"{relative} asks for {', '.join(unsupported + chosen)}: this server pools with "
                "one of mean, cls or last token; pass --pooling to choose one anyway"
            )
        if chosen:
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
    )


def resolve(config: ServerConfig, folder: Path) -> ModelSettings:
    """The flags where given, else the folder's settings, else the defaults (mean pooling,
    normalised vectors). ModelConfigError when the folder's pooling is unsupported and no
    --pooling overrides it."""
    chosen_by: dict[str, str] = {}
    if config.pooling is not None:
        pooling, chosen_by["pooling"] = config.pooling, "--pooling"
        try:
            found = read_folder(folder)
        except ModelConfigError:
            found = FolderSettings()
    else:
        found = read_folder(folder)
        if found.pooling is not None:
            pooling, chosen_by["pooling"] = found.pooling, found.pooling_source
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
    assert pooling in POOLINGS, pooling
    return ModelSettings(
        pooling=pooling,
        normalize=normalize,
        prompts=found.prompts,
        default_prompt_name=found.default_prompt_name,
        chosen_by=chosen_by,
    )
