"""--warm-state: what a restarted server reuses (warm_state.py), on the real MiniLM through
real server processes, and the folder's rules on files made here."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import pytest

from warmgate_server.source import weights_digest
from warmgate_server.warm_state import WarmState
from warmgate_testkit.process import ServerProcess


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_file_s_hash_is_kept_by_its_identity_and_read_again_once_it_changes(
    tmp_path: Path,
) -> None:
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"a" * 4096)
    reads: list[Path] = []

    def counted(path: Path) -> str:
        reads.append(path)
        return _sha256(path)

    first = WarmState(tmp_path / "state").file_sha256(weights, counted)
    again = WarmState(tmp_path / "state")  # a restart: a new process reads the folder
    assert again.file_sha256(weights, counted) == first and len(reads) == 1
    assert again.hits["sha256"] == 1

    # Rewritten in place with the same size and its old modification time put back (as
    # `rsync -t` or `cp -p` would): the change time still moves, so it is read again.
    before = weights.stat()
    weights.write_bytes(b"b" * 4096)
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    changed = WarmState(tmp_path / "state").file_sha256(weights, counted)
    assert changed == _sha256(weights) != first and len(reads) == 2


def test_a_measurement_is_kept_for_the_same_question_only(tmp_path: Path) -> None:
    runs: list[int] = []

    def measure() -> dict:
        runs.append(1)
        return {"onednn": {"16": 1.5}}

    what = {"measure": "linear", "threads": 2, "matrices": [[1152, 384]]}
    assert WarmState(tmp_path).measured(what, measure) == ({"onednn": {"16": 1.5}}, False)
    assert WarmState(tmp_path).measured(what, measure) == ({"onednn": {"16": 1.5}}, True)
    other = {**what, "threads": 1}
    assert WarmState(tmp_path).measured(other, measure)[1] is False
    assert len(runs) == 2


def test_a_folder_that_cannot_be_used_costs_only_the_time_it_would_save(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocked = tmp_path / "state"
    blocked.write_text("a file where the folder should be")
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"w" * 100)
    state = WarmState(blocked)
    with caplog.at_level(logging.WARNING, logger="warmgate_server.warm_state"):
        assert state.file_sha256(weights, _sha256) == _sha256(weights)
        assert state.measured({"q": 1}, lambda: {"a": 1}) == ({"a": 1}, False)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and str(blocked) in warnings[0], warnings

    # A damaged file is read as empty, then written whole again.
    good = tmp_path / "good"
    good.mkdir()
    (good / "sha256.json").write_text('{"version": 1, "entries": {')
    assert WarmState(good).file_sha256(weights, _sha256) == _sha256(weights)
    assert json.loads((good / "sha256.json").read_text())["version"] == 1


def test_a_restarted_server_reuses_the_digest_and_the_linear_kernels_it_measured(
    minilm_dir: Path, tmp_path: Path
) -> None:
    state = tmp_path / "warm-state"
    args = [
        "--model", str(minilm_dir), "--warm-state", str(state), "--linear", "auto",
        "--sequence-buckets", "16", "--warmup-batch-sizes", "1",
    ]  # fmt: skip
    reports = []
    for _start in range(2):
        with ServerProcess(args) as server:
            report = server.wait_ready(300)
            reports.append((report, server.log()))
    (first, first_log), (second, second_log) = reports
    digest = weights_digest(minilm_dir)
    assert first["model"]["weights_digest"] == second["model"]["weights_digest"] == digest
    assert "reused 0 file digests and 0 kernel measurements" in first_log
    assert "reused 1 file digests and 1 kernel measurements" in second_log
    first_linear, second_linear = (r["forward"]["linear"] for r in (first, second))
    assert "earlier start" not in first_linear["chosen_by"]
    assert "earlier start" in second_linear["chosen_by"]
    # The same timings, so the same kernels: what the first start measured, not a new guess.
    assert second_linear["measured_ms"] == first_linear["measured_ms"]
    assert second_linear["kernels"] == first_linear["kernels"]
    assert {p.name for p in state.iterdir()} == {"sha256.json", "linear.json"}
