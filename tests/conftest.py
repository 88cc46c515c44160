import os
from collections.abc import Callable

import pytest

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
