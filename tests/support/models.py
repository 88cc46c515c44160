"""What the model-family tests share: the zoo's folders served over HTTP by a real app, and
sentence-transformers' own vectors of the same folder as the reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from aiohttp.test_utils import TestClient

from support.server import QUICK_SETTLE, SMALL_PLAN
from warmgate_server.app import create_app
from warmgate_server.config import parse_config
from warmgate_testkit import zoo
from warmgate_testkit.process import wait_for_phase

MIN_COSINE = 0.9999


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(axis=1)


def reference(
    folder: Path, texts: list[str], prompt_name: str | None = None, **options
) -> np.ndarray:
    """SentenceTransformer(folder).encode(texts): the vectors the server must serve."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu", **options)
    return model.encode(texts, prompt_name=prompt_name, convert_to_numpy=True)


async def serve(aiohttp_client, folder: Path, *args: str) -> tuple[TestClient, dict]:
    """An app serving `folder` on a real socket, and its /ready report once ready or failed."""
    argv = ["--model", str(folder), *SMALL_PLAN, "--auto-truncate", "--device", "cpu", *args]
    app = create_app(parse_config(argv, environ={}), settle_rule=QUICK_SETTLE)
    client = await aiohttp_client(app)
    return client, await wait_for_phase(client, {"ready", "failed"})


async def embed(client: TestClient, texts: list[str], prompt_name: str | None = None):
    body: dict = {"inputs": texts}
    if prompt_name is not None:
        body["prompt_name"] = prompt_name
    response = await client.post("/embed", json=body)
    assert response.status == 200, await response.text()
    return np.array(await response.json(), dtype=np.float32)


def closest_pair(vectors: np.ndarray) -> float:
    """The highest cosine between two different rows."""
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    return float((unit @ unit.T)[~np.eye(len(unit), dtype=bool)].max())


def build_telling_texts_apart(name: str, layout: str, root: Path) -> tuple[Path, np.ndarray]:
    """The family's folder and sentence-transformers' vectors of the texts, from the first
    model seed whose vectors tell every two texts apart (closest pair under 0.999), so that a
    server answering one text with another's vector fails. The zoo's tokenizers train
    differently in each process (the Rust trainers' hash maps break ties in their own order),
    and with some vocabularies a tiny random CLS model with a long shared prompt gives two
    short texts nearly one vector: another seed gives another model."""
    closest = []
    for seed in range(5):
        folder = zoo.build(name, layout, root / f"seed-{seed}", seed)
        expected = reference(folder, zoo.TEXTS)
        closest.append(closest_pair(expected))
        if closest[-1] < 0.999:
            return folder, expected
    raise AssertionError(f"{name}: every seed gives two texts one vector: {closest}")
