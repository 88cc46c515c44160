"""One real server process for the client tests: `python -m warmgate_server` with the real
all-MiniLM-L6-v2 on a loopback port, and sentence-transformers' vectors to compare against."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from support.tiktoken_cache import tiktoken_cache  # noqa: F401 - a fixture (LangChain)

from warmgate_testkit.process import ServerProcess, minilm_path

ARGS = [
    "--device", "cpu",
    "--sequence-buckets", "16,32,64,128",
    "--warmup-batch-sizes", "1,4",
    "--max-batch-size", "4",
    "--max-batch-tokens", "512",
    "--served-model-name", "all-MiniLM-L6-v2",
    "--body-timeout", "2",
]  # fmt: skip


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    with ServerProcess(["--model", str(minilm_path()), *ARGS], log_path=log) as process:
        process.wait_ready(300)
        yield process


@pytest.fixture(scope="session")
def reference():
    """sentence-transformers' own vectors for texts (normalised, as the model's config says)."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm_path()), device="cpu")

    def encode(texts: list[str]) -> np.ndarray:
        return model.encode(texts, normalize_embeddings=True, batch_size=64)

    return encode
