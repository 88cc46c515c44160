"""The model's own sentence-transformers configuration decides pooling, normalisation and the
default prompt, and the served vectors equal sentence-transformers' own for the same folder:
mean, CLS and last-token pooled copies of all-MiniLM-L6-v2, at float32 and bfloat16. A pooling
the server cannot compute is refused at start, with a message; a flag overrides the folder."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from aiohttp.test_utils import TestClient
from support.server import QUICK_SETTLE, make_config

from warmgate_server.app import create_app
from warmgate_server.testing import wait_for_phase

TEXTS = [
    "hi",
    "A man is eating food.",
    "Kubernetes readiness gates keep a pod out of the endpoints until a condition turns true.",
]
MODES = {
    "mean": "pooling_mode_mean_tokens",
    "cls": "pooling_mode_cls_token",
    "last": "pooling_mode_lasttoken",
    "max": "pooling_mode_max_tokens",
}


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(axis=1)


@pytest.fixture(scope="module")
def model_copy(tmp_path_factory: pytest.TempPathFactory, minilm_dir: Path) -> Callable[..., Path]:
    """A copy of the MiniLM folder (weights linked) with another pooling mode, normalisation or
    prompts in its sentence-transformers files."""

    def make(mode: str, normalize: bool = True, prompts: dict | None = None) -> Path:
        folder = tmp_path_factory.mktemp(f"minilm-{mode}")
        for item in minilm_dir.iterdir():
            target = folder / item.name
            if item.is_dir():
                shutil.copytree(item, target)
            elif item.suffix == ".safetensors":
                target.symlink_to(item)
            else:
                shutil.copy(item, target)
        pooling = json.loads((folder / "1_Pooling" / "config.json").read_text())
        for key in MODES.values():
            pooling[key] = False
        pooling[MODES[mode]] = True
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
        modules = json.loads((folder / "modules.json").read_text())
        if not normalize:
            modules = [m for m in modules if not m["type"].endswith("Normalize")]
        (folder / "modules.json").write_text(json.dumps(modules))
        if prompts is not None:
            config = json.loads((folder / "config_sentence_transformers.json").read_text())
            config.update(prompts)
            (folder / "config_sentence_transformers.json").write_text(json.dumps(config))
        return folder

    return make


async def serve(aiohttp_client, folder: Path, *args: str) -> tuple[TestClient, dict]:
    app = create_app(make_config(folder, *args), settle_rule=QUICK_SETTLE)
    client = await aiohttp_client(app)
    return client, await wait_for_phase(client, {"ready", "failed"})


async def embed(client: TestClient, texts: list[str]) -> np.ndarray:
    response = await client.post("/v1/embeddings", json={"input": texts})
    assert response.status == 200, await response.text()
    return np.array([item["embedding"] for item in (await response.json())["data"]])


def reference(folder: Path, dtype: str) -> np.ndarray:
    import torch
    from sentence_transformers import SentenceTransformer

    kwargs = {"torch_dtype": torch.bfloat16} if dtype == "bfloat16" else {}
    model = SentenceTransformer(str(folder), device="cpu", model_kwargs=kwargs)
    return model.encode(TEXTS, convert_to_numpy=True).astype(np.float32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["mean", "cls", "last"])
async def test_the_folders_pooling_gives_sentence_transformers_vectors(
    aiohttp_client, model_copy, mode: str, dtype: str
) -> None:
    folder = model_copy(mode, normalize=mode != "last")
    client, report = await serve(aiohttp_client, folder, "--dtype", dtype)
    assert report["phase"] == "ready", report
    settings = report["model_settings"]
    assert settings["pooling"] == mode
    assert settings["chosen_by"]["pooling"] == "1_Pooling/config.json"
    assert settings["normalize"] is (mode != "last")
    served = await embed(client, TEXTS)
    expected = reference(folder, dtype)
    # fp32 agrees to rounding; bf16 rounds activations, the same way on both sides.
    assert cosine(served, expected).min() >= (0.9999 if dtype == "float32" else 0.995)
    norms = np.linalg.norm(served, axis=1)
    if mode == "last":  # no Normalize module: the raw pooled vector
        assert np.abs(norms - np.linalg.norm(expected, axis=1)).max() < 0.05 * norms.max()
    else:
        np.testing.assert_allclose(norms, 1.0, atol=1e-3)
    info = await (await client.get("/info")).json()
    assert info["pooling"] == mode and info["model_settings"] == settings


async def test_a_pooling_the_server_cannot_compute_is_refused_unless_a_flag_chooses(
    aiohttp_client, model_copy
) -> None:
    folder = model_copy("max")
    _client, report = await serve(aiohttp_client, folder)
    assert report["phase"] == "failed"
    assert "pooling_mode_max_tokens" in report["error"] and "--pooling" in report["error"]
    _client, report = await serve(aiohttp_client, folder, "--pooling", "mean")
    assert report["phase"] == "ready"
    assert report["model_settings"]["chosen_by"]["pooling"] == "--pooling"


async def test_the_default_prompt_is_put_before_every_input(aiohttp_client, model_copy) -> None:
    prompts = {"prompts": {"query": "query: ", "passage": ""}, "default_prompt_name": "query"}
    folder = model_copy("mean", prompts=prompts)
    client, report = await serve(aiohttp_client, folder)
    assert report["model_settings"]["default_prompt_name"] == "query"
    served = await embed(client, TEXTS)
    assert cosine(served, reference(folder, "float32")).min() >= 0.9999
    plain = reference(model_copy("mean"), "float32")
    assert cosine(served, plain).min() < 0.999  # the prompt changed the vectors
