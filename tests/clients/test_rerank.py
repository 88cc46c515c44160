"""Re-rank and classification clients at their defaults against real servers (issue 43):
Cohere's own SDK (`cohere.ClientV2`, which posts /v2/rerank, and the older `cohere.Client`,
/v1/rerank), LangChain's `CohereRerank` (langchain-cohere) and LlamaIndex's `CohereRerank`
postprocessor, each pointed at the server by its `base_url`, as a team that runs its own
re-ranker configures them; and huggingface_hub's `InferenceClient.text_classification`, which
posts to the URL itself, against a classifier. Tiny seeded BERT cross-encoders of the zoo
(WordPiece; Korean and Japanese in the texts); the scores against `CrossEncoder.predict` and
transformers' own classifier, computed here."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from warmgate_testkit import zoo
from warmgate_testkit.process import ServerProcess

QUERY = "서울의 날씨는 어떤가요?"
DOCUMENTS = [
    "오늘 서울은 맑고 따뜻합니다.",
    "A man is eating a piece of bread.",
    "東京の天気はどうですか",
    "Kubernetes readiness gates keep a pod out of the endpoints until a condition turns true.",
    "🌧️ rain 비",
]
KEY = "not-used"
"""The clients insist on an API key; the server takes none."""


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return zoo.cross_encoder("bert-mean", tmp_path_factory.mktemp("reranker"), 1, "sigmoid")


@pytest.fixture(scope="module")
def scores(folder: Path) -> list[float]:
    """CrossEncoder.predict's score of each document, which differ (so the test can fail)."""
    from sentence_transformers import CrossEncoder

    found = CrossEncoder(str(folder), device="cpu").predict([(QUERY, d) for d in DOCUMENTS])
    found = [float(score) for score in found]
    assert len({f"{score:.3g}" for score in found}) == len(DOCUMENTS), found
    return found


@pytest.fixture(scope="module")
def server(folder: Path) -> Iterator[ServerProcess]:
    args = ["--model", str(folder), "--sequence-buckets", "32,64", "--warmup-batch-sizes", "1,4"]
    with ServerProcess(args) as running:
        assert running.wait_ready(300)["phase"] == "ready"
        yield running


def best(scores: list[float], top_n: int) -> list[int]:
    return sorted(range(len(scores)), key=lambda index: -scores[index])[:top_n]


def close(value: float) -> object:
    return pytest.approx(value, rel=1e-4, abs=1e-4)


def test_cohere_s_sdk_v2_and_v1_clients(server: ServerProcess, scores: list[float]) -> None:
    import cohere

    v2 = cohere.ClientV2(api_key=KEY, base_url=server.url)
    found = v2.rerank(model="reranker", query=QUERY, documents=DOCUMENTS, top_n=3)
    assert [result.index for result in found.results] == best(scores, 3)
    for result in found.results:
        assert result.relevance_score == close(scores[result.index])
    v1 = cohere.Client(api_key=KEY, base_url=server.url)
    found = v1.rerank(model="reranker", query=QUERY, documents=DOCUMENTS, return_documents=True)
    assert [result.index for result in found.results] == best(scores, len(DOCUMENTS))
    for result in found.results:
        assert result.relevance_score == close(scores[result.index])
        assert result.document is not None and result.document.text == DOCUMENTS[result.index]


def test_a_max_tokens_per_doc_below_the_input_limit_is_refused_not_ignored(
    server: ServerProcess, scores: list[float]
) -> None:
    """Cohere's v2 `max_tokens_per_doc`: at or above the server's input limit it changes
    nothing and is taken; below it the server would have to cut documents shorter than it
    does, and says so (OpenAI's shape: 400) rather than answer scores of uncut documents."""
    import cohere

    v2 = cohere.ClientV2(api_key=KEY, base_url=server.url)
    taken = v2.rerank(model="reranker", query=QUERY, documents=DOCUMENTS, max_tokens_per_doc=4096)
    assert [result.index for result in taken.results] == best(scores, len(DOCUMENTS))
    with pytest.raises(cohere.BadRequestError) as refused:
        v2.rerank(model="reranker", query=QUERY, documents=DOCUMENTS, max_tokens_per_doc=8)
    assert "max_tokens_per_doc" in str(refused.value.body)
    assert "64" in str(refused.value.body)  # the limit, named


def test_langchain_s_cohere_rerank(server: ServerProcess, scores: list[float]) -> None:
    from langchain_cohere import CohereRerank
    from langchain_core.documents import Document

    reranker = CohereRerank(model="reranker", cohere_api_key=KEY, base_url=server.url, top_n=3)  # type: ignore[call-arg]
    kept = reranker.compress_documents([Document(page_content=d) for d in DOCUMENTS], QUERY)
    assert [DOCUMENTS.index(doc.page_content) for doc in kept] == best(scores, 3)
    for doc in kept:
        assert doc.metadata["relevance_score"] == close(scores[DOCUMENTS.index(doc.page_content)])


def test_llamaindex_s_cohere_rerank(server: ServerProcess, scores: list[float]) -> None:
    from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
    from llama_index.postprocessor.cohere_rerank import CohereRerank

    reranker = CohereRerank(model="reranker", api_key=KEY, base_url=server.url, top_n=2)
    nodes = [NodeWithScore(node=TextNode(text=text)) for text in DOCUMENTS]
    kept = reranker.postprocess_nodes(nodes, QueryBundle(QUERY))
    assert [DOCUMENTS.index(node.node.get_content()) for node in kept] == best(scores, 2)
    for node in kept:
        assert node.score == close(scores[DOCUMENTS.index(node.node.get_content())])


@pytest.fixture(scope="module")
def classifier(tmp_path_factory) -> Iterator[tuple[ServerProcess, Path]]:
    folder = zoo.cross_encoder("bert-mean", tmp_path_factory.mktemp("classifier"), 3, None, seed=3)
    args = ["--model", str(folder), "--sequence-buckets", "32,64", "--warmup-batch-sizes", "1,4"]
    with ServerProcess(args) as running:
        assert running.wait_ready(300)["phase"] == "ready"
        yield running, folder


def test_huggingface_hub_s_text_classification(classifier, monkeypatch) -> None:
    """InferenceClient(model=URL).text_classification posts `{"inputs", "parameters"}` to the
    URL itself, which a classifier's server answers as /predict: softmax over the labels, best
    first; its `top_k` and `function_to_apply` applied. The client reads the Inference API's
    list per input (TEI's flat list for a lone input would give it the best label alone)."""
    import huggingface_hub
    import torch
    from huggingface_hub import InferenceClient
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    # The test run sets HF_HUB_OFFLINE=1 (nothing may reach a hub from here), which the client
    # applies to every URL; a user pointing it at their own server has it unset.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    server, folder = classifier
    text = DOCUMENTS[0]
    model = AutoModelForSequenceClassification.from_pretrained(str(folder)).eval()
    with torch.inference_mode():
        logits = model(**AutoTokenizer.from_pretrained(str(folder))(text, return_tensors="pt"))
    logits = logits.logits[0]
    labels = [model.config.id2label[index] for index in range(3)]
    client = InferenceClient(model=server.url)
    for options, scores in [
        ({}, torch.softmax(logits, -1)),
        ({"top_k": 2}, torch.softmax(logits, -1)),
        ({"function_to_apply": "sigmoid"}, torch.sigmoid(logits)),
        ({"function_to_apply": "none"}, logits),
    ]:
        found = client.text_classification(text, **options)
        want = sorted(zip(labels, scores.tolist(), strict=True), key=lambda item: -item[1])
        want = want[: options.get("top_k", 3)]
        assert [item.label for item in found] == [label for label, _ in want], options
        for item, (_, score) in zip(found, want, strict=True):
            assert item.score == close(score), options
