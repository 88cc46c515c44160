import os
import time
from collections.abc import Callable

import pytest
import pytest_timeout

pytest_plugins = ["warmgate_devcluster.pytest_plugin"]

# Models load from local folders only; nothing may reach a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_configure(config):
    # A SIGTERM (a CI timeout, `kill`) would end pytest without tearing fixtures down, leaving the
    # devcluster and pod processes running; turn it into an interrupt, which pytest tears down.
    import signal

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


# The run's own deadline (epoch seconds; .ci/run sets it from its time limit). A run that would
# pass its limit stops in time to print why: no test runs past the deadline less the reserve
# (each test's timeout is cut to what is left), and none starts after it. Without one, a stuck
# cluster turns every later test into a full timeout and the limit kills the run before pytest
# has printed a single failure.
DEADLINE_ENV = "WARMGATE_TEST_DEADLINE"
# What the run needs after its last test: session fixtures' teardown (the devcluster's `down`)
# and the failure report.
TEARDOWN_RESERVE_S = 120


def deadline() -> float | None:
    value = os.environ.get(DEADLINE_ENV)
    return float(value) if value else None


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item, settings):
    """pytest-timeout's timer, cut to what is left before the run's deadline."""
    end = deadline()
    if end is None:
        return None
    left = max(end - TEARDOWN_RESERVE_S - time.time(), 1.0)
    if settings.timeout and settings.timeout <= left:
        return None
    return pytest_timeout.pytest_timeout_set_timer(item, settings._replace(timeout=left))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    end = deadline()
    if end is not None and time.time() > end - TEARDOWN_RESERVE_S:
        item.session.shouldfail = (
            f"the run's deadline ({DEADLINE_ENV}) has passed: the tests after this one did not run"
        )
        pytest.fail(item.session.shouldfail, pytrace=False)


def pytest_runtest_logreport(report):
    """A failure is printed when it happens, not only in the summary at the end: a run cut
    short by its time limit still says what failed and why."""
    if not report.failed:
        return
    crash = getattr(report.longrepr, "reprcrash", None)
    reason = crash.message if crash is not None else str(report.longrepr)
    lines = reason.strip().splitlines() or [""]
    text = "\n    ".join(line[:300] for line in lines[:12])
    reporter = _reporter.get("terminal")
    if reporter is not None:
        reporter.write_line("")
        reporter.write_line(f"FAILED {report.nodeid} ({report.when}): {text}", red=True)


_reporter: dict = {}


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session):
    _reporter["terminal"] = session.config.pluginmanager.get_plugin("terminalreporter")


_REPORTS = pytest.StashKey[list[tuple[str, str]]]()


@pytest.fixture
def report(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """`report(line)`: a line of what a test measured (a timeline, a duration) for the run's
    output. pytest captures print(), so a printed line shows only when its test fails; these
    are also listed in the terminal summary under the test's id, so `make test` shows them.
    Each is printed as well, so a failing test's captured output still holds them."""
    lines = request.config.stash.setdefault(_REPORTS, [])

    def add(line: str) -> None:
        print(line)
        lines.append((request.node.nodeid, line))

    return add


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    lines = config.stash.get(_REPORTS, [])
    if not lines:
        return
    terminalreporter.section("what the tests measured")
    current = None
    for nodeid, line in lines:
        if nodeid != current:
            terminalreporter.write_line(nodeid)
            current = nodeid
        terminalreporter.write_line(f"  {line}")
