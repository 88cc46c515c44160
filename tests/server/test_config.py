"""The config object: flags, environment twins, and bad combinations refused with advice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from warmgate_contract.flags import BY_NAME
from warmgate_contract.shapes import Shape
from warmgate_server.config import ConfigError, parse_config
from warmgate_testkit.process import CONTRACT_ROOT, SERVER_ROOT


def test_defaults_follow_the_contract() -> None:
    config = parse_config(["--model", "some/model"], environ={})
    assert config.sequence_buckets == (32, 64, 128, 256)
    assert config.warmup_batch_sizes == (1, 8, 32)
    assert config.max_batch_tokens == 16384
    assert config.normalize is None and config.pooling is None  # the model folder decides
    assert config.pad_batch and config.warmup
    assert config.effective_served_name == "model"


def test_environment_twins_and_flag_precedence() -> None:
    environ = {
        "WARMGATE_MODEL": "env/model",
        "WARMGATE_MAX_BATCH_TOKENS": "4096",
        "WARMGATE_NORMALIZE": "false",
        "WARMGATE_SEQUENCE_BUCKETS": "16, 32,64",
        "WARMGATE_PAD_BATCH": "0",
    }
    config = parse_config(["--max-batch-tokens", "8192"], environ=environ)
    assert config.model == "env/model"
    assert config.max_batch_tokens == 8192  # the flag wins over its twin
    assert config.normalize is False and config.pad_batch is False
    assert config.sequence_buckets == (16, 32, 64)
    assert parse_config(["--model", "m", "--normalize"], environ=environ).normalize is True


def test_env_names_are_upper_snake_case() -> None:
    assert BY_NAME["--max-batch-tokens"].env == "WARMGATE_MAX_BATCH_TOKENS"
    assert BY_NAME["--pad-batch"].env == "WARMGATE_PAD_BATCH"


@pytest.mark.parametrize(
    ("args", "advice"),
    [
        ([], "pass --model"),
        (["--sequence-buckets", "64,32"], "strictly ascending"),
        (["--warmup-batch-sizes", "1,64"], "raise --max-batch-size"),
        (["--max-batch-tokens", "128"], "raise --max-batch-tokens"),
        (["--max-input-length", "512"], "add a bucket >= 512"),
        (["--warmup-batch-sizes", "8", "--max-batch-tokens", "1024"], "add a smaller warmup"),
        (["--dtype", "float64"], "use one of auto"),
        (["--device", "tpu"], "use one of auto, cpu"),
        (["--pooling", "median"], "mean, cls"),
        (["--max-batch-size", "many"], "is not valid"),
        (["--packing", "always"], "use one of auto, on, off"),
        (["--backend", "tvm"], "use one of torch, onnxruntime"),
        (["--backend", "onnxruntime", "--device", "cuda"], "runs on the CPU: use --device cpu"),
        (["--backend", "onnxruntime", "--dtype", "bfloat16"], "use --dtype float32"),
        (["--backend", "onnxruntime", "--packing", "on"], "use --packing auto or off"),
        (["--compile-cache", "/tmp/c"], "with --backend torch there is nothing to keep"),
        (["--model-workers", "0"], "--model-workers must be at least 1"),
    ],
)
def test_bad_combinations_say_what_to_change(args: list[str], advice: str) -> None:
    model = [] if not args else ["--model", "m"]
    with pytest.raises(ConfigError, match=advice):
        parse_config([*model, *args], environ={})


def test_bad_environment_value_names_the_variable() -> None:
    with pytest.raises(ConfigError, match=r"WARMGATE_WARMUP=.*maybe"):
        parse_config(["--model", "m"], environ={"WARMGATE_WARMUP": "maybe"})


def test_profile_file_missing_empty_or_valid(tmp_path: Path) -> None:
    assert (
        parse_config(
            ["--model", "m", "--warmup-profile", str(tmp_path / "none.json")], environ={}
        ).profile_shapes
        == ()
    )
    empty = tmp_path / "empty.json"
    empty.write_text("")
    assert (
        parse_config(["--model", "m", "--warmup-profile", str(empty)], environ={}).profile_shapes
        == ()
    )
    profile = tmp_path / "profile.json"
    profile.write_text(
        json.dumps(
            {
                "shapes": [
                    {"batch_size": 2, "seq_len": 64, "count": 3},
                    {"batch_size": 5, "seq_len": 32, "count": 40},
                ]
            }
        )
    )
    config = parse_config(["--model", "m", "--warmup-profile", str(profile)], environ={})
    assert config.profile_shapes == (Shape(5, 32), Shape(2, 64))  # most frequent first


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        '{"shapes": {"batch_size": 1}}',
        '{"shapes": [{"batch_size": 0, "seq_len": 32}]}',
    ],
)
def test_invalid_profile_is_a_clear_error(tmp_path: Path, text: str) -> None:
    profile = tmp_path / "profile.json"
    profile.write_text(text)
    with pytest.raises(ConfigError, match="--warmup-profile"):
        parse_config(["--model", "m", "--warmup-profile", str(profile)], environ={})


def test_bad_config_exits_2_with_the_message() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "warmgate_server", "--model", "m", "--sequence-buckets", "64,32"],
        env={
            "PYTHONPATH": os.pathsep.join((str(SERVER_ROOT), str(CONTRACT_ROOT))),
            "PATH": "/usr/bin:/bin",
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "strictly ascending" in result.stderr


def test_every_variable_the_server_reads_is_in_the_configuration() -> None:
    """The contract's flag table and its ENVIRONMENT rows are all the server reads: its own
    settings are flags with twins, and the variables named by others (the downward API's
    POD_NAME, the older WARMGATE_ONEDNN) fill the configuration too, never a module's own
    os.environ."""
    given = parse_config(
        ["--model", "m"],
        environ={
            "POD_NAME": "embed-7f9c-x2",
            "WARMGATE_LOG_LEVEL": "debug",
            "WARMGATE_TERMINATION_LOG": "/tmp/reason",
            "WARMGATE_RUNTIME_MEMORY": "/tmp/runtime.json",
            "WARMGATE_FAULT_INJECTION": "1",
            "WARMGATE_ONEDNN": "0",
        },
    )
    assert given.pod_name == "embed-7f9c-x2"
    assert (given.log_level, given.termination_log) == ("debug", "/tmp/reason")
    assert given.runtime_memory == "/tmp/runtime.json" and given.fault_injection
    assert given.linear == "mkl"  # the older spelling of --linear mkl
    # The newer spelling wins over the older, and a flag over both.
    both = {"WARMGATE_ONEDNN": "0", "WARMGATE_LINEAR": "onednn"}
    assert parse_config(["--model", "m"], environ=both).linear == "onednn"
    assert parse_config(["--model", "m", "--linear", "aten"], environ=both).linear == "aten"
    assert parse_config(["--model", "m"], environ={"WARMGATE_ONEDNN": "1"}).linear == "auto"
    unset = parse_config(["--model", "m"], environ={})
    assert (unset.pod_name, unset.linear, unset.log_level) == (None, "auto", "INFO")
    assert not unset.fault_injection
    for args, problem in (
        (["--linear", "fast"], "--linear 'fast': use one of auto, onednn, mkl, aten"),
        (["--log-level", "loud"], "--log-level 'loud': use one of DEBUG, INFO, WARNING, ERROR"),
    ):
        with pytest.raises(ConfigError, match=problem):
            parse_config(["--model", "m", *args], environ={})


def test_no_module_reads_a_variable_the_contract_does_not_name() -> None:
    """Every os.environ / os.getenv read in the server's code names a flag's twin or one of
    the contract's ENVIRONMENT rows (docs/server.md lists both)."""
    import ast

    from warmgate_contract.flags import ENVIRONMENT, FLAGS

    named = {flag.env for flag in FLAGS} | {variable.name for variable in ENVIRONMENT}
    read: dict[str, str] = {}
    for path in sorted(SERVER_ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            target = None
            if isinstance(node, ast.Call) and node.args:
                function = ast.unparse(node.func)
                if function in ("os.getenv", "os.environ.get", "environ.get"):
                    target = node.args[0]
            elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ":
                target = node.slice
            if isinstance(target, ast.Constant) and isinstance(target.value, str):
                read[target.value] = path.name
    assert read, "the scan found no read at all: it no longer sees the code"
    assert {name: where for name, where in read.items() if name not in named} == {}
