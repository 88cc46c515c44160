"""The test plugin's slots (pytest_plugin.py): a session takes the lowest free slot and removes the
containerd roots of the free slots above the next one, so roots of slots used only while sessions
overlapped do not pile up on the disk; the next slot (a session's second cluster) and a slot
another session holds keep theirs."""

from __future__ import annotations

import fcntl
import subprocess
import sys
import textwrap

import pytest

from warmgate_devcluster import pytest_plugin
from warmgate_devcluster.pytest_plugin import reserve_slot


def test_a_session_removes_the_roots_of_free_slots_above_the_next(tmp_path, monkeypatch):
    monkeypatch.setenv("WARMGATE_CACHE", str(tmp_path))  # the roots live under the cache folder
    roots = {index: pytest_plugin._slot_root(index) for index in pytest_plugin.SLOTS}
    for root in roots.values():
        (root / "io.containerd.content.v1.content").mkdir(parents=True)
    # Another session, a real process, holds the highest slot for as long as this test runs.
    highest = max(pytest_plugin.SLOTS)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
                import fcntl, sys
                handle = open({str(pytest_plugin._LOCK_DIR / f"slot-{highest}.lock")!r}, "w")
                fcntl.flock(handle, fcntl.LOCK_EX)
                print("held", flush=True)
                sys.stdin.read()
            """),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pytest_plugin._LOCK_DIR.mkdir(parents=True, exist_ok=True)
        assert holder.stdout.readline().strip() == "held"
        slot = reserve_slot()
        try:
            kept = {index for index, root in roots.items() if root.exists()}
            below = {index for index in pytest_plugin.SLOTS if index <= slot.index + 1}
            assert kept == below | {highest}
            assert len(kept) < len(roots)  # something was removed
            # The slot taken is locked: a second session cannot take it.
            lock = pytest_plugin._LOCK_DIR / f"slot-{slot.index}.lock"
            with open(lock, "w") as handle, pytest.raises(BlockingIOError):
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            slot.release()
    finally:
        holder.stdin.close()
        holder.wait(timeout=10)
