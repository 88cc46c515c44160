"""Where the model's files come from, and which files they are.

`--model` is a local folder (a volume, a folder baked into the image) or a Hugging Face id. An
id is looked up in the Hugging Face cache (`HF_HOME`) at `--model-revision` (a branch, a tag or a
commit); when the cache lacks that revision and the hub may be asked (`HF_HUB_OFFLINE` unset),
the snapshot is downloaded first, from `HF_ENDPOINT` (huggingface.co, or a mirror) with
`HF_TOKEN` when set. Either way the server learns what it loads: the resolved commit and a digest
of the weights, which `/ready` reports so that the warm gate checks what was loaded, not what
was asked.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import ModelLoadError

if TYPE_CHECKING:
    from .warm_state import WarmState

log = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
# What a server never reads: other frameworks' exports and runtimes.
SKIPPED = (
    ".onnx",
    ".h5",
    ".msgpack",
    ".ot",
    ".tflite",
    ".mlmodel",
    ".gguf",
)
SKIPPED_FOLDERS = ("onnx/", "openvino/", "coreml/", "tf/", "flax/")

Progress = Callable[[int, int], None]  # (bytes done, bytes in all)


@dataclass(frozen=True)
class ModelSource:
    folder: Path
    commit: str | None
    """The hub commit the files are from; None for a plain folder."""
    digest: str | None
    """sha256 over the weight files (each by its content's sha256); None until read (the server
    reads it beside the load: locate(digest=False))."""


def _file_sha256(path: Path) -> str:
    """A file's sha256: a hub cache stores LFS files under that very name, else it is read."""
    resolved = path.resolve()
    if resolved.parent.name == "blobs" and len(resolved.name) == 64:
        return resolved.name
    digest = hashlib.sha256()
    with resolved.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def weight_files(folder: Path) -> list[tuple[str, Path]]:
    """The folder's weight files (what loading reads), by their paths inside it, sorted."""
    found = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file() or p.is_symlink()):
        relative = path.relative_to(folder).as_posix()
        if relative.endswith(WEIGHT_SUFFIXES) and not relative.startswith(SKIPPED_FOLDERS):
            found.append((relative, path))
    return found


def weights_digest(folder: Path, state: WarmState | None = None) -> str:
    """`sha256:<hex>` over every weight file's name and content hash, so two servers that report
    the same digest run the same weights whatever the files are called in their caches. `state`:
    each file's hash as a restart before this one read it (warm_state.py)."""
    digest = hashlib.sha256()
    for relative, path in weight_files(folder):
        content = state.file_sha256(path, _file_sha256) if state else _file_sha256(path)
        digest.update(f"{relative}\0{content}\n".encode())
    return f"sha256:{digest.hexdigest()}"


def weights_bytes(folder: Path) -> int:
    """How big the weight files are: about what loading them takes in memory at their dtype."""
    return sum(path.stat().st_size for _, path in weight_files(folder))


def _wanted(path: str) -> bool:
    return not path.endswith(SKIPPED) and not path.startswith(SKIPPED_FOLDERS)


def _cached(repo_id: str, revision: str) -> Path | None:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id=repo_id, revision=revision, local_files_only=True))
    except Exception:  # not in the cache (huggingface_hub raises several kinds)
        return None


def _download(repo_id: str, revision: str, progress: Progress | None) -> Path:
    """The snapshot at `revision`, fetched into the cache, reporting bytes as they arrive."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.constants import HF_HUB_CACHE

    api = HfApi()
    commit = api.repo_info(repo_id, revision=revision).sha
    files = [
        entry
        for entry in api.list_repo_tree(repo_id, revision=commit, recursive=True)
        if hasattr(entry, "size") and _wanted(entry.path)
    ]
    total = sum(entry.size or 0 for entry in files)
    blobs = Path(HF_HUB_CACHE) / ("models--" + repo_id.replace("/", "--")) / "blobs"
    already = sum(p.stat().st_size for p in blobs.glob("*") if p.is_file()) if blobs.is_dir() else 0
    done = threading.Event()

    def watch() -> None:
        last_log = 0.0
        while not done.wait(0.5):
            size = sum(p.stat().st_size for p in blobs.glob("*") if p.is_file()) - already
            size = max(0, min(size, total))
            if progress is not None:
                progress(size, total)
            if time.monotonic() - last_log >= 5:
                last_log = time.monotonic()
                log.info("downloading %s@%s: %.1f of %.1f MB", repo_id, commit[:12],
                         size / 1e6, total / 1e6)  # fmt: skip

    watcher = threading.Thread(target=watch, name="download-progress", daemon=True)
    watcher.start()
    try:
        folder = snapshot_download(
            repo_id=repo_id, revision=commit, allow_patterns=[entry.path for entry in files]
        )
    finally:
        done.set()
        watcher.join()
    if revision != commit:
        # As the hub's own download by branch or tag does: the cache remembers what the
        # revision named, so the next start finds it offline.
        ref = blobs.parent / "refs" / revision
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(commit)
    if progress is not None:
        progress(total, total)
    log.info("downloaded %s@%s: %d files, %.1f MB", repo_id, commit[:12], len(files), total / 1e6)
    return Path(folder)


def needs_download(model: str, revision: str) -> bool:
    """Whether `locate` would download: a hub id whose revision the cache lacks, with the hub
    allowed (HF_HUB_OFFLINE unset)."""
    from huggingface_hub.constants import HF_HUB_OFFLINE

    if HF_HUB_OFFLINE or Path(model).expanduser().is_dir() or model.startswith(("/", ".", "~")):
        return False
    return _cached(model, revision) is None


def locate(
    model: str,
    revision: str,
    progress: Progress | None = None,
    *,
    download: bool = True,
    digest: bool = True,
) -> ModelSource:
    """The model's files: a local folder as it is, a hub id from the cache or (unless
    `download` is False or HF_HUB_OFFLINE is set) downloaded; their digest unless `digest` is
    False (None then: the caller reads it). Slow: call it off the event loop. ModelLoadError
    says what is missing."""
    folder = Path(model).expanduser()
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            raise ModelLoadError(f"--model {model}: the folder has no config.json (not a model)")
        folder = folder.resolve()
        return ModelSource(folder, None, weights_digest(folder) if digest else None)
    if model.startswith(("/", ".", "~")) or model.count("/") > 1:
        raise ModelLoadError(f"--model {model}: no such folder")
    from huggingface_hub.constants import HF_HUB_OFFLINE

    snapshot = _cached(model, revision)
    if snapshot is None:
        cache = os.environ.get("HF_HOME", "~/.cache/huggingface")
        if HF_HUB_OFFLINE or not download:
            raise ModelLoadError(
                f"--model {model} at revision {revision!r} is not in the Hugging Face cache under "
                f"{cache}, and HF_HUB_OFFLINE is set: put it in the cache, let the server "
                "download it (HF_HUB_OFFLINE=0; an EmbeddingService's default hub source does), "
                "or pass --model /path/to/model-folder"
            )
        try:
            snapshot = _download(model, revision, progress)
        except Exception as exc:
            endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
            raise ModelLoadError(
                f"--model {model} at revision {revision!r}: cannot download it from {endpoint} "
                f"({type(exc).__name__}: {exc})"
            ) from None
    return ModelSource(snapshot, snapshot.name, weights_digest(snapshot) if digest else None)
