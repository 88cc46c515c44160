"""text-embeddings-inference's API, as its clients use it: huggingface_hub's InferenceClient
(feature extraction and sentence similarity, posted to the server's URL itself), and TEI's own
routes with TEI's request fields, response shapes and status codes (docs/openapi.json of
text-embeddings-inference): /embed, /tokenize, /decode, /similarity, /health, /info, and 424 for
the routes of other kinds of model."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import huggingface_hub.constants
import numpy as np
import pytest
from huggingface_hub import InferenceClient
from tokenizers import Tokenizer

from warmgate_testkit.process import minilm_path

TEXTS = ["A warm model answers fast.", "Déjà vu: naïve café ☕ costs 3€."]


def call(server, path: str, body: object | None = None) -> tuple[int, object]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        server.url + path, data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def tokenizer() -> Tokenizer:
    loaded = Tokenizer.from_file(str(minilm_path() / "tokenizer.json"))
    loaded.no_truncation()
    loaded.no_padding()
    return loaded


def test_inference_client_feature_extraction_and_similarity(server, reference, monkeypatch) -> None:
    # The test run sets HF_HUB_OFFLINE=1 (nothing may reach a hub from here), which the client
    # applies to every URL; a user pointing it at their own server has it unset.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    client = InferenceClient(model=server.url)
    vector = client.feature_extraction(TEXTS[0])
    np.testing.assert_allclose(np.asarray(vector).reshape(-1), reference(TEXTS[:1])[0], atol=1e-5)
    scores = client.sentence_similarity(TEXTS[0], other_sentences=TEXTS)
    expected = reference(TEXTS) @ reference(TEXTS[:1])[0]
    np.testing.assert_allclose(scores, expected, atol=1e-5)


def test_embed_takes_texts_and_token_ids_and_the_aliases_agree(server, reference) -> None:
    ids = [encoding.ids for encoding in tokenizer().encode_batch(TEXTS)]
    for path, body in (
        ("/embed", {"inputs": TEXTS}),
        ("/embed", {"inputs": ids}),
        ("/embed", {"inputs": [TEXTS[0], ids[1]]}),
        ("/invocations", {"inputs": TEXTS}),
        ("/", {"inputs": TEXTS}),
    ):
        status, vectors = call(server, path, body)
        assert status == 200, (path, vectors)
        np.testing.assert_allclose(vectors, reference(TEXTS), atol=1e-5, err_msg=path)
    status, body = call(server, "/embeddings", {"input": TEXTS})
    assert status == 200 and body["object"] == "list" and len(body["data"]) == 2


def test_tokenize_and_decode_as_tei_does(server) -> None:
    status, tokens = call(server, "/tokenize", {"inputs": TEXTS[1]})
    assert status == 200 and len(tokens) == 1  # one input: still a list of lists
    encoding = tokenizer().encode(TEXTS[1])
    assert [token["id"] for token in tokens[0]] == encoding.ids
    first, *middle, last = tokens[0]
    assert first == {"id": 101, "text": "[CLS]", "special": True, "start": None, "stop": None}
    assert last["text"] == "[SEP]" and last["special"]
    raw = TEXTS[1].encode()
    for token in middle:  # UTF-8 byte spans of the input, as TEI reports them
        assert not token["special"]
        assert raw[token["start"] : token["stop"]].decode() == token["text"]
    status, bare = call(server, "/tokenize", {"inputs": TEXTS, "add_special_tokens": False})
    assert status == 200 and len(bare) == 2 and not any(t["special"] for t in bare[0])

    ids = [[t["id"] for t in tokens[0]], [t["id"] for t in bare[0]]]
    status, texts = call(server, "/decode", {"ids": ids})
    assert status == 200
    assert texts == [tokenizer().decode(ids[0]), tokenizer().decode(ids[1])]
    status, kept = call(server, "/decode", {"ids": ids[0], "skip_special_tokens": False})
    assert status == 200 and kept[0].startswith("[CLS]")


def test_similarity_route(server, reference) -> None:
    body = {"inputs": {"source_sentence": TEXTS[0], "sentences": TEXTS}}
    status, scores = call(server, "/similarity", body)
    assert status == 200
    np.testing.assert_allclose(scores, reference(TEXTS) @ reference(TEXTS[:1])[0], atol=1e-5)


def test_health_info_and_the_routes_of_other_kinds_of_model(server) -> None:
    for path in ("/health", "/ping", "/"):
        with urllib.request.urlopen(server.url + path, timeout=10) as response:
            assert response.status == 200 and response.read() == b""
    status, info = call(server, "/info")
    assert status == 200
    required = {
        "model_id", "model_dtype", "served_model_name", "model_type", "max_concurrent_requests",
        "max_input_length", "max_batch_tokens", "max_client_batch_size", "auto_truncate",
        "tokenization_workers", "version",
    }  # fmt: skip
    assert required <= set(info)
    assert info["model_type"] == {"embedding": {"pooling": "mean"}}
    assert info["auto_truncate"] is False and info["max_client_batch_size"] == 2048
    for path in ("/rerank", "/predict", "/embed_sparse"):
        status, error = call(server, path, {"query": "x", "texts": ["y"], "inputs": "x"})
        assert status == 424 and error["error_type"] == "Backend", (path, error)
        assert "model is not a" in error["error"]


@pytest.mark.parametrize(
    ("path", "body", "status", "error_type"),
    [
        ("/tokenize", {"inputs": []}, 400, "Empty"),
        ("/tokenize", {"inputs": 7}, 422, "Validation"),
        ("/decode", {"ids": "abc"}, 422, "Validation"),
        ("/decode", {"ids": [[1, 10**9]]}, 422, "Validation"),
        ("/similarity", {"inputs": {"source_sentence": "x"}}, 422, "Validation"),
        ("/similarity", {"inputs": "x"}, 422, "Validation"),
    ],
)
def test_bad_input_on_the_tei_routes(server, path, body, status, error_type) -> None:
    got, error = call(server, path, body)
    assert (got, error["error_type"]) == (status, error_type), error
    assert error["error"]


def test_embed_all_gives_every_tokens_vector_as_sentence_transformers(server) -> None:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm_path()), device="cpu")
    expected = model.encode(TEXTS, output_value="token_embeddings")
    status, states = call(server, "/embed_all", {"inputs": TEXTS})
    assert status == 200 and len(states) == len(TEXTS)
    for got, want in zip(states, expected, strict=True):
        want = want.numpy()
        assert np.array(got).shape == want.shape  # (tokens with [CLS] and [SEP], 384)
        np.testing.assert_allclose(np.array(got), want, atol=1e-4)
    status, normalized = call(server, "/embed_all", {"inputs": TEXTS[0], "normalize": True})
    assert status == 200
    np.testing.assert_allclose(np.linalg.norm(np.array(normalized[0]), axis=1), 1.0, atol=1e-5)
