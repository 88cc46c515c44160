"""Request validation and response bodies for the OpenAI and text-embeddings-inference APIs."""

from __future__ import annotations

import base64
import json
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

try:  # optional: serialises float32 arrays about 10x faster than the standard library
    import orjson
except ImportError:  # pragma: no cover - depends on the environment
    orjson = None

from .errors import ApiError, empty, validation


@dataclass(frozen=True)
class Limits:
    max_inputs: int
    hidden_size: int
    model_names: Collection[str]
    default_normalize: bool


@dataclass(frozen=True)
class EmbedRequest:
    texts: list[str]
    normalize: bool
    dimensions: int | None = None
    truncate: bool = False
    truncate_left: bool = False
    base64: bool = False


def _texts(value: object, field: str, limits: Limits) -> list[str]:
    if value is None:
        raise validation(f"`{field}` is required: a string or a list of strings", "missing", field)
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not all(isinstance(text, str) for text in texts):
        raise validation(
            f"`{field}` must be a string or a list of strings (token ids are not accepted)",
            "invalid_type",
            field,
        )
    if not texts:
        raise empty(f"`{field}` is an empty list: send at least one text", field)
    for index, text in enumerate(texts):
        if not text:
            raise empty(f"`{field}[{index}]` is an empty string", field)
    if len(texts) > limits.max_inputs:
        raise validation(
            f"`{field}` has {len(texts)} texts, more than the limit of {limits.max_inputs} per "
            "request: split it into several requests",
            "too_many_inputs",
            field,
        )
    return texts


def _optional_int(value: object, field: str) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise validation(f"`{field}` must be an integer", "invalid_type", field)
    return value


def _dimensions(value: object, limits: Limits) -> int | None:
    dimensions = _optional_int(value, "dimensions")
    if dimensions is not None and not 1 <= dimensions <= limits.hidden_size:
        raise validation(
            f"`dimensions` must be between 1 and {limits.hidden_size} (this model's size), "
            f"got {dimensions}",
            "invalid_dimensions",
            "dimensions",
        )
    return dimensions


def _bool(value: object, field: str, default: bool) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise validation(f"`{field}` must be true or false", "invalid_type", field)
    return value


def _object(body: object) -> dict[str, object]:
    if not isinstance(body, dict):
        raise validation("the request body must be a JSON object", "invalid_type")
    return body


def parse_openai(body: object, limits: Limits) -> EmbedRequest:
    fields = _object(body)
    texts = _texts(fields.get("input"), "input", limits)
    model = fields.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise validation("`model` must be a string", "invalid_type", "model")
        if model not in limits.model_names:
            raise ApiError(
                404,
                f"model {model!r} is not served here; use one of: "
                + ", ".join(sorted(limits.model_names)),
                "validation",
                "model_not_found",
                "model",
            )
    encoding = fields.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise validation(
            f"`encoding_format` must be 'float' or 'base64', got {encoding!r}",
            "invalid_encoding_format",
            "encoding_format",
        )
    user = fields.get("user")
    if user is not None and not isinstance(user, str):
        raise validation("`user` must be a string", "invalid_type", "user")
    return EmbedRequest(
        texts=texts,
        normalize=limits.default_normalize,
        dimensions=_dimensions(fields.get("dimensions"), limits),
        base64=encoding == "base64",
    )


def parse_tei(body: object, limits: Limits) -> EmbedRequest:
    fields = _object(body)
    texts = _texts(fields.get("inputs"), "inputs", limits)
    direction = fields.get("truncation_direction", "right")
    if not isinstance(direction, str) or direction.lower() not in ("left", "right"):
        raise validation(
            "`truncation_direction` must be 'Left' or 'Right'",
            "invalid_truncation_direction",
            "truncation_direction",
        )
    if fields.get("prompt_name") is not None:
        raise validation(
            "`prompt_name` is not supported: this server has no prompts configured",
            "unsupported",
            "prompt_name",
        )
    return EmbedRequest(
        texts=texts,
        normalize=_bool(fields.get("normalize"), "normalize", limits.default_normalize),
        dimensions=_dimensions(fields.get("dimensions"), limits),
        truncate=_bool(fields.get("truncate"), "truncate", False),
        truncate_left=direction.lower() == "left",
    )


def openai_response(
    vectors: np.ndarray, model: str, prompt_tokens: int, as_base64: bool
) -> dict[str, object]:
    data = []
    for index, vector in enumerate(vectors):
        if as_base64:
            embedding: object = base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
        else:
            embedding = vector
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


def _plain(value: object) -> object:
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"cannot encode {type(value).__name__} as JSON")


def dumps(body: object) -> bytes:
    """JSON bytes of a response body that may hold numpy arrays (float32 kept exact)."""
    if orjson is not None:
        return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
    return json.dumps(body, default=_plain).encode()
