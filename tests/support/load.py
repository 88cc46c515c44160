"""Load through a Service and what answered it, for the end-to-end tests: a constant rate of
requests from this machine, and which weights produced each answer."""

from __future__ import annotations

import pytest

from warmgate_devcluster.loadgen import ConstantRateLoad, Sample
from warmgate_devcluster.testkit import service_url, wait_until

LOAD_TEXT = "warm models answer fast"  # what ConstantRateLoad sends by default


RATE = 20.0


def summary(samples: list[Sample], limit: int = 8) -> str:
    shown = [f"t={s.started:.1f}s status={s.status} pod={s.pod} error={s.error}" for s in samples]
    return f"{len(samples)} requests: " + "; ".join(shown[:limit])


def service_load(kube, name: str) -> ConstantRateLoad:
    """20 requests a second through the Service, from this machine."""
    return ConstantRateLoad(service_url(kube, name), rate=RATE, networks=kube.devcluster.networks)


def wait_for_traffic(load: ConstantRateLoad, count: int, timeout: float = 60) -> None:
    target = len(load.report.samples) + count
    wait_until(lambda: len(load.report.samples) >= target, timeout, f"{count} more responses")


def weights_of(vector, references: dict[str, tuple[float, ...]]) -> str | None:
    """Which revision's weights produced `vector` (the first components of the load's text)."""
    for revision, expected in references.items():
        if vector and max(abs(a - b) for a, b in zip(vector, expected, strict=True)) < 1e-3:
            return revision
    return None


@pytest.fixture(scope="session")
def reference_vectors() -> dict[str, tuple[float, ...]]:
    """The first 16 components of the load's text embedded by sentence-transformers with the
    weights of the hub's revisions v1 (the real MiniLM) and v2 (nudged weights)."""
    from sentence_transformers import SentenceTransformer

    from warmgate_devcluster.models import minilm_folder, minilm_v2_folder

    vectors = {}
    for revision, folder in (("v1", minilm_folder()), ("v2", minilm_v2_folder())):
        model = SentenceTransformer(str(folder), device="cpu")
        vector = model.encode([LOAD_TEXT], normalize_embeddings=True)[0]
        vectors[revision] = tuple(float(value) for value in vector[:16])
    assert max(abs(a - b) for a, b in zip(*vectors.values(), strict=True)) > 5e-3
    return vectors
