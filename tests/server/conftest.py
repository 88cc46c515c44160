"""Fixtures for the server tests: the real all-MiniLM-L6-v2, loaded once per session."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient
from support.server import QUICK_SETTLE, make_config, until_ready

from warmgate_server.app import create_app
from warmgate_server.config import parse_config
from warmgate_server.loading import LoadedModel, load_model
from warmgate_testkit.process import minilm_path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    return minilm_path()


@pytest.fixture(scope="session")
def loaded_minilm(minilm_dir: Path) -> LoadedModel:
    return load_model(parse_config(["--model", str(minilm_dir), "--device", "cpu"], environ={}))


@pytest.fixture(scope="session")
def loaded_minilm_padded(minilm_dir: Path) -> LoadedModel:
    """The same model through transformers' AutoModel and its own padded forward pass."""
    argv = ["--model", str(minilm_dir), "--device", "cpu", "--packing", "off"]
    return load_model(parse_config(argv, environ={}))


@pytest.fixture(scope="session")
def sentence_transformer(minilm_dir: Path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_dir), device="cpu")


StartServer = Callable[..., Awaitable[TestClient]]


@pytest.fixture
def start_server(aiohttp_client, minilm_dir: Path, request) -> StartServer:
    """Start an app on the shared model (loaded packed, or padded for `--packing off`); by
    default wait until it is ready."""

    async def start(*args: str, wait: bool = True) -> TestClient:
        config = make_config(minilm_dir, *args)
        fixture = "loaded_minilm_padded" if config.packing == "off" else "loaded_minilm"
        preloaded = request.getfixturevalue(fixture)
        app: web.Application = create_app(config, preloaded=preloaded, settle_rule=QUICK_SETTLE)
        client = await aiohttp_client(app)
        if wait:
            await until_ready(client)
        return client

    return start
