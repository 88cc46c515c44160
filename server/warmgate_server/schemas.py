"""Request validation and response bodies for the OpenAI and text-embeddings-inference APIs.
A parsed request (EmbedRequest) is the plan of what the pipeline does with it."""

from __future__ import annotations

import base64
import enum
import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace

import numpy as np

try:  # optional: serialises float32 arrays about 10x faster than the standard library
    import orjson
except ImportError:  # pragma: no cover - depends on the environment
    orjson = None

from .errors import Refused, empty, validation
from .model_folder import HEAD_FILES


@dataclass(frozen=True)
class Vocabulary:
    """Whose token ids an input given as ids holds, and how many ids there are."""

    name: str
    """`model` (the model's own ids), or an OpenAI encoding's name (cl100k_base)."""
    size: int

    @property
    def model_own(self) -> bool:
        return self.name == "model"


@dataclass(frozen=True)
class Limits:
    """What requests are checked against: resolved once, when the model is loaded."""

    max_inputs: int
    hidden_size: int
    model_names: Collection[str]
    default_normalize: bool
    vocab: Vocabulary = Vocabulary("model", 1 << 31)
    """The model's token ids, which TEI's routes take."""
    openai_vocab: Vocabulary | None = None
    """The ids the OpenAI route takes when they are not the model's (--openai-token-ids)."""
    auto_truncate: bool = False
    prompts: Mapping[str, str] = field(default_factory=dict)
    """The model's named prompts, which a request picks with `prompt_name`."""
    outputs: tuple[str, ...] = ("dense",)
    """What the model gives (model_folder.ModelSettings.outputs): "dense", and "sparse" and
    "colbert" where the folder has bge-m3's heads; a SPLADE model "sparse" alone."""
    max_input_length: int | None = None
    """Tokens per input (a pair's both texts) the server takes."""


Input = str | list[int]
"""A text, or the model's own token ids (TEI and OpenAI both accept them)."""


class Output(enum.Enum):
    """What a request gets back, which decides the forward pass and the post step."""

    POOLED = "pooled"
    """One vector per input (/v1/embeddings, /embed)."""
    TOKENS = "tokens"
    """Per input, every token's vector, unpooled (/embed_all)."""
    SIMILARITY = "similarity"
    """The first input's cosine similarity with each of the others (/similarity)."""
    SCORES = "scores"
    """Per input (a pair, or a text), the classifier's logits (/rerank, /v1/rerank, /predict):
    the route applies the activation."""
    MULTI = "multi"
    """Per input, bge-m3's outputs from one pass (multi.MultiOutput): /embed_sparse's lexical
    weights, /embed_multi's `parts`."""


@dataclass(frozen=True)
class EmbedRequest:
    texts: list[Input]
    normalize: bool
    output: Output = Output.POOLED
    dimensions: int | None = None
    truncate: bool = False
    truncate_left: bool = False
    base64: bool = False
    openai_ids: bool = False
    """Inputs given as ids are OpenAI's (decoded to text by the engine), not the model's."""
    prompt: str | None = None
    """The text of the prompt the request named (`prompt_name`); None: the default prompt."""
    second: list[str | None] | None = None
    """A re-ranker's or classifier's inputs: `texts[i]` is paired with `second[i]` (None: the
    text alone); None for an embedding request."""
    parts: tuple[str, ...] = ()
    """Output.MULTI: which of "dense", "sparse" and "colbert" the answer holds."""


def check_unicode(text: str, where: str) -> None:
    """JSON can carry unpaired surrogates (`"\\ud800"`), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise validation(
            f"`{where}` is not valid Unicode: an unpaired surrogate at character {error.start}",
            "invalid_unicode",
            where.split("[")[0].split(".")[0],
        ) from None


def _is_ids(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(item, int) and not isinstance(item, bool) for item in value
    )


def _texts(value: object, field: str, max_inputs: int, vocab: Vocabulary) -> list[Input]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists (the
    OpenAI and TEI input shapes, mixed as TEI allows)."""
    if value is None:
        raise validation(f"`{field}` is required: a string or a list of strings", "missing", field)
    if isinstance(value, str):
        inputs: list = [value]
    elif _is_ids(value) and value:
        inputs = [value]  # one input given as token ids
    elif isinstance(value, list):
        inputs = value
    else:
        inputs = None
    if inputs is None or not all(isinstance(item, str) or _is_ids(item) for item in inputs):
        raise validation(
            f"`{field}` must be a string, a list of strings, a list of token ids or a list of "
            "token-id lists",
            "invalid_type",
            field,
        )
    if not inputs:
        raise empty(f"`{field}` is an empty list: send at least one text", field)
    for index, item in enumerate(inputs):
        if not item:
            what = "an empty string" if isinstance(item, str) else "an empty list of token ids"
            raise empty(f"`{field}[{index}]` is {what}", field)
        if isinstance(item, str):
            check_unicode(item, f"{field}[{index}]")
        if not isinstance(item, str) and not all(0 <= i < vocab.size for i in item):
            whose = "this model's vocabulary" if vocab.model_own else f"the {vocab.name} vocabulary"
            raise validation(
                f"`{field}[{index}]` has token ids outside {whose} (0..{vocab.size - 1})"
                + (
                    ": token ids are the model's own, not another tokenizer's (the server "
                    "takes OpenAI's with --openai-token-ids cl100k_base)"
                    if vocab.model_own
                    else ""
                ),
                "invalid_token_ids",
                field,
            )
    if len(inputs) > max_inputs:
        raise validation(
            f"`{field}` has {len(inputs)} inputs, more than the limit of {max_inputs} per "
            "request: split it into several requests",
            "too_many_inputs",
            field,
        )
    return inputs


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


def parse_strings(value: object, field: str, max_inputs: int) -> list[str]:
    """A string or a non-empty list of strings (the tokenizer routes)."""
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not all(isinstance(text, str) for text in texts):
        raise validation(f"`{field}` must be a string or a list of strings", "invalid_type", field)
    if not texts:
        raise empty(f"`{field}` cannot be empty", field)
    if len(texts) > max_inputs:
        raise validation(
            f"batch size {len(texts)} > maximum allowed batch size {max_inputs}",
            "too_many_inputs",
            field,
        )
    for index, text in enumerate(texts):
        check_unicode(text, f"{field}[{index}]")
    return texts


def parse_id_lists(value: object, field: str, vocab_size: int, max_inputs: int) -> list[list[int]]:
    """Token ids, or a list of token-id lists (/decode)."""
    lists = [value] if _is_ids(value) else value
    if not isinstance(lists, list) or not lists or not all(_is_ids(item) for item in lists):
        raise validation(
            f"`{field}` must be a list of token ids or a non-empty list of token-id lists",
            "invalid_type",
            field,
        )
    if len(lists) > max_inputs:
        raise validation(
            f"batch size {len(lists)} > maximum allowed batch size {max_inputs}",
            "too_many_inputs",
            field,
        )
    for index, ids in enumerate(lists):
        if not all(0 <= token < vocab_size for token in ids):
            raise validation(
                f"`{field}[{index}]` has token ids outside the vocabulary (0..{vocab_size - 1})",
                "invalid_token_ids",
                field,
            )
    return lists


def parse_flag(value: object, field: str, default: bool) -> bool:
    return _bool(value, field, default)


def parse_object(body: object) -> dict[str, object]:
    return _object(body)


def parse_prompt_name(fields: dict[str, object], prompts: Mapping[str, str]) -> str | None:
    """The text of the model prompt `prompt_name` names (TEI's field), or None when absent."""
    name = fields.get("prompt_name")
    if name is None:
        return None
    if not isinstance(name, str):
        raise validation("`prompt_name` must be a string", "invalid_prompt_name", "prompt_name")
    if name not in prompts:
        known = ", ".join(repr(key) for key in sorted(prompts))
        raise validation(
            f"`prompt_name` {name!r} is not one of the model's prompts"
            + (f": {known}" if known else ": it has none (config_sentence_transformers.json)"),
            "invalid_prompt_name",
            "prompt_name",
        )
    return prompts[name]


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
    vocab = limits.openai_vocab or limits.vocab
    texts = _texts(fields.get("input"), "input", limits.max_inputs, vocab)
    model = fields.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise validation("`model` must be a string", "invalid_type", "model")
        if model not in limits.model_names:
            raise Refused(
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
        truncate=limits.auto_truncate,
        base64=encoding == "base64",
        openai_ids=not vocab.model_own,
    )


def parse_tei(body: object, limits: Limits) -> EmbedRequest:
    fields = _object(body)
    texts = _texts(fields.get("inputs"), "inputs", limits.max_inputs, limits.vocab)
    direction = fields.get("truncation_direction", "right")
    if not isinstance(direction, str) or direction.lower() not in ("left", "right"):
        raise validation(
            "`truncation_direction` must be 'Left' or 'Right'",
            "invalid_truncation_direction",
            "truncation_direction",
        )
    return EmbedRequest(
        texts=texts,
        normalize=_bool(fields.get("normalize"), "normalize", limits.default_normalize),
        dimensions=_dimensions(fields.get("dimensions"), limits),
        truncate=_bool(fields.get("truncate"), "truncate", limits.auto_truncate),
        truncate_left=direction.lower() == "left",
        prompt=parse_prompt_name(fields, limits.prompts),
    )


def parse_tei_tokens(body: object, limits: Limits) -> EmbedRequest:
    """TEI's /embed_all: as /embed, but every token's vector; `normalize` (per token) defaults
    to false, as TEI's does."""
    parsed = parse_tei(body, limits)
    normalize = _bool(_object(body).get("normalize"), "normalize", False)
    return replace(parsed, output=Output.TOKENS, normalize=normalize)


def needs(limits: Limits, parts: tuple[str, ...], route: str) -> None:
    """424 (TEI's status for a route of another kind of model) when the model lacks an output:
    a SparseEncoder (SPLADE) has no dense vector, an embedder no sparse or ColBERT head."""
    for part in parts:
        if part in limits.outputs:
            continue
        if part == "dense":
            message = (
                f"model is not a dense embedding model: it is a sparse encoder (SPLADE), whose "
                f"vectors POST /embed_sparse gives; {route} serves dense vectors"
            )
        else:
            splade = " or a SPLADE model's (a SparseEncoder folder)" * (part == "sparse")
            message = (
                f"model is not a {part} embedding model: {route} serves bge-m3's {part} head "
                f"({HEAD_FILES[part]} beside the encoder){splade}, which this model lacks"
            )
        raise Refused(424, message, "backend", "wrong_model_type")


def parse_tei_sparse(body: object, limits: Limits) -> EmbedRequest:
    """TEI's /embed_sparse: /embed's fields, each input's lexical weights back (the route has
    checked that the model has them: routes._giving)."""
    return replace(parse_tei(body, limits), output=Output.MULTI, parts=("sparse",))


MULTI_FLAGS = {"dense": "return_dense", "sparse": "return_sparse", "colbert": "return_colbert_vecs"}
"""/embed_multi's fields, named as BGEM3FlagModel.encode names its arguments."""


def parse_multi(body: object, limits: Limits) -> EmbedRequest:
    """/embed_multi: /embed's fields and BGEM3FlagModel.encode's `return_dense` (default
    true), `return_sparse` and `return_colbert_vecs` (default false): the asked outputs from
    one pass."""
    fields = _object(body)
    defaults = {"dense": True, "sparse": False, "colbert": False}
    parts = tuple(
        part for part, flag in MULTI_FLAGS.items() if _bool(fields.get(flag), flag, defaults[part])
    )
    if not parts:
        raise validation(
            "nothing to return: set return_dense, return_sparse or return_colbert_vecs",
            "invalid_value",
            "return_dense",
        )
    needs(limits, parts, "/embed_multi")
    rest = {key: value for key, value in fields.items() if key not in MULTI_FLAGS.values()}
    return replace(parse_tei(rest, limits), output=Output.MULTI, parts=parts)


def parse_similarity(body: object, limits: Limits) -> EmbedRequest:
    """TEI's /similarity: `inputs.source_sentence` and `inputs.sentences`, TEI's `parameters`
    (`truncate`, `truncation_direction`)."""
    fields = _object(body)
    given = fields.get("inputs")
    if not isinstance(given, dict):
        raise validation(
            "`inputs` must be an object with `source_sentence` (a string) and `sentences` "
            "(a list of strings)",
            "invalid_type",
            "inputs",
        )
    source = given.get("source_sentence")
    sentences = given.get("sentences")
    if not isinstance(source, str) or not source:
        raise validation("`inputs.source_sentence` must be a non-empty string", "invalid_type")
    check_unicode(source, "inputs.source_sentence")
    texts = parse_strings(sentences, "inputs.sentences", limits.max_inputs - 1)
    parameters = fields.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise validation("`parameters` must be an object", "invalid_type", "parameters")
    options = parse_tei({"inputs": texts, **parameters}, limits)
    return EmbedRequest(
        texts=[source, *texts],
        normalize=True,
        output=Output.SIMILARITY,
        truncate=options.truncate,
        truncate_left=options.truncate_left,
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


def exact_floats(vectors: np.ndarray) -> np.ndarray:
    """Vectors as `dumps` writes each float32 exactly (contiguous float32, which orjson takes)."""
    return np.ascontiguousarray(vectors, dtype=np.float32)


def _plain(value: object) -> object:
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"cannot encode {type(value).__name__} as JSON")


def dumps(body: object) -> bytes:
    """JSON bytes of a response body that may hold numpy arrays (float32 kept exact)."""
    if orjson is not None:
        return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
    return json.dumps(body, default=_plain).encode()


YIELD_FLOATS = 1 << 18
"""A body holding more numbers than this (1 MiB of float32) is written a piece at a time,
the event loop given a turn between pieces (`json_pieces`)."""


YIELD_EVERY = 1 << 15
"""Numbers written between two turns of the loop (about 1 ms of orjson here): a larger array
is written in blocks of its rows."""
PIECE_BYTES = 1 << 20
"""The pieces of a large answer, sent as they come (`json_pieces`): about this size each."""


async def json_pieces(body: object) -> list[bytes]:
    """`dumps(body)` as pieces whose concatenation is the same bytes, written without holding
    the event loop for all of it. orjson holds the GIL for a whole call (32 inputs of bge-m3's
    ColBERT vectors at 128 tokens, 44 MiB of JSON: 140 ms of one Ice Lake core, every other
    request, health check and tokenizer thread stalled for it). A body of more than
    YIELD_FLOATS numbers is written array by array, a large array in blocks of its rows
    (orjson's compact output, joined as orjson joins it), the loop given a turn after each
    block (a request beside it needs several turns). The pieces are about PIECE_BYTES each
    and are sent as they are (Content-Length their sum): joining them first copied 44 MiB in
    one go (24 ms), and a growing buffer copied itself as it grew. A smaller body is one
    piece, one call. bench/server/json_stall.py measures both."""
    if orjson is None or _numbers(body) <= YIELD_FLOATS:
        return [dumps(body)]
    import asyncio

    pieces: list[bytes] = []
    piece = bytearray()

    def add(data: bytes) -> None:
        nonlocal piece
        piece += data
        if len(piece) >= PIECE_BYTES:
            pieces.append(bytes(piece))
            piece = bytearray()

    async def write(value: object) -> None:
        if isinstance(value, dict):
            add(b"{")
            for index, (key, item) in enumerate(value.items()):
                add((b"," if index else b"") + orjson.dumps(key) + b":")
                await write(item)
            add(b"}")
        elif isinstance(value, list | tuple):
            add(b"[")
            for index, item in enumerate(value):
                if index:
                    add(b",")
                await write(item)
            add(b"]")
        elif isinstance(value, np.ndarray) and value.ndim > 1 and value.size > YIELD_EVERY:
            # Blocks of rows: orjson's "[[..],[..]]" of each, its outer brackets dropped.
            rows = max(1, YIELD_EVERY // (value.size // len(value)))
            add(b"[")
            for start in range(0, len(value), rows):
                add((b"," if start else b"") + dumps(value[start : start + rows])[1:-1])
                await asyncio.sleep(0)
            add(b"]")
        else:
            add(dumps(value))
            if isinstance(value, np.ndarray) and value.size > 1024:
                await asyncio.sleep(0)

    await write(body)
    if piece:
        pieces.append(bytes(piece))
    return pieces


def _numbers(value: object) -> int:
    """How many numbers the arrays in `value` (dicts and lists of them) hold."""
    if isinstance(value, np.ndarray):
        return value.size
    if isinstance(value, dict):
        return sum(_numbers(item) for item in value.values())
    if isinstance(value, list | tuple):
        if value and not isinstance(value[0], np.ndarray | dict | list | tuple):
            return 0  # a list of plain values: not worth walking
        return sum(_numbers(item) for item in value)
    return 0
