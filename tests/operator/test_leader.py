"""Leader election on a real kube-apiserver: the Lease rules (one holder, takeover only after
the holder stops renewing, a holder that stopped renewing stops writing first), then two
operator processes where the leader is killed, and one that is paused."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from support.cluster import (
    OperatorProcess,
    apply,
    example,
    get_json,
    install_crd,
    operator_metrics,
)

from warmgate_devcluster import procs
from warmgate_devcluster.testkit import wait_until
from warmgate_kube.client import KubeClient
from warmgate_operator.leader import LeaderElector

pytestmark = pytest.mark.cluster

LEASE_SECONDS = 4.0


@pytest.fixture(scope="module")
def crd(devcluster: Any) -> None:
    install_crd(devcluster)


@pytest.fixture
def client(devcluster: Any):
    kube = KubeClient(devcluster.api_client(), "warmgate-test")
    yield kube
    kube.close()


def elector(client: KubeClient, namespace: str, identity: str) -> LeaderElector:
    return LeaderElector(
        client.call_sync,
        namespace,
        "leader-test",
        identity,
        lease_seconds=LEASE_SECONDS,
        renew_deadline_seconds=2.5,
        retry_seconds=0.5,
    )


def test_one_holder_and_a_takeover_only_after_the_holder_stops_renewing(
    devcluster: Any, client: KubeClient, namespace: str
) -> None:
    lost: list[str] = []
    first, second = elector(client, namespace, "first"), elector(client, namespace, "second")
    assert first.acquire()
    first.keep_renewing(lambda: lost.append("first"))
    # While the first renews, the second never gets it, however often it tries.
    deadline = time.monotonic() + 2 * LEASE_SECONDS
    while time.monotonic() < deadline:
        assert not second.try_acquire_or_renew()
        assert second.holder() == "first" and first.may_write()
        time.sleep(0.25)

    # The first stops renewing without a word (as a killed process does).
    first._stop.set()
    last_renewal = time.monotonic()
    takeover: list[float] = []
    fence_closed: list[float] = []

    def watch_fence() -> None:
        while first.may_write():
            time.sleep(0.01)
        fence_closed.append(time.monotonic())

    watcher = threading.Thread(target=watch_fence)
    watcher.start()
    assert second.acquire()
    takeover.append(time.monotonic())
    watcher.join(10)
    # The old holder's fence closed before the new holder could write: never two writers.
    assert fence_closed and fence_closed[0] < takeover[0]
    assert LEASE_SECONDS - 1 <= takeover[0] - last_renewal <= LEASE_SECONDS + 2
    lease = get_json(devcluster, "lease", "leader-test", "-n", namespace)
    assert lease["spec"]["holderIdentity"] == "second"
    assert lease["spec"]["leaseTransitions"] == 1
    assert not lost

    # A clean stop hands it over at once.
    third = elector(client, namespace, "third")
    second.release()
    started = time.monotonic()
    assert third.acquire()
    assert time.monotonic() - started < 2.0
    third.release()


def test_candidates_racing_for_a_free_lease_get_one_leader(
    client: KubeClient, namespace: str
) -> None:
    candidates = [elector(client, namespace, f"racer-{index}") for index in range(4)]
    won: list[str] = []
    barrier = threading.Barrier(len(candidates))

    def race(candidate: LeaderElector) -> None:
        barrier.wait()
        if candidate.try_acquire_or_renew():
            won.append(candidate.identity)

    threads = [threading.Thread(target=race, args=(c,)) for c in candidates]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(won) == 1, won
    assert sum(c.may_write() for c in candidates) == 1


# ---------------------------------------------------------------- two operator processes
def leader_metric(port: int) -> float | None:
    metrics = operator_metrics(port)
    return None if metrics is None else metrics.get(("warmgate_operator_leader", ()))


def replica(devcluster: Any, namespace: str, tmp_path: Path, name: str) -> tuple[Any, int]:
    (port,) = procs.free_ports(1)
    process = OperatorProcess(
        devcluster, tmp_path / f"{name}.log", "--namespace", namespace,
        "--resync-seconds", "2", "--leader-elect", "--lease-namespace", namespace,
        "--lease-seconds", str(LEASE_SECONDS), "--http-address", f"127.0.0.1:{port}",
    )  # fmt: skip
    process.env["POD_NAME"] = name
    return process.start(), port


@pytest.fixture
def pair(devcluster: Any, crd: None, namespace: str, tmp_path: Path):
    """operator-a leading, then operator-b standing by: ((process, port), (process, port))."""
    first, first_port = replica(devcluster, namespace, tmp_path, "operator-a")
    second = None
    try:
        wait_until(lambda: leader_metric(first_port) == 1, 60, "operator-a leading")
        second, second_port = replica(devcluster, namespace, tmp_path, "operator-b")
        wait_until(lambda: "standing by" in second.log(), 60, "operator-b standing by")
        yield (first, first_port), (second, second_port)
    finally:
        first.stop()
        if second is not None:
            second.stop()


def test_a_standby_operator_takes_over_when_the_leader_is_killed(
    devcluster: Any, namespace: str, pair
) -> None:
    (first, _), (second, second_port) = pair
    assert leader_metric(second_port) == 0  # and answering its probes meanwhile
    apply(devcluster, namespace, example("led", replicas=0))
    wait_until(lambda: get_json(devcluster, "deployment", "led", "-n", namespace), 60, "reconciled")
    assert "reconcil" not in second.log().lower()  # the standby did nothing

    os.kill(first.proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    wait_until(lambda: leader_metric(second_port) == 1, 30, "operator-b leading")
    takeover = time.monotonic() - killed
    assert takeover < LEASE_SECONDS + 4, takeover
    # The new leader operates: a deleted child comes back.
    devcluster.kubectl("delete", "deployment", "led", "-n", namespace)
    wait_until(lambda: get_json(devcluster, "deployment", "led", "-n", namespace), 60, "recreated")
    lease = get_json(devcluster, "lease", "warmgate-operator", "-n", namespace)
    assert lease["spec"]["holderIdentity"] == "operator-b"
    print(json.dumps({"takeover_seconds": round(takeover, 2)}))
    second.stop()
    lease = get_json(devcluster, "lease", "warmgate-operator", "-n", namespace)
    assert not lease["spec"].get("holderIdentity")  # released on SIGTERM


def test_a_paused_leader_stops_before_writing_once_it_resumes(
    devcluster: Any, namespace: str, pair
) -> None:
    (first, _), (_, second_port) = pair
    os.kill(first.proc.pid, signal.SIGSTOP)  # a frozen process, not a dead one
    wait_until(lambda: leader_metric(second_port) == 1, 30, "operator-b leading")
    # Work for the new leader while the old one is frozen.
    apply(devcluster, namespace, example("paused", replicas=0))
    os.kill(first.proc.pid, signal.SIGCONT)
    code = wait_until(lambda: first.proc.poll(), 30, "the old leader to exit")
    assert code == 1
    log = first.log()
    assert "lost lease" in log
    lease = get_json(devcluster, "lease", "warmgate-operator", "-n", namespace)
    assert lease["spec"]["holderIdentity"] == "operator-b"
