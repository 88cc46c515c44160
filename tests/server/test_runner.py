"""Served vectors equal sentence-transformers' encode, whatever the bucket or batch they ran in."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

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


@pytest.mark.parametrize("packing", ["on", "off"])
async def test_vectors_match_sentence_transformers_across_buckets_and_batches(
    start_server, sentence_transformer, packing: str
) -> None:
    reference = sentence_transformer.encode(TEXTS, convert_to_numpy=True)
    lengths = [len(sentence_transformer.tokenizer(text)["input_ids"]) for text in TEXTS]
    assert min(lengths) <= 16 < 32 < max(lengths) <= 64  # the texts span three buckets

    client = await start_server("--packing", packing)
    info = await (await client.get("/info")).json()
    assert info["packed"] is (packing == "on")
    together = await embed(client, TEXTS)  # one request, split by bucket and padded to size 4
    alone = np.vstack([await embed(client, [text]) for text in TEXTS])  # batch 1, padded
    reversed_order = (await embed(client, TEXTS[::-1]))[::-1]
    concurrent = await asyncio.gather(*(embed(client, [text]) for text in TEXTS))
    mixed = np.vstack(concurrent)  # concurrent requests batched together by the batcher

    for served in (together, alone, reversed_order, mixed):
        assert cosine(served, reference).min() >= 0.999
    assert np.abs(together - alone).max() < 1e-4  # padding does not move a vector


@pytest.mark.parametrize("packing", ["on", "off"])
async def test_cls_pooling_and_unnormalized_output(
    start_server, loaded_minilm_padded, minilm_dir, packing: str
) -> None:
    import torch
    from transformers import AutoTokenizer

    client = await start_server("--pooling", "cls", "--no-normalize", "--packing", packing)
    served = await embed(client, ["A man is eating food.", "hi"])
    reference = AutoTokenizer.from_pretrained(str(minilm_dir))
    tokens = reference(["A man is eating food."], return_tensors="pt")
    with torch.inference_mode():
        expected = loaded_minilm_padded.model(**tokens)[0][:, 0].numpy()
    np.testing.assert_allclose(served[:1], expected, atol=1e-4)


@pytest.mark.parametrize("case", ["modernbert", "sinusoidal-distilbert", "sliding-window-qwen3"])
def test_packing_falls_back_for_other_architectures_and_on_refuses_them(
    tmp_path, minilm_dir, case: str
) -> None:
    """A model the packed pass does not run (a ModernBERT; a DistilBERT with sinusoidal
    position embeddings, which transformers may write over the checkpoint's; a Qwen3 with
    sliding-window attention) is served by its own padded forward pass under `--packing
    auto`; `--packing on` refuses to start and says why."""
    from transformers import AutoTokenizer, DistilBertConfig, DistilBertModel

    from warmgate_contract.shapes import Shape
    from warmgate_server.config import parse_config
    from warmgate_server.loading import ModelLoadError, load_model
    from warmgate_server.runner import ModelRunner
    from warmgate_testkit import zoo

    if case == "modernbert":
        folder = zoo.build("modernbert", "current", tmp_path)
        why = "model type 'modernbert' is not one of bert"
    elif case == "sliding-window-qwen3":
        import json

        folder = zoo.build("qwen3", "current", tmp_path)
        config = json.loads((folder / "config.json").read_text())
        config.update(use_sliding_window=True, sliding_window=4, max_window_layers=1)
        config["layer_types"] = ["full_attention", "sliding_attention"]
        (folder / "config.json").write_text(json.dumps(config))
        why = "sliding-window attention"
    else:
        folder = tmp_path / case
        config = DistilBertConfig(dim=32, n_layers=1, n_heads=2, hidden_dim=64,
                                  sinusoidal_pos_embds=True)  # fmt: skip
        DistilBertModel(config).save_pretrained(folder)
        AutoTokenizer.from_pretrained(str(minilm_dir)).save_pretrained(folder)
        why = "position embeddings are sinusoidal"

    loaded = load_model(parse_config(["--model", str(folder), "--device", "cpu"], environ={}))
    assert loaded.packed is None and loaded.model is not None
    runner = ModelRunner(loaded, "mean", 32)
    vectors = runner.execute(runner.tokenize(["hello there", "hi"]), Shape(4, 16)).vectors
    assert vectors.shape == (2, loaded.hidden_size) and np.isfinite(vectors).all()

    with pytest.raises(ModelLoadError, match=f"--packing on: {why}"):
        load_model(
            parse_config(["--model", str(folder), "--device", "cpu", "--packing", "on"], environ={})
        )


@pytest.mark.parametrize(
    ("activation", "pooling"), [("gelu", "mean"), ("relu", "cls"), ("gelu_new", "mean")]
)
def test_packed_pass_equals_the_transformers_forward_pass_for_other_bert_configs(
    tmp_path, activation: str, pooling: str
) -> None:
    """Random BERTs unlike MiniLM (3 layers, 4 heads, another activation), loaded from their
    saved folder by the packed loader: same vectors as transformers' own padded pass, with
    inputs of several lengths and padding rows."""
    import torch
    from support.server import pooled
    from transformers import BertConfig, BertModel

    from warmgate_server.models.bert import PackedBert

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=120, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        intermediate_size=96, max_position_embeddings=64, hidden_act=activation,
    )  # fmt: skip
    model = BertModel(config).eval()
    model.save_pretrained(tmp_path)
    packed = PackedBert.from_folder(tmp_path, torch.float32)
    batch = [[2, 5, 9, 3], [2, 7, 3], [2, 11, 12, 13, 14, 15, 3]]
    ids = torch.zeros(3, 8, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, tokens in enumerate(batch):
        ids[row, : len(tokens)], mask[row, : len(tokens)] = torch.tensor(tokens), 1
    with torch.inference_mode():
        hidden = model(input_ids=ids, attention_mask=mask)[0]
        if pooling == "cls":
            expected = hidden[:, 0]
        else:
            expected = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        got = pooled(packed, batch, 8, 4, pooling)  # 4 rows: one padding row
        from_model = pooled(PackedBert.from_model(model), batch, 8, 4, pooling)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(from_model, expected, atol=2e-5, rtol=1e-4)


def test_token_states_of_the_padded_and_packed_passes_agree(
    loaded_minilm, loaded_minilm_padded, sentence_transformer
) -> None:
    """/embed_all's unpooled output (pool=False) from both forward passes: per input, every
    real token's state, as sentence-transformers' token_embeddings."""
    from warmgate_contract.shapes import Shape
    from warmgate_server.runner import ModelRunner

    texts = ["a warm model", "answers every request fast, even the first one"]
    expected = sentence_transformer.encode(texts, output_value="token_embeddings")
    for loaded in (loaded_minilm, loaded_minilm_padded):
        runner = ModelRunner(loaded, "mean", 128, packed=loaded.packed is not None)
        ids = runner.tokenize(texts)
        result = runner.execute(ids, Shape(4, 32), pool=False)
        assert [states.shape for states in result.vectors] == [(len(t), 384) for t in ids]
        for got, want in zip(result.vectors, expected, strict=True):
            np.testing.assert_allclose(got, want.numpy(), atol=1e-4)
