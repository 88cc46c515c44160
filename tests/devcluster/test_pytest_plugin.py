"""The test plugin's slots (pytest_plugin.py): a session takes the lowest free slot and removes the
containerd roots of the free slots above the next one, so roots of slots used only while sessions
overlapped do not pile up on the disk; the next slot (a session's second cluster) and a slot
another session holds keep theirs."""

from __future__ import annotations

import fcntl

import pytest

from warmgate_devcluster import pytest_plugin
from warmgate_devcluster.pytest_plugin import reserve_slot


def test_a_session_removes_the_roots_of_free_slots_above_the_next(tmp_path, monkeypatch):
    monkeypatch.setenv("WARMGATE_CACHE", str(tmp_path))  # the roots live under the cache folder
    # Slot locks of this test's own: the real ones are held by whichever sessions run here (this
    # one's, on any slot that was free when it began), which would change what is free.
    monkeypatch.setattr(pytest_plugin, "_LOCK_DIR", tmp_path / "locks")
    roots = {index: pytest_plugin._slot_root(index) for index in pytest_plugin.SLOTS}
    for root in roots.values():
        (root / "io.containerd.content.v1.content").mkdir(parents=True)
    # Another session holds the highest slot: a lock of its own on the slot's file (flock locks
    # belong to an open file, so this one conflicts with the plugin's as another process's would).
    highest = max(pytest_plugin.SLOTS)
    pytest_plugin._LOCK_DIR.mkdir(parents=True, exist_ok=True)
    with open(pytest_plugin._LOCK_DIR / f"slot-{highest}.lock", "w") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
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
