"""bge-m3's three outputs from one pass (issue 43): a folder with FlagEmbedding's
`sparse_linear.pt` and `colbert_linear.pt` beside its encoder answers its dense vector on every
embedding route, its lexical weights on TEI's /embed_sparse, and any of the three on
/embed_multi, as FlagEmbedding's `BGEM3FlagModel.encode` computes them. Real server processes
over HTTP (the packed pass and transformers' padded one), a tiny seeded bge-m3-shaped model of
the zoo (XLM-R, its SentencePiece tokenizer; Korean, Japanese and emoji in the texts), the
references computed here by FlagEmbedding itself."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import requests
from support.flag_embedding import flag_embedding_m3
from support.texts import SCRIPTS

from warmgate_testkit import zoo
from warmgate_testkit.process import ServerProcess

TEXTS = SCRIPTS
MAX_LENGTH = 64
"""The zoo model's max_seq_length: the long text is truncated to it on both sides."""


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return zoo.m3(tmp_path_factory.mktemp("bge-m3"))


@pytest.fixture(scope="module")
def expected(folder: Path) -> dict:
    model = flag_embedding_m3()(str(folder), use_fp16=False, devices="cpu")
    found = model.encode(
        TEXTS,
        max_length=MAX_LENGTH,
        return_dense=True,
        return_sparse=True,
        return_colbert_vecs=True,
    )
    dense = np.asarray(found["dense_vecs"])
    # The references differ between texts, so the test can fail.
    similarity = dense @ dense.T
    assert similarity[~np.eye(len(TEXTS), dtype=bool)].max() < 0.99, similarity
    weights = [{int(k): float(v) for k, v in w.items()} for w in found["lexical_weights"]]
    assert len({tuple(sorted(w)) for w in weights}) == len(TEXTS), weights
    assert sum(len(w) for w in weights) > len(TEXTS)
    return {"dense": dense, "sparse": weights, "colbert": found["colbert_vecs"]}


@contextlib.contextmanager
def serve(folder: Path, *extra: str) -> Iterator[ServerProcess]:
    args = ["--model", str(folder), "--sequence-buckets", "32,64", "--warmup-batch-sizes", "1,4"]
    with ServerProcess([*args, *extra]) as server:
        report = server.wait_ready(300)
        assert report["phase"] == "ready", report
        assert report["model_settings"]["outputs"] == ["dense", "sparse", "colbert"]
        yield server


@pytest.fixture(scope="module", params=["auto", "off"], ids=["packed", "padded"])
def server(request, folder: Path) -> Iterator[ServerProcess]:
    with serve(folder, "--packing", request.param) as running:
        yield running


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def check_sparse(got: dict[int, float], want: dict[int, float]) -> None:
    assert sorted(got) == sorted(want)
    for token, weight in want.items():
        assert got[token] == pytest.approx(weight, rel=1e-4, abs=1e-4), token


def test_embed_multi_gives_bgem3flagmodel_s_dense_sparse_and_colbert_outputs(
    server: ServerProcess, expected: dict
) -> None:
    body = {"inputs": TEXTS, "truncate": True, "return_sparse": True, "return_colbert_vecs": True}
    with requests.Session() as session:
        answer = session.post(server.url + "/embed_multi", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.headers["X-Warmgate-Cold"] == "0"
    found = answer.json()
    assert set(found) == {"dense_vecs", "lexical_weights", "colbert_vecs"}
    assert cosines(found["dense_vecs"], expected["dense"]).min() > 0.99999
    assert np.linalg.norm(found["dense_vecs"], axis=1) == pytest.approx(1.0, abs=1e-5)
    for got, want in zip(found["lexical_weights"], expected["sparse"], strict=True):
        check_sparse({int(k): v for k, v in got.items()}, want)  # its ids as strings, as theirs
    for got, want in zip(found["colbert_vecs"], expected["colbert"], strict=True):
        got = np.asarray(got)
        assert got.shape == want.shape  # every token but CLS, the final </s> included
        assert cosines(got, want).min() > 0.99999


def test_embed_sparse_answers_tei_s_format_and_the_dense_routes_the_dense_vector(
    server: ServerProcess, expected: dict
) -> None:
    from openai import OpenAI

    with requests.Session() as session:
        sparse = session.post(
            server.url + "/embed_sparse", json={"inputs": TEXTS, "truncate": True}
        )
        assert sparse.status_code == 200, sparse.text
        for got, want in zip(sparse.json(), expected["sparse"], strict=True):
            assert [item["index"] for item in got] == sorted(want)  # by id, non-zero only
            check_sparse({item["index"]: item["value"] for item in got}, want)
        dense = session.post(server.url + "/embed", json={"inputs": TEXTS, "truncate": True})
        assert dense.status_code == 200, dense.text
        assert cosines(dense.json(), expected["dense"]).min() > 0.99999
        # Only the dense vector, and no normalisation asked: the module chain's (CLS) vector.
        raw = session.post(
            server.url + "/embed_multi", json={"inputs": TEXTS[:2], "normalize": False}
        ).json()
        assert set(raw) == {"dense_vecs"}
        assert cosines(raw["dense_vecs"], expected["dense"][:2]).min() > 0.99999
    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    served = client.embeddings.create(model="bge-m3-tiny-0", input=TEXTS[:4])
    vectors = np.asarray([item.embedding for item in served.data])
    assert cosines(vectors, expected["dense"][:4]).min() > 0.99999


def test_requests_for_different_outputs_batched_together_each_get_their_own(
    server: ServerProcess, expected: dict
) -> None:
    """Dense, sparse and ColBERT requests at once, one input each: the batcher puts them in the
    same batches (one pass), and each answer is its own input's."""

    def ask(index: int) -> tuple[int, str, object]:
        text = TEXTS[index % len(TEXTS)]
        route, body = [
            ("/embed", {"inputs": [text], "truncate": True}),
            ("/embed_sparse", {"inputs": [text], "truncate": True}),
            ("/embed_multi", {"inputs": [text], "truncate": True, "return_dense": False,
                              "return_colbert_vecs": True}),
        ][index % 3]  # fmt: skip
        answer = requests.post(server.url + route, json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        return index, route, answer.json()

    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(ask, range(45)))
    for index, route, found in answers:
        which = index % len(TEXTS)
        if route == "/embed":
            assert cosines(found[0], expected["dense"][which]) > 0.99999
        elif route == "/embed_sparse":
            check_sparse(
                {item["index"]: item["value"] for item in found[0]}, expected["sparse"][which]
            )
        else:
            assert set(found) == {"colbert_vecs"}
            assert (
                cosines(np.asarray(found["colbert_vecs"][0]), expected["colbert"][which]).min()
                > 0.99999
            )


def test_the_outputs_a_model_lacks_are_refused_with_the_file_that_gives_them(
    tmp_path: Path,
) -> None:
    encoder = zoo.build("xlm-roberta-cls", "hub", tmp_path)
    args = ["--model", str(encoder), "--sequence-buckets", "32", "--warmup-batch-sizes", "1"]
    with ServerProcess(args) as server:
        report = server.wait_ready(300)
        assert report["model_settings"]["outputs"] == ["dense"]
        with requests.Session() as session:
            sparse = session.post(server.url + "/embed_sparse", json={"inputs": ["비"]})
            assert sparse.status_code == 424
            assert "sparse_linear.pt" in sparse.json()["error"], sparse.text
            colbert = session.post(
                server.url + "/embed_multi", json={"inputs": ["비"], "return_colbert_vecs": True}
            )
            assert colbert.status_code == 424
            assert "colbert_linear.pt" in colbert.json()["error"], colbert.text
            nothing = session.post(
                server.url + "/embed_multi", json={"inputs": ["비"], "return_dense": False}
            )
            assert nothing.status_code == 422
            assert "return_sparse" in nothing.json()["error"], nothing.text
            dense = session.post(server.url + "/embed_multi", json={"inputs": ["비"]})
            assert dense.status_code == 200 and len(dense.json()["dense_vecs"]) == 1


def test_a_head_that_does_not_fit_the_encoder_fails_the_load_naming_it(
    folder: Path, tmp_path: Path
) -> None:
    import shutil

    import torch

    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    torch.save(torch.nn.Linear(32, 1).state_dict(), broken / "sparse_linear.pt")
    args = ["--model", str(broken), "--sequence-buckets", "32", "--warmup-batch-sizes", "1"]
    with ServerProcess(args) as server:
        assert server.process is not None
        code = server.process.wait(timeout=300)
        said = server.log()
    assert code != 0, said
    assert "sparse_linear.pt: weight (1, 32) and bias (1,) do not take the encoder's" in said


async def test_a_large_answer_is_sent_in_pieces_with_its_whole_length(
    aiohttp_client, folder: Path, expected: dict, monkeypatch
) -> None:
    """An answer of more numbers than schemas.YIELD_FLOATS (tens of MiB of ColBERT vectors for
    a real batch; lowered here to fit this tiny model's) is written in pieces and sent as they
    come, with Content-Length their sum and no chunked framing: the client reads the same
    JSON as the one-piece answer."""
    from support.models import serve as serve_in_process

    from warmgate_server import schemas

    client, report = await serve_in_process(aiohttp_client, folder)
    assert report["phase"] == "ready", report
    body = {"inputs": TEXTS, "truncate": True, "return_sparse": True, "return_colbert_vecs": True}
    whole = await client.post("/embed_multi", json=body)
    assert whole.status == 200, await whole.text()
    one_piece = await whole.read()
    monkeypatch.setattr(schemas, "YIELD_FLOATS", 16)
    monkeypatch.setattr(schemas, "YIELD_EVERY", 64)
    monkeypatch.setattr(schemas, "PIECE_BYTES", 1024)
    streamed = await client.post("/embed_multi", json=body)
    assert streamed.status == 200, await streamed.text()
    assert streamed.headers.get("Transfer-Encoding") is None
    assert int(streamed.headers["Content-Length"]) == len(one_piece) > 4 * 1024
    assert streamed.headers["Content-Type"].startswith("application/json")
    assert streamed.headers["X-Warmgate-Cold"] == "0"
    found = await streamed.json()
    assert found == json.loads(one_piece)
    for got, want in zip(found["colbert_vecs"], expected["colbert"], strict=True):
        assert cosines(np.asarray(got), want).min() > 0.99999
