"""The model families people deploy, served right: a tiny model of each family (tests/support
/zoo.py: real config, model and tokenizer classes, random weights, a tokenizer trained on a
multilingual corpus), in both sentence-transformers layouts, served over HTTP and compared with
`SentenceTransformer(folder).encode` on English, Korean, Japanese, emoji, mixed and long
(truncated) texts. BERT and the RoBERTa family run both forward passes (padding-free and
transformers'); the others run transformers'. docs/models.md lists what each row proves."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from aiohttp.test_utils import TestClient
from support import zoo
from support.server import QUICK_SETTLE, SMALL_PLAN

from warmgate_server.app import create_app
from warmgate_server.config import parse_config
from warmgate_server.testing import wait_for_phase

MIN_COSINE = 0.9999
SERVER_POOLING = {"lasttoken": "last"}


@pytest.fixture(scope="module")
def zoo_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("zoo")


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(axis=1)


def reference(folder: Path, texts: list[str], prompt_name: str | None = None) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    return model.encode(texts, prompt_name=prompt_name, convert_to_numpy=True)


async def serve(aiohttp_client, folder: Path, *args: str) -> tuple[TestClient, dict]:
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


def _cases() -> list:
    cases = []
    for name, family in zoo.FAMILIES.items():
        for layout in zoo.LAYOUTS:
            for packing in ("auto", "off") if family.packed else ("auto",):
                cases.append(pytest.param(name, layout, packing, id=f"{name}-{layout}-{packing}"))
    return cases


@pytest.mark.parametrize(("name", "layout", "packing"), _cases())
async def test_each_family_serves_sentence_transformers_vectors(
    aiohttp_client, zoo_root: Path, report, name: str, layout: str, packing: str
) -> None:
    family = zoo.FAMILIES[name]
    folder = zoo.build(name, layout, zoo_root)
    expected = reference(folder, zoo.TEXTS)
    # The reference must tell texts apart, or a wrong pooling could pass by accident.
    unit = expected / np.linalg.norm(expected, axis=1, keepdims=True)
    off_diagonal = (unit @ unit.T)[~np.eye(len(unit), dtype=bool)]
    assert off_diagonal.max() < 0.99, f"{name}: reference vectors too alike"

    client, ready = await serve(aiohttp_client, folder, "--packing", packing)
    assert ready["phase"] == "ready", ready.get("error")
    settings = ready["model_settings"]
    modes = (family.pooling,) if isinstance(family.pooling, str) else family.pooling
    assert settings["pooling"] == "+".join(SERVER_POOLING.get(m, m) for m in modes)
    assert settings["chosen_by"]["pooling"] == "1_Pooling/config.json"
    assert settings["normalize"] is family.normalize
    assert len(settings["modules"]) == len(family.dense)
    forward = ready["forward"]["pass"]
    assert forward == ("packed" if family.packed and packing == "auto" else "padded")

    served = await embed(client, zoo.TEXTS)
    assert served.shape == expected.shape
    worst = cosine(served, expected)
    report(f"{name} {layout} {forward}: min cosine {worst.min():.7f}")
    assert worst.min() >= MIN_COSINE, dict(zip(zoo.TEXTS, worst.round(6), strict=True))
    if family.normalize:
        np.testing.assert_allclose(np.linalg.norm(served, axis=1), 1.0, atol=1e-4)
    for prompt_name in sorted(family.prompts):
        got = await embed(client, zoo.TEXTS[:4], prompt_name)
        want = reference(folder, zoo.TEXTS[:4], prompt_name)
        assert cosine(got, want).min() >= MIN_COSINE, prompt_name
