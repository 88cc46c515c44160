"""LangChain's and LlamaIndex's OpenAI embedding classes against a real warmgate server, at
their defaults but for where the server is and which model it serves.

LangChain's `OpenAIEmbeddings` tokenizes each text with tiktoken (`cl100k_base`, OpenAI's own
ids, for a model name it does not know) and posts the token ids; the server, at its default
`--openai-token-ids cl100k_base` (what the OpenAI API means by ids), decodes them back into
text. tiktoken's encoding file is put into its cache folder first (support/tiktoken_cache.py):
the only thing here that is not as a user has it.
LlamaIndex's `OpenAIEmbedding` posts texts, 100 per request (its default `embed_batch_size`),
far more than the server's batch of 4 here.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import numpy as np
import pytest

from warmgate_testkit.process import ServerProcess, minilm_path

from .conftest import ARGS

TEXTS = [f"Sentence {index}: warm models answer fast, cold ones do not." for index in range(23)]


@pytest.fixture(scope="module")
def model_ids_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server whose OpenAI route takes the model's own ids (as TEI's routes always do)."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = ["--model", str(minilm_path()), *ARGS, "--openai-token-ids", "model"]
    with ServerProcess(args, log_path=log) as process:
        process.wait_ready(300)
        yield process


def test_langchain_openai_embeddings_sends_tiktoken_ids_and_gets_the_models_vectors(
    server, reference, tiktoken_cache, monkeypatch
) -> None:
    from langchain_openai import OpenAIEmbeddings

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tiktoken_cache))
    sent: list[object] = []
    embeddings = OpenAIEmbeddings(
        model="all-MiniLM-L6-v2", base_url=server.url + "/v1", api_key="not-needed"
    )
    # What LangChain puts on the wire, seen by the SDK's own HTTP client hook.
    embeddings.client._client._client.event_hooks["request"].append(
        lambda request: sent.append(json.loads(request.read()))
    )
    vectors = np.array(embeddings.embed_documents(TEXTS))
    query = np.array(embeddings.embed_query(TEXTS[0]))

    np.testing.assert_allclose(vectors, reference(TEXTS), atol=1e-5)
    np.testing.assert_allclose(query, reference(TEXTS[:1])[0], atol=1e-5)
    # Token ids, not text: the decoding on the server is what made the vectors right.
    first = sent[0]["input"]
    assert isinstance(first, list) and all(isinstance(ids, list) for ids in first)
    assert max(max(ids) for ids in first) >= 30522  # beyond MiniLM's vocabulary: cl100k's

    async def in_async() -> list[list[float]]:
        return await embeddings.aembed_documents(TEXTS[:5])

    np.testing.assert_allclose(np.array(asyncio.run(in_async())), reference(TEXTS[:5]), atol=1e-5)


def test_langchain_ids_of_another_tokenizer_are_refused_where_ids_are_the_models(
    model_ids_server, tiktoken_cache, monkeypatch
) -> None:
    """With --openai-token-ids model the route says why LangChain's ids do not fit."""
    import openai
    from langchain_openai import OpenAIEmbeddings

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tiktoken_cache))
    embeddings = OpenAIEmbeddings(
        model="all-MiniLM-L6-v2",
        base_url=model_ids_server.url + "/v1",
        api_key="not-needed",
        max_retries=0,
    )
    with pytest.raises(openai.BadRequestError) as raised:
        embeddings.embed_documents(["Warm models answer fast, cold ones do not."])
    assert "--openai-token-ids cl100k_base" in str(raised.value)


def test_llamaindex_openai_embedding_at_its_batch_size(server, reference) -> None:
    from llama_index.embeddings.openai import OpenAIEmbedding

    model = OpenAIEmbedding(
        model_name="all-MiniLM-L6-v2", api_base=server.url + "/v1", api_key="not-needed"
    )
    texts = [f"{text} (copy {copy})" for copy in range(7) for text in TEXTS]  # 161 texts
    before = server_requests(server)
    vectors = np.array(model.get_text_embedding_batch(texts))
    np.testing.assert_allclose(vectors, reference(texts), atol=1e-5)
    requests = server_requests(server) - before
    assert requests == -(-len(texts) // model.embed_batch_size) and requests >= 2
    query = np.array(model.get_query_embedding(TEXTS[3]))
    np.testing.assert_allclose(query, reference(TEXTS[3:4])[0], atol=1e-5)


def server_requests(server) -> int:
    import re
    import urllib.request

    with urllib.request.urlopen(server.url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    pattern = r'^warmgate_http_requests_total\{endpoint="/v1/embeddings",status="200"\} (\S+)$'
    match = re.search(pattern, text, re.MULTILINE)
    return int(float(match.group(1))) if match else 0
