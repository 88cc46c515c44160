"""The input limit an engine serves with, and where it came from (/ready's model_settings)."""

from __future__ import annotations

import pytest

from warmgate_server.config import parse_config
from warmgate_server.errors import ModelLoadError
from warmgate_server.settings import input_limit

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
    with pytest.raises(ModelLoadError, match="--max-input-length 128 is above this model's 66"):
        input_limit(config(), 512, "tokenizer", 66)
