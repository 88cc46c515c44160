"""Image -> local command: the devcluster's container runtime has no images, only this map.

A map file (YAML or JSON) is a list of entries, tried in order before the defaults:

    - match: ghcr.io/acme/warmgate-server      # image repository (tag/digest ignored)
      kind: suffix                             # exact (default) | suffix | prefix
      command: [python, -m, warmgate_server]   # the image's ENTRYPOINT
      args: []                                 # the image's CMD
      env: {HF_HUB_OFFLINE: "1"}               # the image's ENV

The words `{python}` in command/args are replaced with the agent's Python interpreter.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

TESTSERVER_IMAGE = "warmgate.dev/testserver"


@dataclass(frozen=True)
class ImageEntry:
    match: str
    kind: str = "exact"
    command: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)

    def matches(self, repository: str) -> bool:
        if self.kind == "suffix":
            return repository.endswith(self.match)
        if self.kind == "prefix":
            return repository.startswith(self.match)
        return repository == self.match

    def as_dict(self) -> dict:
        python = sys.executable
        return {
            "command": [python if p == "{python}" else p for p in self.command],
            "args": [python if p == "{python}" else p for p in self.args],
            "env": dict(self.env),
        }


def repository_of(image: str) -> str:
    """`ghcr.io/acme/warmgate-server:1.2@sha256:..` -> `ghcr.io/acme/warmgate-server`."""
    name = image.split("@", 1)[0]
    slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > slash:
        name = name[:colon]
    return name


def default_entries(model_cache: Path | None) -> list[ImageEntry]:
    server_env = {"HF_HUB_OFFLINE": "1"}
    if model_cache is not None:
        server_env["HF_HOME"] = str(model_cache)
    return [
        ImageEntry(
            "warmgate-server", "suffix", ("{python}", "-m", "warmgate_server"), env=server_env
        ),
        ImageEntry(TESTSERVER_IMAGE, "exact", ("{python}", "-m", "warmgate_devcluster.testserver")),
    ]


def load_entries(path: Path) -> list[ImageEntry]:
    text = path.read_text()
    if path.suffix == ".json":
        raw = json.loads(text)
    else:
        import yaml

        raw = yaml.safe_load(text)
    if isinstance(raw, dict):
        raw = raw.get("images", [])
    entries = []
    for item in raw or []:
        if "match" not in item or not item.get("command"):
            raise ValueError(f"{path}: each image entry needs `match` and `command`: {item!r}")
        entries.append(
            ImageEntry(
                match=str(item["match"]),
                kind=str(item.get("kind", "exact")),
                command=tuple(str(p) for p in item["command"]),
                args=tuple(str(p) for p in item.get("args", [])),
                env={str(k): str(v) for k, v in (item.get("env") or {}).items()},
            )
        )
    return entries


class ImageMap:
    def __init__(self, entries: list[ImageEntry]) -> None:
        self.entries = entries

    @classmethod
    def from_config(cls, image_map_file: Path | None, model_cache: Path | None) -> ImageMap:
        entries = load_entries(image_map_file) if image_map_file else []
        return cls(entries + default_entries(model_cache))

    def resolve(self, image: str) -> dict | None:
        repository = repository_of(image)
        for entry in self.entries:
            if entry.matches(repository):
                return entry.as_dict()
        return None
