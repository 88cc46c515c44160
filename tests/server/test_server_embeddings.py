"""Served vectors equal sentence-transformers' encode, whatever the bucket or batch they ran in."""

from __future__ import annotations

import asyncio

import numpy as np

TEXTS = [
    "hi",
    "A man is eating food.",
    "The new movie is awesome and everyone should see it at least once this week.",
    "Kubernetes readiness gates keep a pod out of the endpoints until a custom condition "
    "turns true, which lets an operator verify that every shape of the model is warm.",
    "Padding tokens must never change an embedding: the attention mask hides them and mean "
    "pooling averages over the real tokens only, so a short sentence padded into a long "
    "bucket keeps exactly the vector it has on its own.",
    "ok",
]


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(axis=1)


async def embed(client, texts: list[str]) -> np.ndarray:
    response = await client.post("/v1/embeddings", json={"input": texts})
    assert response.status == 200, await response.text()
    return np.array([item["embedding"] for item in (await response.json())["data"]])


async def test_vectors_match_sentence_transformers_across_buckets_and_batches(
    start_server, sentence_transformer
) -> None:
    reference = sentence_transformer.encode(TEXTS, convert_to_numpy=True)
    lengths = [len(sentence_transformer.tokenizer(text)["input_ids"]) for text in TEXTS]
    assert min(lengths) <= 16 < 32 < max(lengths) <= 64  # the texts span three buckets

    client = await start_server()
    together = await embed(client, TEXTS)  # one request, split by bucket and padded to size 4
    alone = np.vstack([await embed(client, [text]) for text in TEXTS])  # batch 1, padded
    reversed_order = (await embed(client, TEXTS[::-1]))[::-1]
    concurrent = await asyncio.gather(*(embed(client, [text]) for text in TEXTS))
    mixed = np.vstack(concurrent)  # concurrent requests batched together by the batcher

    for served in (together, alone, reversed_order, mixed):
        assert cosine(served, reference).min() >= 0.999
    assert np.abs(together - alone).max() < 1e-4  # padding does not move a vector


async def test_cls_pooling_and_unnormalized_output(start_server, loaded_minilm) -> None:
    import torch

    client = await start_server("--pooling", "cls", "--no-normalize")
    served = await embed(client, ["A man is eating food."])
    tokens = loaded_minilm.tokenizer(["A man is eating food."], return_tensors="pt")
    with torch.inference_mode():
        expected = loaded_minilm.model(**tokens)[0][:, 0].numpy()
    np.testing.assert_allclose(served, expected, atol=1e-4)
