"""The input limit an engine serves with, and where it came from (/ready's model_settings)."""

from __future__ import annotations

import pytest

from warmgate_server.config import parse_config
from warmgate_server.errors import ModelLoadError
from warmgate_server.serving import input_limit

BUCKETS = ["--sequence-buckets", "32,64,128"]


def config(*args: str):
    return parse_config(["--model", "m", *BUCKETS, *args], environ={})


def test_the_flag_wins_over_the_models_own_limit() -> None:
    chosen = input_limit(config("--max-input-length", "100"), 64, "max_seq_length", 512)
    assert chosen == (100, "--max-input-length")


def test_the_models_own_limit_holds_below_the_largest_bucket() -> None:
    assert input_limit(config(), 64, "sentence_bert_config.json", 512) == (
        64,
        "sentence_bert_config.json",
    )


def test_the_largest_bucket_caps_the_models_limit() -> None:
    assert input_limit(config(), 512, "tokenizer", None) == (
        128,
        "the largest of --sequence-buckets",
    )


def test_a_limit_above_the_models_positions_is_refused_saying_what_to_lower() -> None:
    """The message names what set the limit: the flag is to be lowered; a limit the folder
    states (sentence_bert_config.json's max_seq_length above the positions) or the largest
    bucket needs --max-input-length (spec.model.maxInputLength) at the positions."""
    with pytest.raises(ModelLoadError, match=r"128 \(--max-input-length\) is above this model's "
                       r"66 positions: lower --max-input-length"):  # fmt: skip
        input_limit(config("--max-input-length", "128"), 512, "tokenizer", 66)
    folder_limit = r"64 \(sentence_bert_config.json\) is above this model's 62 positions: set "
    with pytest.raises(ModelLoadError, match=folder_limit + r"--max-input-length 62 \(spec"):
        input_limit(config(), 64, "sentence_bert_config.json", 62)
    with pytest.raises(ModelLoadError, match=r"the largest of --sequence-buckets"):
        input_limit(config(), 512, "tokenizer", 66)
