"""The run's deadline (tests/conftest.py, WARMGATE_TEST_DEADLINE, set by .ci/run): a run about to
pass its time limit stops in time to say what failed. A test still running at the deadline less
the teardown reserve is cut by its timeout, no test starts after it, and each failure is printed
when it happens, not only in the summary. A real pytest run of the project's conftest on three
tests, in a folder of its own."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import conftest

TESTS = """
import time

def test_passes():
    assert True

def test_fails_at_once():
    assert 1 == 2, "a failure printed when it happens"

def test_outlives_the_deadline():
    time.sleep(120)

def test_after_the_deadline():
    assert True
"""


def test_a_run_stops_at_its_deadline_and_says_what_failed_on_the_way(tmp_path):
    shutil.copy(Path(conftest.__file__), tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\ntimeout = 600\n")
    (tmp_path / "test_some.py").write_text(TESTS)
    # The deadline lands 10 s into the run, after the reserve for teardown is taken off.
    deadline = time.time() + conftest.TEARDOWN_RESERVE_S + 10
    began = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        env={**os.environ, conftest.DEADLINE_ENV: str(deadline)},
        capture_output=True,
        text=True,
        timeout=110,
    )
    took = time.monotonic() - began
    out = result.stdout
    assert result.returncode == 1, out
    # The sleeper was cut at the deadline, well before its own 120 s or the ini's 600.
    assert took < 60, out
    assert "FAILED test_some.py::test_outlives_the_deadline - Failed: Timeout" in out, out
    # A failure is printed when it happens, before the summary at the end.
    summary = out.index("= FAILURES =")
    printed = out.index("FAILED test_some.py::test_fails_at_once (call): AssertionError")
    assert printed < summary, out
    # Nothing ran after the deadline: the next test fails with the reason, the run stops.
    assert "ERROR test_some.py::test_after_the_deadline - Failed: the run's deadline" in out, out
    assert "2 failed, 1 passed, 1 error" in out, out
