"""Rerankers and classifiers (issue 43): a sentence-transformers CrossEncoder folder, found by
the server from its own files, answers TEI's /rerank and /predict and the Cohere-style
/v1/rerank that Cohere, Jina and Infinity clients send, with CrossEncoder.predict's scores;
its (pairs x buckets) plan is warmed. Real server processes over HTTP, tiny seeded models of
the zoo (a BERT with its WordPiece tokenizer, an XLM-R with its SentencePiece one, Korean and
Japanese in the texts), references computed here by sentence-transformers."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import requests

from warmgate_testkit import zoo
from warmgate_testkit.process import ServerProcess

QUERY = "서울의 날씨는 어떤가요?"
DOCUMENTS = [
    "오늘 서울은 맑고 따뜻합니다.",
    "A man is eating a piece of bread.",
    "東京の天気はどうですか",
    "Kubernetes readiness gates keep a pod out of the endpoints until a condition turns true. " * 3,
    "🌧️ rain 비",
]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cross-encoders")
    return {
        "bert-sigmoid": zoo.cross_encoder("bert-mean", root, 1, "sigmoid"),
        "xlmr-identity": zoo.cross_encoder("xlm-roberta-mean", root, 1, "identity", seed=1),
        "bert-two-labels": zoo.cross_encoder("bert-mean", root, 2, None, seed=2),
    }


PASSES = {"packed": "auto", "padded": "off"}
"""The padding-free pass (the default: BERT's and XLM-R's classification heads on it,
models/classify.py) and transformers' own (--packing off)."""


@contextlib.contextmanager
def _serve(folder: Path, forward: str = "packed") -> Iterator[ServerProcess]:
    """A warm server of `folder` (stopped by its pid on the way out, failing or not) on the
    `forward` pass (PASSES)."""
    args = ["--model", str(folder), "--sequence-buckets", "32,64", "--warmup-batch-sizes", "1,4",
            "--packing", PASSES[forward]]  # fmt: skip
    with ServerProcess(args) as server:
        report = server.wait_ready(300)
        assert report["phase"] == "ready", report
        assert report["forward"]["pass"] == forward, report["forward"]
        yield server


@pytest.fixture(scope="module", params=list(PASSES))
def bert(request, models) -> Iterator[ServerProcess]:
    with _serve(models["bert-sigmoid"], request.param) as server:
        yield server


@pytest.fixture(scope="module", params=list(PASSES))
def xlmr(request, models) -> Iterator[ServerProcess]:
    with _serve(models["xlmr-identity"], request.param) as server:
        yield server


def close(value: float) -> object:
    """A served score against the exact one (`reference`): float32's rounding through the
    layers, which these tiny random models magnify (CrossEncoder.predict's own float32 logit
    of 7.1 was 2.6e-4 from its float64 one; the packed pass was as close to it as
    transformers' pass); a wrong head or activation is off by far more."""
    return pytest.approx(value, rel=1e-4, abs=1e-4)


def reference(folder: Path, pairs: list, **options) -> np.ndarray:
    """CrossEncoder.predict's scores in float64: the exact answer each float32 pass rounds."""
    import torch
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(str(folder), device="cpu", model_kwargs={"torch_dtype": torch.float64})
    return np.asarray(model.predict(pairs, convert_to_tensor=True, **options).double())


def test_tei_rerank_scores_are_cross_encoder_predict_s_sorted_best_first(
    models, bert, xlmr
) -> None:
    for name, server in (("bert-sigmoid", bert), ("xlmr-identity", xlmr)):
        expected = reference(models[name], [(QUERY, doc) for doc in DOCUMENTS])
        assert len(set(expected.tolist())) == len(DOCUMENTS), expected  # the test can fail
        with requests.Session() as session:
            answer = session.post(
                server.url + "/rerank",
                json={"query": QUERY, "texts": DOCUMENTS, "return_text": True, "truncate": True},
            )
        assert answer.status_code == 200, answer.text
        assert answer.headers["X-Warmgate-Cold"] == "0"
        results = answer.json()
        assert [r["index"] for r in results] == list(np.argsort(-expected)), (name, results)
        for item in results:
            assert item["score"] == close(float(expected[item["index"]]))
            assert item["text"] == DOCUMENTS[item["index"]]


@pytest.mark.parametrize("forward", list(PASSES))
def test_a_qwen3_sequence_classifier_ranks_as_cross_encoder_predict(tmp_path, forward) -> None:
    """Qwen3-Reranker as people deploy it on TEI and vLLM: converted to a one-label
    `Qwen3ForSequenceClassification` (its `score` row: the "yes" logit less the "no" one). The
    decoder's packed pass takes the logits of each pair's last token that is not the pad token,
    as transformers does; its byte-level BPE tokenizer joins a pair's two texts as they are."""
    folder = zoo.cross_encoder("qwen3", tmp_path, 1, "sigmoid", seed=4)
    expected = reference(folder, [(QUERY, doc) for doc in DOCUMENTS])
    assert len(set(expected.tolist())) == len(DOCUMENTS), expected  # the test can fail
    with _serve(folder, forward) as server:
        answer = requests.post(
            server.url + "/rerank", json={"query": QUERY, "texts": DOCUMENTS, "truncate": True}
        )
        lone = requests.post(server.url + "/rerank", json={"query": QUERY, "texts": DOCUMENTS[1:2]})
    assert answer.status_code == 200, answer.text
    results = answer.json()
    assert [r["index"] for r in results] == list(np.argsort(-expected)), results
    for item in results:
        assert item["score"] == close(float(expected[item["index"]]))
    assert lone.status_code == 200, lone.text
    assert lone.json()[0]["score"] == close(float(expected[1]))


def test_a_modernbert_cross_encoder_ranks_as_cross_encoder_predict(tmp_path) -> None:
    """A ModernBERT re-ranker (gte-reranker-modernbert's family: its own tokenizer, a
    `ModernBertForSequenceClassification` head over its pooled states) runs transformers'
    padded pass (the packed one has no ModernBERT layers and says so), warm, with
    CrossEncoder.predict's scores."""
    folder = zoo.cross_encoder("modernbert", tmp_path, 1, "sigmoid", seed=3)
    expected = reference(folder, [(QUERY, doc) for doc in DOCUMENTS])
    assert len({f"{score:.4f}" for score in expected}) == len(DOCUMENTS), expected
    args = ["--model", str(folder), "--sequence-buckets", "32,64", "--warmup-batch-sizes", "1,4"]
    with ServerProcess(args) as server:
        report = server.wait_ready(300)
        assert report["phase"] == "ready", report
        assert report["forward"]["pass"] == "padded", report["forward"]
        assert report["model_settings"]["task"] == "rerank"
        answer = requests.post(
            server.url + "/rerank", json={"query": QUERY, "texts": DOCUMENTS, "truncate": True}
        )
    assert answer.status_code == 200, answer.text
    assert answer.headers["X-Warmgate-Cold"] == "0"
    results = answer.json()
    assert [r["index"] for r in results] == list(np.argsort(-expected)), results
    for item in results:
        assert item["score"] == close(float(expected[item["index"]]))


def test_raw_scores_are_the_logits_before_the_folder_s_activation(models, bert) -> None:
    pairs = [(QUERY, doc) for doc in DOCUMENTS[:3]]
    logits = reference(models["bert-sigmoid"], pairs, activation_fn=lambda x: x)
    assert any(not 0 < value < 1 for value in logits)  # no sigmoid could have given these
    answer = requests.post(
        bert.url + "/rerank", json={"query": QUERY, "texts": DOCUMENTS[:3], "raw_scores": True}
    )
    assert answer.status_code == 200, answer.text
    scores = {r["index"]: r["score"] for r in answer.json()}
    for index, value in enumerate(logits):
        assert scores[index] == close(float(value))
    assert "text" not in answer.json()[0]


def test_cohere_style_v1_rerank_with_top_n_and_documents(models, xlmr) -> None:
    """The body Cohere's, Jina's and Infinity's rerank clients send (LangChain's CohereRerank
    and LlamaIndex's rerankers through them): `documents` as strings or {"text": ...},
    `top_n`, `return_documents`."""
    expected = reference(models["xlmr-identity"], [(QUERY, doc) for doc in DOCUMENTS])
    order = list(np.argsort(-expected))
    body = {
        "model": "any",
        "query": QUERY,
        "documents": [DOCUMENTS[0], *({"text": doc} for doc in DOCUMENTS[1:])],
        "top_n": 3,
        "return_documents": True,
    }
    answer = requests.post(xlmr.url + "/v1/rerank", json=body)
    assert answer.status_code == 200, answer.text
    found = answer.json()
    assert [r["index"] for r in found["results"]] == order[:3]
    for item in found["results"]:
        assert item["relevance_score"] == close(float(expected[item["index"]]))
        assert item["document"] == {"text": DOCUMENTS[item["index"]]}
    assert found["usage"]["total_tokens"] > 0 and found["model"]
    plain = requests.post(xlmr.url + "/v1/rerank", json={**body, "return_documents": False})
    assert "document" not in plain.json()["results"][0]


def test_bad_rerank_requests_get_a_4xx_saying_what_is_wrong(bert) -> None:
    cases = [
        ({"texts": ["a"]}, "query"),
        ({"query": "q", "texts": []}, "texts"),
        ({"query": "q", "texts": "not a list"}, "texts"),
        ({"query": "q", "texts": ["a"], "raw_scores": "yes"}, "raw_scores"),
    ]
    for body, field in cases:
        answer = requests.post(bert.url + "/rerank", json=body)
        assert 400 <= answer.status_code < 500, (body, answer.text)
        assert field in answer.json()["error"], (body, answer.json())
    long = requests.post(bert.url + "/rerank", json={"query": "q", "texts": ["word " * 500]})
    assert long.status_code == 422 and "truncate=true" in long.json()["error"], long.text
    v1 = requests.post(bert.url + "/v1/rerank", json={"query": "q", "documents": [{"x": 1}]})
    assert v1.status_code == 400 and "documents" in v1.json()["error"]["message"], v1.text


def test_an_embedding_route_on_a_reranker_is_refused_and_the_task_is_reported(bert) -> None:
    refused = requests.post(bert.url + "/embed", json={"inputs": "hello"})
    assert refused.status_code == 424 and "re-ranker" in refused.json()["error"], refused.text
    openai = requests.post(bert.url + "/v1/embeddings", json={"input": "hello"})
    assert openai.status_code == 424, openai.text
    report = requests.get(bert.url + "/ready").json()
    assert report["model_settings"]["task"] == "rerank"
    info = requests.get(bert.url + "/info").json()
    assert info["model_type"] == {
        "reranker": {"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}
    }


def test_a_two_label_classifier_answers_predict_with_the_labels(models) -> None:
    folder = models["bert-two-labels"]
    texts = [DOCUMENTS[0], DOCUMENTS[1]]
    # predict() takes a list of two strings as one pair: each text is its own call.
    logits = [reference(folder, text, activation_fn=lambda x: x) for text in texts]
    with _serve(folder) as server:
        answer = requests.post(server.url + "/predict", json={"inputs": texts[0]})
        assert answer.status_code == 200, answer.text
        probabilities = np.exp(logits[0]) / np.exp(logits[0]).sum()
        got = {item["label"]: item["score"] for item in answer.json()}
        assert got == pytest.approx(
            {"label_0": float(probabilities[0]), "label_1": float(probabilities[1])}, abs=1e-5
        )
        batch = requests.post(server.url + "/predict", json={"inputs": [[t] for t in texts]})
        for items, expected in zip(batch.json(), logits, strict=True):
            probabilities = np.exp(expected) / np.exp(expected).sum()
            assert {i["label"]: i["score"] for i in items} == pytest.approx(
                {"label_0": float(probabilities[0]), "label_1": float(probabilities[1])}, abs=1e-5
            )
        pair = requests.post(server.url + "/predict", json={"inputs": texts, "raw_scores": True})
        expected = reference(folder, [tuple(texts)], activation_fn=lambda x: x)[0]
        got = {item["label"]: item["score"] for item in pair.json()}
        assert got == pytest.approx({"label_0": expected[0], "label_1": expected[1]}, abs=1e-4)
        rerank = requests.post(server.url + "/rerank", json={"query": "q", "texts": ["a"]})
        assert rerank.status_code == 424 and "classifier" in rerank.json()["error"]


# ------------------------------------------------------------------ the task, from the folder
def _settings(folder: Path, *flags: str):
    from support.server import make_config

    from warmgate_server.model_folder import resolve

    return resolve(make_config(folder, *flags), folder)


def test_the_task_is_read_from_the_folder_and_a_folder_that_could_be_either_is_refused(
    models, minilm_dir: Path, tmp_path: Path
) -> None:
    from warmgate_server.model_folder import ModelConfigError

    assert _settings(models["bert-sigmoid"]).task == "rerank"
    assert _settings(models["bert-two-labels"]).task == "classify"
    assert _settings(minilm_dir).task == "embed"
    # An embedder's folder (modules.json pools) whose config.json names a classifier: either.
    both = tmp_path / "both"
    shutil.copytree(minilm_dir, both)
    config = json.loads((both / "config.json").read_text())
    config.update(architectures=["BertForSequenceClassification"], id2label={"0": "LABEL_0"})
    (both / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelConfigError) as refused:
        _settings(both)
    assert "--task" in str(refused.value) and "spec.model.task" in str(refused.value)
    assert "BertForSequenceClassification" in str(refused.value)
    assert _settings(both, "--task", "embed").task == "embed"
    assert _settings(both, "--task", "rerank").task == "rerank"
    with pytest.raises(ModelConfigError, match="1 labels"):
        _settings(both, "--task", "classify")
    with pytest.raises(ModelConfigError, match="the folder is a rerank model"):
        _settings(models["bert-sigmoid"], "--task", "embed")


def test_an_older_cross_encoder_s_activation_in_config_json_and_one_not_applied(
    models, tmp_path: Path
) -> None:
    """CrossEncoders saved before sentence-transformers 4 have no modules.json: config.json
    names the activation (`sentence_transformers.activation_fn`)."""
    from warmgate_server.model_folder import ModelConfigError

    older = tmp_path / "older"
    shutil.copytree(models["bert-sigmoid"], older)
    for name in ("modules.json", "config_sentence_transformers.json", "sentence_bert_config.json"):
        (older / name).unlink()
    config = json.loads((older / "config.json").read_text())
    config["sentence_transformers"] = {"activation_fn": "torch.nn.modules.linear.Identity"}
    (older / "config.json").write_text(json.dumps(config))
    settings = _settings(older)
    assert (settings.task, settings.activation) == ("rerank", "torch.nn.modules.linear.Identity")
    config["sentence_transformers"] = {"activation_fn": "my_package.Softplus"}
    (older / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelConfigError, match=r"my_package\.Softplus"):
        _settings(older)


CAUSAL_PROMPT = "Given a question about the weather, find the passages that answer it"


@pytest.fixture(scope="module")
def causal(tmp_path_factory) -> dict[str, Path]:
    """Qwen3-Reranker's own form (zoo.causal_reranker): with the template's own instruction,
    and with the folder's default prompt as the instruction."""
    root = tmp_path_factory.mktemp("causal-rerankers")
    return {
        "template's instruction": zoo.causal_reranker(root, 0),
        "folder's prompt": zoo.causal_reranker(root, 1, CAUSAL_PROMPT),
    }


def test_qwen3_reranker_s_own_causal_form_scores_as_cross_encoder_predict(causal) -> None:
    """Qwen3-Reranker as its sentence-transformers folder has it: a Qwen3ForCausalLM, then
    LogitScore (the last token's "yes" logit less its "no" logit), each (query, document)
    rendered by the tokenizer's chat template, the folder's default prompt as the system
    message. Served on the packed pass with the score as one row (the two LM-head rows'
    difference), warm, its scores and raw logits CrossEncoder.predict's. A document over the
    limit is refused, or with truncate cut as CrossEncoder cuts it: the first tokens kept and
    the template's tail written back over the last ones, where the score is read."""
    long_document = "Kubernetes readiness gates keep a pod out of the endpoints. " * 40
    documents = [*DOCUMENTS, long_document]
    pairs = [(QUERY, doc) for doc in documents]
    for name, folder in causal.items():
        expected = reference(folder, pairs)
        logits = reference(folder, pairs, activation_fn=lambda x: x)
        assert len({f"{score:.3f}" for score in expected}) == len(documents), (name, expected)
        args = ["--model", str(folder), "--sequence-buckets", "128,256,512",
                "--warmup-batch-sizes", "1,4"]  # fmt: skip
        with ServerProcess(args) as server:
            report = server.wait_ready(300)
            assert report["phase"] == "ready", report
            assert report["forward"]["pass"] == "packed", report["forward"]
            settings = report["model_settings"]
            assert settings["task"] == "rerank" and settings["max_input_length"] == 512
            assert settings["logit_score"] == {"true_token_id": 600, "false_token_id": 601}
            assert "LogitScore" in settings["chosen_by"]["task"], settings["chosen_by"]
            with requests.Session() as session:
                answer = session.post(
                    server.url + "/rerank",
                    json={"query": QUERY, "texts": documents, "truncate": True},
                )
                raw = session.post(
                    server.url + "/rerank",
                    json={"query": QUERY, "texts": documents[:3], "raw_scores": True},
                )
                refused = session.post(
                    server.url + "/rerank", json={"query": QUERY, "texts": documents}
                )
                cohere = session.post(
                    server.url + "/v1/rerank",
                    json={"query": QUERY, "documents": documents[:5], "top_n": 2},
                )
        assert answer.status_code == 200, answer.text
        assert answer.headers["X-Warmgate-Cold"] == "0"
        results = answer.json()
        assert [r["index"] for r in results] == list(np.argsort(-expected)), (name, results)
        for item in results:
            assert item["score"] == close(float(expected[item["index"]])), (name, item)
        assert raw.status_code == 200, raw.text
        for item in raw.json():
            assert item["score"] == close(float(logits[item["index"]])), (name, item)
        assert refused.status_code == 422, refused.text
        assert "input 5 has" in refused.json()["error"]
        assert "above the limit of 512" in refused.json()["error"]
        assert cohere.status_code == 200, cohere.text
        top = list(np.argsort(-expected[:5]))[:2]
        assert [r["index"] for r in cohere.json()["results"]] == top


def test_a_causal_reranker_is_served_only_as_its_folder_says(tmp_path, causal) -> None:
    """A CrossEncoder on a *ForCausalLM needs LogitScore after its Transformer and a chat
    template; without either it is refused at start naming what is missing, never scored
    some other way. transformers' padded pass is refused for it (it would compute every
    token's logits over the vocabulary to read two)."""
    from warmgate_server.config import parse_config
    from warmgate_server.loading import ModelLoadError, load_model
    from warmgate_server.model_folder import ModelConfigError

    source = causal["template's instruction"]
    folder = tmp_path / "no-logit-score"
    shutil.copytree(source, folder)
    modules = json.loads((folder / "modules.json").read_text())
    (folder / "modules.json").write_text(json.dumps(modules[:1]))
    with pytest.raises(ModelConfigError, match=r"Qwen3ForCausalLM.*Transformer, then LogitScore"):
        _settings(folder)
    folder = tmp_path / "no-template"
    shutil.copytree(source, folder)
    (folder / "chat_template.jinja").unlink()
    with pytest.raises(ModelConfigError, match=r"without a chat template"):
        _settings(folder)
    argv = ["--model", str(source), "--device", "cpu", "--packing", "off"]
    with pytest.raises(ModelLoadError, match=r"runs on the padding-free pass only.*--packing off"):
        load_model(parse_config(argv, environ={}))
