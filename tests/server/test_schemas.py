"""The parsers on their own: what each route's body becomes, the plan the pipeline follows
(which inputs, which output, normalisation, dimensions, truncation, prompt, whose token ids).
The HTTP answers to bad bodies are test_requests.py's."""

from __future__ import annotations

from dataclasses import replace

import pytest

from warmgate_server.errors import Refused
from warmgate_server.schemas import (
    EmbedRequest,
    Limits,
    Output,
    Vocabulary,
    parse_openai,
    parse_similarity,
    parse_tei,
    parse_tei_tokens,
)

LIMITS = Limits(
    max_inputs=4,
    hidden_size=384,
    model_names={"all-MiniLM-L6-v2", "/models/minilm"},
    default_normalize=True,
    vocab=Vocabulary("model", 30522),
    prompts={"query": "query: "},
)
OPENAI_IDS = replace(LIMITS, openai_vocab=Vocabulary("cl100k_base", 100277))


def test_openai_bodies_ask_for_pooled_vectors_with_the_models_defaults() -> None:
    parsed = parse_openai(
        {"input": ["a", [101, 2000, 102]], "encoding_format": "base64", "dimensions": 64}, LIMITS
    )
    assert parsed == EmbedRequest(
        texts=["a", [101, 2000, 102]], normalize=True, dimensions=64, base64=True
    )
    assert parsed.output is Output.POOLED and not parsed.openai_ids


def test_openai_token_ids_are_checked_against_the_vocabulary_the_server_takes() -> None:
    """With --openai-token-ids, ids are OpenAI's: beyond the model's vocabulary but within
    cl100k_base's they pass, and the pipeline decodes them; the model's own limit holds
    otherwise, and the message says what ids the server takes."""
    beyond_the_model = {"input": [[90000, 12]]}
    parsed = parse_openai(beyond_the_model, OPENAI_IDS)
    assert parsed.openai_ids and parsed.texts == [[90000, 12]]
    with pytest.raises(Refused, match=r"outside this model's vocabulary \(0..30521\)"):
        parse_openai(beyond_the_model, LIMITS)
    with pytest.raises(Refused, match=r"outside the cl100k_base vocabulary \(0..100276\)$"):
        parse_openai({"input": [[100277]]}, OPENAI_IDS)
    # TEI's routes take the model's own ids whatever the OpenAI route takes.
    with pytest.raises(Refused, match="this model's vocabulary"):
        parse_tei({"inputs": [[90000]]}, OPENAI_IDS)


def test_tei_bodies_pick_normalisation_truncation_and_a_prompt() -> None:
    parsed = parse_tei(
        {
            "inputs": "hello",
            "normalize": False,
            "truncate": True,
            "truncation_direction": "Left",
            "prompt_name": "query",
        },
        LIMITS,
    )
    assert parsed == EmbedRequest(
        texts=["hello"], normalize=False, truncate=True, truncate_left=True, prompt="query: "
    )


def test_embed_all_asks_for_token_states_unnormalised_unless_told() -> None:
    """TEI's /embed_all defaults `normalize` to false whatever the model's default is."""
    raw = parse_tei_tokens({"inputs": ["a", "b"]}, LIMITS)
    assert raw.output is Output.TOKENS and raw.normalize is False
    assert parse_tei_tokens({"inputs": "a", "normalize": True}, LIMITS).normalize is True
    with pytest.raises(Refused, match="`normalize` must be true or false"):
        parse_tei_tokens({"inputs": "a", "normalize": "yes"}, LIMITS)


def test_similarity_embeds_the_source_first_and_takes_teis_parameters() -> None:
    parsed = parse_similarity(
        {
            "inputs": {"source_sentence": "s", "sentences": ["a", "b"]},
            "parameters": {"truncate": True, "truncation_direction": "Left"},
        },
        LIMITS,
    )
    assert parsed.output is Output.SIMILARITY
    assert (parsed.texts, parsed.truncate, parsed.truncate_left) == (["s", "a", "b"], True, True)
    # The source counts against the inputs a request may hold.
    too_many = {"inputs": {"source_sentence": "s", "sentences": ["a", "b", "c", "d"]}}
    with pytest.raises(Refused, match="maximum allowed batch size 3"):
        parse_similarity(too_many, LIMITS)
    for inputs in ("s", {"source_sentence": "", "sentences": ["a"]}):
        with pytest.raises(Refused) as refused:
            parse_similarity({"inputs": inputs}, LIMITS)
        assert refused.value.status == 422


async def test_a_large_answer_is_written_in_pieces_with_the_loop_given_turns_between() -> None:
    """bge-m3's ColBERT vectors for a batch are tens of MiB of JSON, which orjson writes in one
    call holding the GIL (about 140 ms here for 32 inputs of 128 tokens): every other request
    waited. json_pieces writes such a body in pieces whose concatenation is dumps' bytes,
    each large array in blocks of rows, and the event loop runs other tasks between the
    blocks; a small body is one piece, one call."""
    import asyncio

    import numpy as np

    from warmgate_server.schemas import YIELD_EVERY, YIELD_FLOATS, dumps, json_pieces

    rng = np.random.default_rng(0)
    colbert = [rng.standard_normal((64, 1024), dtype=np.float32) for _ in range(8)]
    body = {
        "dense_vecs": rng.standard_normal((8, 1024), dtype=np.float32),
        "lexical_weights": [{"17": 0.25, "3": np.float32(1.5)}] * 8,
        "colbert_vecs": colbert,
        "long": rng.standard_normal((3, 5 * YIELD_EVERY + 7), dtype=np.float32),
        "note": ["a", 1, None, True],
    }
    assert sum(matrix.size for matrix in colbert) > YIELD_FLOATS
    turns = 0
    done = False

    async def other_request() -> None:
        nonlocal turns
        while not done:
            turns += 1
            await asyncio.sleep(0)

    async def beside(body: object) -> tuple[list[bytes], int]:
        nonlocal turns, done
        turns, done = 0, False
        task = asyncio.create_task(other_request())
        await asyncio.sleep(0)
        before = turns
        pieces = await json_pieces(body)
        done = True
        await task
        return pieces, turns - before

    pieces, given = await beside(body)
    assert b"".join(pieces) == dumps(body)
    assert len(pieces) > 1
    blocks = sum(-(-matrix.size // YIELD_EVERY) for matrix in colbert)
    assert given >= blocks + 3  # a turn after each block of ColBERT rows, and each long row

    small = {"data": [{"embedding": rng.standard_normal(384, dtype=np.float32)}]}
    pieces, given = await beside(small)
    assert pieces == [dumps(small)] and given == 0  # one call, no turn given
