"""An input is served as the model's own tokenizer sees it, however much whitespace surrounds
it (issue 41): texts with runs of thousands of spaces, tabs, newlines, zero-width and other
Unicode spaces before or after them, far more characters than 64 per token of the limit, get
exactly the token ids of transformers' AutoTokenizer for their folder, truncated at the same
limit on the same side, or are refused only when those ids are over the limit. Once, a text was
cut or refused on its characters before the tokenizer: 10,000 spaces and a sentence were served
as the empty text, or refused though they were a few tokens."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from warmgate_server.config import parse_config
from warmgate_server.errors import InputTooLong
from warmgate_server.loading import load_model
from warmgate_server.runner import ModelRunner
from warmgate_testkit import zoo

LIMIT = 32
RUN = 5_000
"""Characters in a run: over 64 per token of LIMIT, the character cap the server once had."""
WHITESPACE = {
    "space": " ",
    "tab": "\t",
    "newline": "\n",
    "crlf": "\r\n",
    "zero-width space": "\u200b",
    "no-break space": "\u00a0",
    "ideographic space": "\u3000",
    "em space": "\u2003",
    "mixed": " \t\n\u200b\u00a0\u3000\u2003",
}
SENTENCES = {"short": zoo.TEXTS[1], "long": zoo.TEXTS[-1]}  # under and over LIMIT tokens


def _texts() -> dict[str, str]:
    texts = {}
    for space_name, space in WHITESPACE.items():
        run = (space * RUN)[:RUN]
        for sentence_name, sentence in SENTENCES.items():
            texts[f"{space_name} before {sentence_name}"] = run + sentence
            texts[f"{space_name} after {sentence_name}"] = sentence + run
            texts[f"{space_name} around {sentence_name}"] = run + sentence + run
    return texts


TEXTS = _texts()


def _one_family_per_tokenizer() -> list[str]:
    """The first zoo family of each tokenizer the zoo builds: WordPiece (BERT, DistilBERT,
    KLUE's RoBERTa, MPNet), SentencePiece (XLM-R's Unigram, CamemBERT's, Gemma's BPE) and
    byte-level BPE (RoBERTa, ModernBERT, Qwen3)."""
    seen, names = set(), []
    for name, family in zoo.FAMILIES.items():
        if family.tokenizer not in seen:
            seen.add(family.tokenizer)
            names.append(name)
    return names


@pytest.fixture(scope="module")
def zoo_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("zoo")


HUB_XLMR = "xlm-roberta-sentencepiece"
"""The zoo's XLM-R model with a tokenizer as the hub's carry it (zoo.write_hub_xlmr_tokenizer:
SentencePiece's NFKC character map, which makes other Unicode spaces spaces, and a collapse of
repeated spaces)."""


@pytest.mark.parametrize("name", ["all-MiniLM-L6-v2", HUB_XLMR, *_one_family_per_tokenizer()])
def test_whitespace_runs_are_served_as_the_models_tokenizer_sees_them(
    request, zoo_root: Path, name: str
) -> None:
    """For each text, truncating right, left, or not at all: the ids served are
    AutoTokenizer's for the whole text with its truncation at LIMIT on that side; without
    truncation, a text is refused exactly when those ids are more than LIMIT, and on their
    count."""
    from transformers import AutoTokenizer

    if name == "all-MiniLM-L6-v2":
        folder = request.getfixturevalue("minilm_dir")
        loaded = request.getfixturevalue("loaded_minilm")
    else:
        if name == HUB_XLMR:
            folder = zoo_root / name
            if not folder.is_dir():
                shutil.copytree(zoo.build("xlm-roberta-mean", "current", zoo_root), folder)
                zoo.write_hub_xlmr_tokenizer(folder)
        else:
            folder = zoo.build(name, "current", zoo_root)
        loaded = load_model(parse_config(["--model", str(folder), "--device", "cpu"], environ={}))
    runner = ModelRunner(loaded, "mean", LIMIT)
    reference = AutoTokenizer.from_pretrained(str(folder))
    texts = list(TEXTS.values())
    whole = reference(texts, verbose=False)["input_ids"]
    assert max(len(ids) for ids in whole) > LIMIT  # truncating cuts

    wrong = []
    for side in ("right", "left"):
        reference.truncation_side = side
        expected = reference(texts, truncation=True, max_length=LIMIT)["input_ids"]
        served = runner.tokenize(texts, truncate=True, truncate_left=side == "left")
        wrong += [
            f"truncating {side}, {label}: served {got}, expected {want}"
            for label, got, want in zip(TEXTS, served, expected, strict=True)
            if list(got) != want
        ]
    for (label, text), want in zip(TEXTS.items(), whole, strict=True):
        try:
            got = list(runner.tokenize([text])[0])
        except InputTooLong as refused:
            if len(want) <= LIMIT or refused.length != len(want):
                wrong.append(f"{label}: refused ({refused}), expected {len(want)} tokens")
            continue
        if got != want:
            wrong.append(f"not truncating, {label}: served {got}, expected {want}")
    assert not wrong, "\n".join(wrong[:10]) + f"\n({len(wrong)} in all)"


SENTENCE = "A man is eating food in the park on a sunny afternoon."


async def test_minilm_serves_a_sentence_behind_10000_spaces_as_sentence_transformers_does(
    start_server, sentence_transformer
) -> None:
    """all-MiniLM-L6-v2 over HTTP, at a limit of 64 tokens (4,096 characters at 64 per token,
    the old cap): a sentence after or before 10,000 spaces, newlines or ideographic spaces gets
    sentence-transformers' vector of the same text (the spaces are no token to its WordPiece),
    truncating right, left, or not at all, on both APIs: never the empty text's vector and
    never a refusal."""
    texts = [
        " " * 10_000 + SENTENCE,
        SENTENCE + " " * 10_000,
        "\n" * 10_000 + SENTENCE + "\u3000" * 10_000,
    ]
    expected = sentence_transformer.encode(texts, convert_to_numpy=True)
    empty = sentence_transformer.encode([""], convert_to_numpy=True)
    client = await start_server()
    info = await (await client.get("/info")).json()
    assert info["max_input_length"] == 64

    served = {}
    for direction in ("Right", "Left"):
        body = {"inputs": texts, "truncate": True, "truncation_direction": direction}
        response = await client.post("/embed", json=body)
        assert response.status == 200, await response.text()
        served[f"/embed truncating {direction}"] = np.array(await response.json())
    response = await client.post("/embed", json={"inputs": texts, "truncate": False})
    assert response.status == 200, await response.text()
    served["/embed not truncating"] = np.array(await response.json())
    response = await client.post("/v1/embeddings", json={"input": texts})
    assert response.status == 200, await response.text()
    served["/v1/embeddings"] = np.array(
        [item["embedding"] for item in (await response.json())["data"]]
    )

    for route, vectors in served.items():
        unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
        want = expected / np.linalg.norm(expected, axis=1, keepdims=True)
        cosines = (unit * want).sum(axis=1)
        assert cosines.min() > 0.9999, (route, cosines)
        assert (unit @ (empty[0] / np.linalg.norm(empty[0]))).max() < 0.9, route
