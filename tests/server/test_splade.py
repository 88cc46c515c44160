"""SPLADE sparse encoders (issue 43): a sentence-transformers SparseEncoder folder (a fill-mask
Transformer, or sentence-transformers 5's MLMTransformer, then SpladePooling) answers TEI's
/embed_sparse with the vectors `SparseEncoder.encode` gives, and refuses the dense routes with
a 424 that names the sparse one. Real server processes over HTTP (the packed pass and
transformers' padded one), tiny seeded models of the zoo (BERT and DistilBERT with WordPiece,
XLM-R with SentencePiece; Korean, Japanese, emoji and a long text), the references computed
here by sentence-transformers itself."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from support.texts import SCRIPTS

from warmgate_testkit import zoo
from warmgate_testkit.process import ServerProcess

TEXTS = SCRIPTS

# (family, pooling, activation, legacy module form, --packing)
CASES = {
    "bert-max-packed": ("bert-mean", "max", "relu", False, "auto"),
    "bert-max-padded": ("bert-mean", "max", "relu", False, "off"),
    "xlmr-sum-log1p-legacy": ("xlm-roberta-cls", "sum", "log1p_relu", True, "auto"),
    "distilbert-max-legacy": ("distilbert", "max", "relu", True, "auto"),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("splade")


@contextlib.contextmanager
def serve(folder: Path, *extra: str) -> Iterator[ServerProcess]:
    args = ["--model", str(folder), "--sequence-buckets", "32,64", "--warmup-batch-sizes", "1,4"]
    with ServerProcess([*args, *extra]) as server:
        report = server.wait_ready(300)
        assert report["phase"] == "ready", report
        yield server


@pytest.fixture(scope="module", params=list(CASES))
def case(request, root: Path) -> Iterator[tuple[ServerProcess, list[dict[int, float]]]]:
    from sentence_transformers import SparseEncoder

    family, pooling, activation, legacy, packing = CASES[request.param]
    folder = zoo.splade(family, root, pooling, activation, legacy=legacy)
    found = SparseEncoder(str(folder), device="cpu").encode(TEXTS).to_dense()
    expected = [
        {int(index): float(row[index]) for index in row.nonzero().flatten()} for row in found
    ]
    # The references differ between texts, so the test can fail.
    assert len({tuple(sorted(vector)) for vector in expected}) == len(TEXTS)
    assert all(0 < len(vector) < found.shape[1] for vector in expected)
    with serve(folder, "--packing", packing) as server:
        yield server, expected


def check(got: list[dict], want: dict[int, float]) -> None:
    """TEI's [{index, value}] by id, non-zero only, against SparseEncoder's vector: every id
    either gives within 1e-4. An id whose logits all sit within rounding of zero may weigh
    1e-6 on one side and nothing on the other (the batch a text shares changes the rounding of
    the packed pass), so an id is compared by weight, not by presence."""
    indices = [item["index"] for item in got]
    assert indices == sorted(indices)
    found = {item["index"]: item["value"] for item in got}
    assert all(value > 0 for value in found.values())
    for index in set(found) | set(want):
        assert found.get(index, 0.0) == pytest.approx(want.get(index, 0.0), rel=1e-4, abs=1e-4), (
            index,
            sorted(set(found) ^ set(want)),
        )


def test_embed_sparse_gives_sparse_encoder_s_vectors(case) -> None:
    server, expected = case
    report = requests.get(server.url + "/ready", timeout=10).json()
    assert report["model_settings"]["task"] == "embed"
    assert report["model_settings"]["outputs"] == ["sparse"]
    info = requests.get(server.url + "/info", timeout=10).json()
    assert info["model_type"] == {"embedding": {"pooling": "splade"}}  # as TEI says it
    listed = requests.get(server.url + "/v1/models", timeout=10).json()["data"][0]
    assert (listed["task"], listed["outputs"]) == ("embed", ["sparse"])
    with requests.Session() as session:
        answer = session.post(
            server.url + "/embed_sparse", json={"inputs": TEXTS, "truncate": True}
        )
        assert answer.status_code == 200, answer.text
        assert answer.headers["X-Warmgate-Cold"] == "0"
        for got, want in zip(answer.json(), expected, strict=True):
            check(got, want)
        lone = session.post(server.url + "/embed_sparse", json={"inputs": TEXTS[1]})
        assert lone.status_code == 200, lone.text
        check(lone.json()[0], expected[1])


def test_sparse_requests_batched_together_each_get_their_own(case) -> None:
    server, expected = case

    def ask(index: int) -> tuple[int, list]:
        text = TEXTS[index % len(TEXTS)]
        answer = requests.post(
            server.url + "/embed_sparse", json={"inputs": [text], "truncate": True}, timeout=60
        )
        assert answer.status_code == 200, answer.text
        return index, answer.json()[0]

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(24)))
    for index, got in answers:
        check(got, expected[index % len(TEXTS)])


def test_the_dense_routes_refuse_a_sparse_model_naming_the_sparse_route(case) -> None:
    """A SPLADE model has no dense vector: /embed, /v1/embeddings (through the OpenAI SDK) and
    /embed_multi's dense part answer 424 (TEI's status for a route of another kind of model),
    saying which route gives its vectors."""
    import openai

    server, _ = case
    with requests.Session() as session:
        for route, body in [
            ("/embed", {"inputs": ["비"]}),
            ("/embed_multi", {"inputs": ["비"]}),
            ("/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b"]}}),
        ]:
            answer = session.post(server.url + route, json=body)
            assert answer.status_code == 424, (route, answer.text)
            assert "/embed_sparse" in answer.json()["error"], answer.text
        sparse = session.post(
            server.url + "/embed_multi",
            json={"inputs": ["비"], "return_dense": False, "return_sparse": True},
        )
        assert sparse.status_code == 200, sparse.text
        assert set(sparse.json()) == {"lexical_weights"}
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    with pytest.raises(openai.APIStatusError) as refused:
        client.embeddings.create(model="any", input=["비"])
    assert refused.value.status_code == 424
    assert "/embed_sparse" in str(refused.value)


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"pooling_strategy": "mean"}, "pooling_strategy 'mean'"),
        (
            {"activation_function": "gelu"},
            "activation_function 'gelu'",
        ),
    ],
)
def test_a_splade_pooling_this_server_does_not_compute_is_refused_at_start(
    root: Path, tmp_path: Path, change: dict, said: str
) -> None:
    file = "1_SpladePooling/config.json"
    folder = tmp_path / "changed"
    shutil.copytree(zoo.splade("bert-mean", root), folder)
    config = json.loads((folder / file).read_text())
    (folder / file).write_text(json.dumps({**config, **change}))
    args = ["--model", str(folder), "--sequence-buckets", "32", "--warmup-batch-sizes", "1"]
    with ServerProcess(args) as server:
        assert server.process is not None
        code = server.process.wait(timeout=300)
        log = server.log()
    assert code != 0, log
    assert said in log, log


def test_the_mlm_decoder_is_the_encoder_s_word_embeddings_where_config_ties_them(
    root: Path, tmp_path: Path
) -> None:
    """A tied decoder is the encoder's own word-embedding tensor, not a second copy read from
    the checkpoint (94 MB for BERT's vocabulary); where config.json unties them, the
    checkpoint's own decoder, whatever the embeddings hold."""
    import torch
    from safetensors.torch import load_file, save_file

    from warmgate_server.splade import read_head

    folder = zoo.splade("bert-mean", root)
    config = json.loads((folder / "config.json").read_text())
    state = load_file(str(folder / "model.safetensors"))
    embeddings = state["bert.embeddings.word_embeddings.weight"].clone()
    cpu = torch.device("cpu")
    head = read_head(folder, config, cpu, embeddings)
    assert head.decoder is embeddings
    assert torch.equal(read_head(folder, config, cpu).decoder, embeddings)  # the same values

    untied = tmp_path / "untied"
    shutil.copytree(folder, untied)
    own = torch.randn_like(embeddings)
    save_file({**state, "cls.predictions.decoder.weight": own}, str(untied / "model.safetensors"))
    config["tie_word_embeddings"] = False
    (untied / "config.json").write_text(json.dumps(config))
    assert torch.equal(read_head(untied, config, cpu, embeddings).decoder, own)
