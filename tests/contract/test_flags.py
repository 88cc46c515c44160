"""The server's flag table: what the operator writes into a pod (`render_args`) is what the warm
gate reads back from it (`read_args`), as the server itself would read it."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from warmgate_contract.flags import (
    BY_DEST,
    BY_NAME,
    DEFAULTS,
    FLAGS,
    Flag,
    parse_bool,
    parse_int_list,
    read_args,
    render_args,
    settings,
)


def values_for(flag: Flag) -> st.SearchStrategy[Any]:
    """Values of the flag's own type, as a configuration holds them."""
    if flag.is_bool:
        return st.booleans()
    if flag.parse is parse_int_list:
        return st.lists(st.integers(-(10**9), 10**9), min_size=1, max_size=8).map(tuple)
    if flag.parse is int:
        return st.integers(-(10**12), 10**12)
    if flag.parse is float:
        return st.floats(allow_nan=False, allow_infinity=False)
    # Any text an argument can carry: `=` and `,` included, not NUL (no process argument can).
    return st.text(st.characters(exclude_characters="\x00"), max_size=40)


configurations = st.fixed_dictionaries({}, optional={flag.dest: values_for(flag) for flag in FLAGS})


@given(values=configurations)
def test_what_the_operator_renders_reads_back_as_the_same_values(values: dict[str, Any]) -> None:
    assert read_args(render_args(values)) == values


@given(values=configurations)
def test_the_environment_twins_carry_the_same_values(values: dict[str, Any]) -> None:
    environ = {}
    for dest, value in values.items():
        flag = BY_DEST[dest]
        environ[flag.env] = (
            str(value).lower() if flag.is_bool else flag.render(value).split("=", 1)[1]
        )
    assert read_args([], environ) == values


def test_rendered_in_the_tables_order_leaving_out_what_is_unset() -> None:
    args = render_args(
        {"warmup": False, "model": "org/m", "sequence_buckets": (16, 32), "normalize": None}
    )
    assert args == ["--model=org/m", "--sequence-buckets=16,32", "--no-warmup"]
    assert render_args({"max_wait_ms": 2.0, "drain_seconds": 2.5}) == [
        "--max-wait-ms=2",
        "--drain-seconds=2.5",
    ]
    with pytest.raises(KeyError, match="max_tokens"):
        render_args({"max_tokens": 1})


@given(values=configurations)
def test_a_value_left_out_at_its_default_is_read_as_that_default(values: dict[str, Any]) -> None:
    """Left out or written, the server reads the same settings."""
    args = render_args(values, leave_out_defaults=BY_DEST)
    assert settings(read_args(args)) == settings(values)


def test_only_the_flags_named_are_left_out_and_only_at_their_default() -> None:
    values = {"max_batch_size": 32, "packing": "auto", "backend": "onnxruntime", "warmup": True}
    assert render_args(values, leave_out_defaults=("packing", "backend", "warmup")) == [
        "--max-batch-size=32",
        "--backend=onnxruntime",
    ]
    # What the server reads, not how it is spelled: 2 is the 2.0 of --max-wait-ms.
    assert render_args({"max_wait_ms": 2}, leave_out_defaults=("max_wait_ms",)) == []
    for flag in FLAGS:
        if flag.default is not None:
            assert render_args({flag.dest: flag.default}, leave_out_defaults=[flag.dest]) == []
    with pytest.raises(KeyError, match="max_tokens"):
        render_args({}, leave_out_defaults=("max_tokens",))


def test_a_flag_wins_over_its_twin_and_each_spelling_is_read() -> None:
    environ = {"WARMGATE_MAX_BATCH_SIZE": "8", "WARMGATE_PAD_BATCH": "no", "OTHER": "x"}
    assert read_args([], environ) == {"max_batch_size": 8, "pad_batch": False}
    read = read_args(["--max-batch-size", "16", "--pad-batch", "positional"], environ)
    assert read == {"max_batch_size": 16, "pad_batch": True}
    assert read_args(["--max-batch-size=4", "--max-batch-size=5"]) == {"max_batch_size": 5}
    assert read_args(["--normalize=off"]) == {"normalize": False}


@pytest.mark.parametrize(
    ("args", "environ", "error", "words"),
    [
        (["--max-batch-size=many"], {}, ValueError, "--max-batch-size='many' is not valid"),
        ([], {"WARMGATE_WARMUP": "maybe"}, ValueError, "WARMGATE_WARMUP='maybe'"),
        (["--sequence-buckets=,"], {}, ValueError, "comma-separated list"),
        (["--max-batch-size"], {}, ValueError, "--max-batch-size needs a value"),
        (["--max-tokens=8"], {}, KeyError, "--max-tokens is not a server flag"),
    ],
)
def test_what_the_server_would_refuse_is_refused_naming_it(
    args: list[str], environ: dict[str, str], error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words):
        read_args(args, environ)


def test_booleans_and_lists_take_the_usual_spellings() -> None:
    for text in ("1", "true", "Yes", " ON "):
        assert parse_bool(text) is True
    for text in ("0", "false", "No", "off"):
        assert parse_bool(text) is False
    with pytest.raises(ValueError, match="true/false"):
        parse_bool("y")
    assert parse_int_list(" 16, 32,,64 ") == (16, 32, 64)
    with pytest.raises(ValueError):
        parse_int_list("16,x")


def test_every_flag_has_one_name_one_twin_and_a_default_of_its_type() -> None:
    assert len(BY_NAME) == len(BY_DEST) == len({flag.env for flag in FLAGS}) == len(FLAGS)
    for flag in FLAGS:
        assert flag.name.startswith("--") and not flag.name.startswith("--no-"), flag.name
        assert flag.env == "WARMGATE_" + flag.name[2:].replace("-", "_").upper()
        assert flag.help
        if flag.default is not None:
            # The default survives its own text, so a rendered default means the default.
            assert read_args(render_args({flag.dest: flag.default})) == {flag.dest: flag.default}
    assert settings({"max_batch_size": 4}) == {**DEFAULTS, "max_batch_size": 4}


def test_only_a_boolean_flag_can_be_negated() -> None:
    """As the server's argparse: --no-FLAG exists for booleans only, so the gate never reads a
    pod's flags in a way the server would refuse to start with."""
    with pytest.raises(KeyError, match="--no-model"):
        read_args(["--no-model", "org/m"])
