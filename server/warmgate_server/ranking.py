"""Re-rankers and classifiers (issue 43): the request bodies of text-embeddings-inference's
`/rerank` and `/predict` and of the Cohere-style `/v1/rerank` (Cohere's, Jina's and Infinity's
clients send it), and their answers from a classification head's logits.

Scores are what sentence-transformers' `CrossEncoder.predict` returns: the logits through the
activation the folder names (config_sentence_transformers.json's `activation_fn`, an older
CrossEncoder's config.json; by default Sigmoid for one label, Identity for more).
`raw_scores: true` (TEI) gives the logits. TEI's `/predict` gives a classifier's labels with
softmax probabilities (its own rule for more than one label) unless `raw_scores`.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import validation
from .model_folder import IDENTITY, SIGMOID, TANH
from .schemas import EmbedRequest, Limits, Output, check_unicode, parse_flag, parse_object


@dataclass(frozen=True)
class RankRequest(EmbedRequest):
    """A re-ranking: `texts` the query once per document, `second` the documents."""

    raw_scores: bool = False
    return_text: bool = False
    top_n: int | None = None
    cohere: bool = False
    """The Cohere-style /v1/rerank (its answer's shape), else TEI's /rerank."""


@dataclass(frozen=True)
class PredictRequest(EmbedRequest):
    """A classification of one input or a batch (`batch`: TEI answers a list per input)."""

    raw_scores: bool = False
    batch: bool = False
    top_k: int | None = None
    """huggingface_hub's text_classification `parameters.top_k`: the best labels kept."""
    function: str | None = None
    """Its `parameters.function_to_apply` (FUNCTIONS), else the route's own choice."""
    pipeline: bool = False
    """The body has `parameters` (the text-classification pipeline's form, which
    huggingface_hub's InferenceClient sends): a lone input is answered as a list of one (the
    Inference API's shape, which the client reads), not as TEI's flat list."""


FUNCTIONS = ("sigmoid", "softmax", "none")
"""transformers' text-classification pipeline's function_to_apply values."""


def activate(logits: np.ndarray, activation: str | None) -> np.ndarray:
    """The folder's activation over (inputs, labels) logits, as CrossEncoder.predict applies
    it (None: Sigmoid for one label, Identity for more)."""
    if activation is None:
        activation = SIGMOID if logits.shape[-1] == 1 else IDENTITY
    if activation == SIGMOID:
        return 1.0 / (1.0 + np.exp(-logits))
    if activation == IDENTITY:
        return logits
    assert activation == TANH, activation  # model_folder refuses any other
    return np.tanh(logits)


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


def _string(value: object, field: str) -> str:
    if not isinstance(value, str):
        raise validation(f"`{field}` must be a string", "invalid_type", field)
    check_unicode(value, field)
    return value


def _documents(value: object, field: str, limits: Limits, objects: bool) -> list[str]:
    """A non-empty list of strings (and, `objects`, of {"text": ...} as Cohere's and Jina's
    clients send documents)."""
    if not isinstance(value, list) or not value:
        raise validation(
            f"`{field}` must be a non-empty list of strings"
            + (' or of {"text": "..."} objects' if objects else ""),
            "invalid_type",
            field,
        )
    if len(value) > limits.max_inputs:
        raise validation(
            f"batch size {len(value)} > maximum allowed batch size {limits.max_inputs}",
            "too_many_inputs",
            field,
        )
    texts = []
    for index, item in enumerate(value):
        if objects and isinstance(item, dict) and isinstance(item.get("text"), str):
            item = item["text"]
        if not isinstance(item, str):
            expected = 'a string or {"text": "..."}' if objects else "a string"
            raise validation(f"`{field}[{index}]` must be {expected}", "invalid_type", field)
        check_unicode(item, f"{field}[{index}]")
        texts.append(item)
    return texts


def parse_rerank(body: object, limits: Limits) -> RankRequest:
    """TEI's /rerank: `query`, `texts`, `raw_scores`, `return_text`, `truncate`."""
    fields = parse_object(body)
    query = _string(fields.get("query"), "query")
    texts = _documents(fields.get("texts"), "texts", limits, objects=False)
    direction = fields.get("truncation_direction", "right")
    if not isinstance(direction, str) or direction.lower() != "right":
        raise validation(
            "`truncation_direction` must be 'Right': a pair is cut on its longer text's end, "
            "as CrossEncoder cuts it",
            "invalid_truncation_direction",
            "truncation_direction",
        )
    return RankRequest(
        texts=[query] * len(texts),
        second=list(texts),
        normalize=False,
        output=Output.SCORES,
        truncate=parse_flag(fields.get("truncate"), "truncate", limits.auto_truncate),
        raw_scores=parse_flag(fields.get("raw_scores"), "raw_scores", False),
        return_text=parse_flag(fields.get("return_text"), "return_text", False),
    )


def parse_cohere_rerank(body: object, limits: Limits) -> RankRequest:
    """The Cohere-style /v1/rerank (and Cohere's v2 /v2/rerank, which its SDK's ClientV2,
    LangChain's and LlamaIndex's CohereRerank post): `query`, `documents` (strings or
    {"text": ...}), `top_n`, `return_documents` (default false, as Cohere's v2 API),
    `max_tokens_per_doc` (_check_max_tokens_per_doc); `model` is the router's business.
    Inputs over the model's limit are truncated, as Cohere, Jina and Infinity do."""
    fields = parse_object(body)
    query = _string(fields.get("query"), "query")
    documents = _documents(fields.get("documents"), "documents", limits, objects=True)
    top_n = fields.get("top_n")
    if top_n is not None and (not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 1):
        raise validation("`top_n` must be a positive integer", "invalid_type", "top_n")
    _check_max_tokens_per_doc(fields.get("max_tokens_per_doc"), limits)
    return RankRequest(
        texts=[query] * len(documents),
        second=list(documents),
        normalize=False,
        output=Output.SCORES,
        truncate=True,
        return_text=parse_flag(fields.get("return_documents"), "return_documents", False),
        top_n=top_n,
        cohere=True,
    )


def _check_max_tokens_per_doc(value: object, limits: Limits) -> None:
    """Cohere's v2 `max_tokens_per_doc`: a cap at or above the server's input limit changes
    nothing (every pair is already cut to that limit), and is taken; a lower one would cut
    documents shorter than this server cuts them, and is refused rather than ignored."""
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise validation(
            "`max_tokens_per_doc` must be a positive integer", "invalid_type", "max_tokens_per_doc"
        )
    limit = limits.max_input_length
    if limit is not None and value < limit:
        raise validation(
            f"`max_tokens_per_doc` {value} is below this model's input limit of {limit} tokens "
            f"per pair, to which every pair is already cut; this server does not cut documents "
            f"shorter: omit it or give at least {limit}",
            "invalid_value",
            "max_tokens_per_doc",
        )


def parse_predict(body: object, limits: Limits) -> PredictRequest:
    """TEI's /predict: `inputs` a text, a [text] or [text, text] pair, or a list of those."""
    fields = parse_object(body)
    value = fields.get("inputs")
    message = (
        "`inputs` must be a string, a list of one or two strings (a text or a pair), or a "
        "non-empty list of those"
    )
    batch = isinstance(value, list) and bool(value) and not all(isinstance(v, str) for v in value)
    items = value if batch else [value]
    if not isinstance(items, list) or len(items) > limits.max_inputs:
        raise validation(message, "invalid_type", "inputs")
    first: list[str] = []
    second: list[str | None] = []
    for index, item in enumerate(items):
        parts = [item] if isinstance(item, str) else item
        if (
            not isinstance(parts, list)
            or not 1 <= len(parts) <= 2
            or not all(isinstance(part, str) for part in parts)
        ):
            raise validation(message, "invalid_type", "inputs")
        for part in parts:
            check_unicode(part, f"inputs[{index}]")
        first.append(parts[0])
        second.append(parts[1] if len(parts) == 2 else None)
    return PredictRequest(
        texts=list(first),
        second=second,
        normalize=False,
        output=Output.SCORES,
        truncate=parse_flag(fields.get("truncate"), "truncate", limits.auto_truncate),
        raw_scores=parse_flag(fields.get("raw_scores"), "raw_scores", False),
        batch=batch,
        pipeline="parameters" in fields,
        **_pipeline_parameters(fields.get("parameters")),
    )


def _pipeline_parameters(value: object) -> dict[str, Any]:
    """`parameters` as huggingface_hub's InferenceClient.text_classification sends them (the
    text-classification pipeline's): `top_k` and `function_to_apply`; another is refused."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise validation("`parameters` must be an object", "invalid_type", "parameters")
    unknown = sorted(set(value) - {"top_k", "function_to_apply"})
    if unknown:
        raise validation(
            f"`parameters.{unknown[0]}` is not one this route applies (top_k, function_to_apply)",
            "invalid_value",
            f"parameters.{unknown[0]}",
        )
    top_k, function = value.get("top_k"), value.get("function_to_apply")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise validation(
            "`parameters.top_k` must be a positive integer", "invalid_type", "parameters.top_k"
        )
    if function is not None and function not in FUNCTIONS:
        raise validation(
            f"`parameters.function_to_apply` must be one of {', '.join(FUNCTIONS)}",
            "invalid_value",
            "parameters.function_to_apply",
        )
    return {"top_k": top_k, "function": function}


def rerank_answer(
    request: RankRequest, logits: np.ndarray, activation: str | None, model: str, tokens: int
) -> Any:
    """Best first: TEI's [{index, score, text?}] or the Cohere-style {results: [{index,
    relevance_score, document?}], ...}."""
    scores = (logits if request.raw_scores else activate(logits, activation))[:, 0]
    order = sorted(range(len(scores)), key=lambda index: -float(scores[index]))
    documents = request.second or []
    if not request.cohere:
        return [
            {"index": index, "score": float(scores[index])}
            | ({"text": documents[index]} if request.return_text else {})
            for index in order
        ]
    results = [
        {"index": index, "relevance_score": float(scores[index])}
        | ({"document": {"text": documents[index]}} if request.return_text else {})
        for index in order[: request.top_n]
    ]
    return {
        "id": str(uuid.uuid4()),
        "object": "rerank",
        "model": model,
        "created": int(time.time()),
        "results": results,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "meta": {"billed_units": {"search_units": 1}},
    }


def predict_answer(
    request: PredictRequest, logits: np.ndarray, labels: tuple[str, ...], activation: str | None
) -> Any:
    """TEI's [{score, label}] per input, best first (a list of those for a batch, or for the
    pipeline's form); the best `top_k` labels where the request asks."""
    if request.raw_scores or request.function == "none":
        scores = logits
    elif request.function == "sigmoid":
        scores = activate(logits, SIGMOID)
    elif request.function == "softmax" or logits.shape[-1] > 1:
        scores = softmax(logits)
    else:
        scores = activate(logits, activation)
    answers = [
        sorted(
            (
                {"score": float(value), "label": label}
                for value, label in zip(row, labels, strict=True)
            ),
            key=lambda item: -item["score"],
        )[: request.top_k]
        for row in scores
    ]
    return answers if request.batch or request.pipeline else answers[0]
