"""A model folder's checkpoint, in every form the hub has it: `model.safetensors`, safetensors
shards (`model.safetensors.index.json`), `pytorch_model.bin` (the older models: ko-sroberta,
many sentence-transformers folders from before 2023) and its shards
(`pytorch_model.bin.index.json`). Safetensors win where a folder has both, as in transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# (index file, single file), most preferred first.
_FORMS = (
    ("model.safetensors.index.json", "model.safetensors"),
    ("pytorch_model.bin.index.json", "pytorch_model.bin"),
)


class NoCheckpoint(ValueError):
    """The folder holds no checkpoint in a form this module reads."""


def files(folder: Path) -> list[Path]:
    """The checkpoint's files (one, or the shards its index names), or NoCheckpoint."""
    for index_name, single_name in _FORMS:
        index = folder / index_name
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise NoCheckpoint(f"{index_name} cannot be read: {exc}") from None
            shards = sorted(set(weight_map.values()))
            missing = [name for name in shards if not (folder / name).is_file()]
            if missing:
                raise NoCheckpoint(f"{index_name} names shards that are not there: {missing}")
            return [folder / name for name in shards]
        if (folder / single_name).is_file():
            return [folder / single_name]
    raise NoCheckpoint("no model.safetensors or pytorch_model.bin (sharded or not)")


def keys(folder: Path) -> set[str]:
    """The weight names the checkpoint holds, without reading the weights; empty when the
    folder has no checkpoint."""
    try:
        found = files(folder)
    except NoCheckpoint:
        return set()
    names: set[str] = set()
    for path in found:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as handle:
                names.update(handle.keys())
        else:
            import torch

            names.update(torch.load(path, map_location="meta", weights_only=True))
    return names


def load(folder: Path) -> dict[str, torch.Tensor]:
    """Every weight of the checkpoint, on the CPU. A pickled checkpoint is read with
    `weights_only` (tensors and plain containers only: no code runs) and memory-mapped."""
    state: dict[str, torch.Tensor] = {}
    for path in files(folder):
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state.update(load_file(str(path)))
        else:
            state.update(_load_pickled(path))
    return state


def _load_pickled(path: Path) -> dict[str, torch.Tensor]:
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # a file of torch's format before 1.6, which cannot be mapped
        return torch.load(path, map_location="cpu", weights_only=True)


def load_some(folder: Path, wanted: set[str]) -> dict[str, torch.Tensor]:
    """The checkpoint's weights named in `wanted` that it holds (safetensors: only those are
    read; a pickled file is memory-mapped), on the CPU."""
    state: dict[str, torch.Tensor] = {}
    for path in files(folder):
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as handle:
                for key in wanted & set(handle.keys()):
                    state[key] = handle.get_tensor(key)
        else:
            found = _load_pickled(path)
            state.update({key: found[key] for key in wanted & set(found)})
    return state
