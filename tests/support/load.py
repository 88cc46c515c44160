"""Load through a Service and what answered it, for the end-to-end tests: a constant rate of
requests from this machine, and which weights produced each answer."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import openai
import pytest

from warmgate_devcluster.loadgen import ConstantRateLoad, Sample
from warmgate_devcluster.testkit import node_port, service_url, wait_until

LOAD_TEXT = "warm models answer fast"  # what ConstantRateLoad sends by default
MODEL = "sentence-transformers/all-MiniLM-L6-v2"
POOLED_TEXT = "warm models answer"  # what pooled_load's clients send


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


@dataclass
class Answer:
    at: float
    pod: str | None
    revision: str | None
    cold: str | None
    connection: str | None
    sent: float = 0.0
    service: str | None = None
    """X-Warmgate-Service: which EmbeddingService answered (through warmgate-router)."""
    vector: tuple[float, ...] = ()
    """The embedding's first 16 components."""
    vectors: tuple[tuple[float, ...], ...] = ()
    """Every input's embedding's first 16 components, in order (`vector` is the first)."""
    router: str | None = None
    """X-Warmgate-Router: the router replica that forwarded it."""


@dataclass
class PooledLoad:
    answers: list[Answer] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    failed_sent: list[float] = field(default_factory=list)
    """When each failed request was sent (time.monotonic), in the order of `errors`."""

    def pods_since(self, moment: float) -> set[str | None]:
        return {a.pod for a in self.answers if a.at >= moment}


def through_service(kube, name: str) -> str:
    return f"http://{kube.devcluster.node_ip}:{node_port(kube, name)}/v1"


@contextmanager
def pooled_load(
    url: str,
    threads: int = 2,
    model: str = MODEL,
    text: str = POOLED_TEXT,
    inputs: int = 1,
    retries: int = 0,
) -> Iterator[PooledLoad]:
    """`threads` threads sharing one OpenAI SDK client (one httpx pool, keep-alive, as a client
    application holds it), retries off (or `retries`: the SDK's own, 2 at its default), each
    sending one request after another to `url` (`text`, or a list of `inputs` copies of it):
    every answer with the pod, revision, cold flag and Connection header it came with, and
    every error."""
    sdk = openai.OpenAI(base_url=url, api_key="not-needed", max_retries=retries, timeout=30)
    payload = text if inputs == 1 else [text] * inputs
    load = PooledLoad()
    stop = threading.Event()

    def send() -> None:
        while not stop.is_set():
            sent = time.monotonic()
            try:
                raw = sdk.embeddings.with_raw_response.create(model=model, input=payload)
                data = raw.parse().data
                assert len(data) == inputs and all(len(d.embedding) == 384 for d in data)
                embedding = data[0].embedding
                headers = raw.headers
                load.answers.append(
                    Answer(
                        time.monotonic(),
                        headers.get("x-warmgate-pod"),
                        headers.get("x-warmgate-revision"),
                        headers.get("x-warmgate-cold"),
                        headers.get("connection"),
                        sent,
                        headers.get("x-warmgate-service"),
                        tuple(float(v) for v in embedding[:16]),
                        tuple(tuple(float(v) for v in d.embedding[:16]) for d in data),
                        headers.get("x-warmgate-router"),
                    )
                )
            except Exception as error:
                load.errors.append(f"{time.monotonic():.1f} {type(error).__name__}: {error}")
                load.failed_sent.append(sent)
            time.sleep(0.02)

    workers = [threading.Thread(target=send) for _ in range(threads)]
    for worker in workers:
        worker.start()
    try:
        yield load
    finally:
        stop.set()
        for worker in workers:
            worker.join(60)
        sdk.close()
