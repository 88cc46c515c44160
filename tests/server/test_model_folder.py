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
from warmgate_testkit.process import wait_for_phase

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
    "mean_sqrt_len_tokens": "pooling_mode_mean_sqrt_len_tokens",
    "weightedmean": "pooling_mode_weightedmean_tokens",
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
@pytest.mark.parametrize("mode", list(MODES))
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


async def test_a_pooling_mode_that_cannot_be_read_is_refused_even_with_a_flag(
    aiohttp_client, model_copy
) -> None:
    """A mode sentence-transformers does not have, or a Pooling config that names none, is
    refused with the file and the mode; --pooling does not paper over a folder it cannot
    read."""
    folder = model_copy("mean")
    config_file = folder / "1_Pooling" / "config.json"
    for config, expected in (
        ({"embedding_dimension": 384, "pooling_mode": "median"}, "pooling_mode 'median'"),
        ({"embedding_dimension": 384, "pooling_mode": ["cls", "p90"]}, "pooling_mode 'p90'"),
        ({"embedding_dimension": 384, "pooling_mode": [["cls"]]}, "pooling_mode ['cls']"),
        ({"embedding_dimension": 384, "pooling_mode": 1}, "pooling_mode 1 is neither"),
        ({"word_embedding_dimension": 384}, "names no pooling mode"),
        ({"pooling_mode_attention_tokens": True}, "pooling_mode_attention_tokens"),
    ):
        config_file.write_text(json.dumps(config))
        for args in ((), ("--pooling", "mean")):
            _client, report = await serve(aiohttp_client, folder, *args)
            assert report["phase"] == "failed", (config, args)
            assert "1_Pooling/config.json" in report["error"] and expected in report["error"]
    config_file.unlink()
    _client, report = await serve(aiohttp_client, folder)
    assert report["phase"] == "failed"
    assert "1_Pooling/config.json is missing" in report["error"]


async def test_the_default_prompt_is_put_before_every_input(aiohttp_client, model_copy) -> None:
    prompts = {"prompts": {"query": "query: ", "passage": ""}, "default_prompt_name": "query"}
    folder = model_copy("mean", prompts=prompts)
    client, report = await serve(aiohttp_client, folder)
    assert report["model_settings"]["default_prompt_name"] == "query"
    served = await embed(client, TEXTS)
    assert cosine(served, reference(folder, "float32")).min() >= 0.9999
    plain = reference(model_copy("mean"), "float32")
    assert cosine(served, plain).min() < 0.999  # the prompt changed the vectors


def reference_with_prompt(folder: Path, prompt_name: str) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    return model.encode(TEXTS, prompt_name=prompt_name, convert_to_numpy=True)


async def test_a_request_names_one_of_the_models_prompts(aiohttp_client, model_copy) -> None:
    """TEI's `prompt_name` picks a prompt of the folder's own, as sentence-transformers'
    encode(prompt_name=...) does; a name the model lacks is a 422 that lists its prompts."""
    prompts = {"prompts": {"query": "query: ", "passage": "passage: "}, "default_prompt_name": None}
    folder = model_copy("mean", prompts=prompts)
    client, report = await serve(aiohttp_client, folder)
    assert report["model_settings"]["chosen_by"]["prompt"] == "default (no prompt)"
    response = await client.post("/embed", json={"inputs": TEXTS, "prompt_name": "passage"})
    assert response.status == 200, await response.text()
    served = np.array(await response.json())
    assert cosine(served, reference_with_prompt(folder, "passage")).min() >= 0.9999
    assert cosine(served, reference_with_prompt(folder, "query")).min() < 0.999
    tokens = await client.post("/tokenize", json={"inputs": "hi", "prompt_name": "query"})
    assert [token["text"] for token in (await tokens.json())[0]][1:4] == ["query", ":", "hi"]
    refused = await client.post("/embed", json={"inputs": "x", "prompt_name": "title"})
    assert refused.status == 422
    message = (await refused.json())["error"]
    assert "'title' is not one of the model's prompts: 'passage', 'query'" in message


async def test_flags_override_the_folders_default_prompt(aiohttp_client, model_copy) -> None:
    prompts = {
        "prompts": {"query": "query: ", "passage": "passage: "},
        "default_prompt_name": "query",
    }
    folder = model_copy("mean", prompts=prompts)
    client, report = await serve(aiohttp_client, folder, "--default-prompt-name", "passage")
    settings = report["model_settings"]
    assert (settings["default_prompt_name"], settings["default_prompt"]) == ("passage", "passage: ")
    assert settings["chosen_by"]["prompt"] == "--default-prompt-name"
    served = await embed(client, TEXTS)
    assert cosine(served, reference_with_prompt(folder, "passage")).min() >= 0.9999

    client, report = await serve(aiohttp_client, folder, "--default-prompt", "passage: ")
    assert report["model_settings"]["chosen_by"]["prompt"] == "--default-prompt"
    assert cosine(await embed(client, TEXTS), served).min() >= 0.99999

    _client, report = await serve(aiohttp_client, folder, "--default-prompt-name", "title")
    assert report["phase"] == "failed"
    assert "--default-prompt-name 'title': the model's prompts" in report["error"]


async def test_the_input_limit_is_reported_with_where_it_came_from(
    aiohttp_client, model_copy
) -> None:
    folder = model_copy("mean")
    _client, report = await serve(aiohttp_client, folder)  # buckets 16,32,64 (make_config)
    settings = report["model_settings"]
    assert settings["max_input_length"] == 64
    assert settings["chosen_by"]["max_input_length"] == "the largest of --sequence-buckets"
    config = json.loads((folder / "sentence_bert_config.json").read_text())
    (folder / "sentence_bert_config.json").write_text(json.dumps({**config, "max_seq_length": 40}))
    _client, report = await serve(aiohttp_client, folder)
    settings = report["model_settings"]
    assert settings["max_input_length"] == 40
    assert settings["chosen_by"]["max_input_length"] == "sentence_bert_config.json"
    _client, report = await serve(aiohttp_client, folder, "--max-input-length", "20")
    assert report["model_settings"]["chosen_by"]["max_input_length"] == "--max-input-length"


def _resolve(folder: Path, *args: str):
    from warmgate_server import model_folder
    from warmgate_server.config import parse_config

    return model_folder.resolve(parse_config(["--model", str(folder), *args]), folder)


def test_a_decoder_embeds_with_its_last_token_unless_its_folder_says_otherwise(
    tmp_path: Path, model_copy
) -> None:
    """A decoder-only model (config.json) without sentence-transformers files gets last-token
    pooling, never the silent mean default; its own Pooling config or --pooling still win."""
    for config in (
        {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"},
        {"architectures": ["MistralModel"], "model_type": "mistral"},
        {"model_type": "custom", "is_decoder": True},
    ):
        (tmp_path / "config.json").write_text(json.dumps(config))
        settings = _resolve(tmp_path)
        assert settings.pooling == "last", config
        assert "a decoder" in settings.chosen_by["pooling"]
    assert _resolve(tmp_path, "--pooling", "mean").pooling == "mean"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert _resolve(tmp_path).pooling == "mean"  # an encoder without ST files: the default
    folder = model_copy("cls")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "is_decoder": True}))
    assert _resolve(folder).pooling == "cls"


def test_modules_the_server_cannot_reproduce_are_refused(model_copy) -> None:
    """Module types are matched by their full path: a custom module whose class is also
    called Transformer, or any module but Transformer, Pooling, Dense and Normalize, is
    refused with its type, whatever --pooling says."""
    from warmgate_server.model_folder import ModelConfigError

    folder = model_copy("mean")
    modules = json.loads((folder / "modules.json").read_text())
    for changed, expected in (
        ({**modules[0], "type": "custom_st.Transformer"}, "'custom_st.Transformer'"),
        ({**modules[1], "type": "sentence_transformers.models.WeightedLayerPooling"}, "Weighted"),
    ):
        index = 0 if changed["type"].endswith("Transformer") else 1
        listed = [changed if i == index else m for i, m in enumerate(modules)]
        (folder / "modules.json").write_text(json.dumps(listed))
        for args in ((), ("--pooling", "cls")):
            with pytest.raises(ModelConfigError, match=expected):
                _resolve(folder, *args)
    lstm = {"idx": 3, "name": "3", "path": "3_LSTM", "type": "sentence_transformers.models.LSTM"}
    (folder / "modules.json").write_text(json.dumps([*modules, lstm]))
    with pytest.raises(ModelConfigError, match=r"'sentence_transformers.models.LSTM' \(3_LSTM\)"):
        _resolve(folder)
