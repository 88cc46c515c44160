"""pytest fixtures: `devcluster` (one whole cluster per test session, in a temporary state
folder) and `namespace` (a fresh namespace per test). Enable with

    pytest_plugins = ["warmgate_devcluster.pytest_plugin"]

The cluster takes its own node link and pod network (and containerd root), so it does not collide
with a `make up` cluster running at the same time. Missing binaries and images are built
(tools/k8s-bin.sh, tools/node-bin.sh, images.py); nothing is skipped.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import pytest
from kubernetes.client import ApiClient

from warmgate_devcluster import cgroups, kubeapi
from warmgate_devcluster.cluster import DevCluster, unmount_under
from warmgate_devcluster.config import ClusterConfig, cache_root


@dataclass
class DevClusterHandle:
    """What tests get from the `devcluster` fixture."""

    cluster: DevCluster
    kubeconfig: str
    env: dict[str, str]
    bin_dir: Path
    state_dir: Path
    start_seconds: float = 0.0
    # Why the cluster can no longer run tests, once a health check found it broken: every later
    # test that needs it fails at once with this, instead of waiting out its own timeout.
    broken: str | None = None
    _clients: list = field(default_factory=list)
    _api: ApiClient | None = None

    @classmethod
    def of(cls, cluster: DevCluster, start_seconds: float = 0.0) -> DevClusterHandle:
        """The handle of a cluster that is up: its kubeconfig in the environment."""
        kubeconfig = str(cluster.kubeconfig)
        return cls(
            cluster=cluster,
            kubeconfig=kubeconfig,
            env=dict(os.environ, KUBECONFIG=kubeconfig),
            bin_dir=cluster.bin_dir,
            state_dir=cluster.state_dir,
            start_seconds=start_seconds,
        )

    @property
    def config(self) -> ClusterConfig:
        return self.cluster.config

    @property
    def node_name(self) -> str:
        return self.cluster.config.node_name

    @property
    def node_ip(self) -> str:
        """The node's InternalIP: a NodePort Service answers here (kube-proxy)."""
        return self.cluster.node_ip

    @property
    def hub_endpoint(self) -> str | None:
        """The devcluster's model hub: pods download models from it (HF_ENDPOINT)."""
        return self.cluster.hub_endpoint

    @property
    def hub_revisions(self) -> dict[str, str]:
        """{revision: commit} of all-MiniLM-L6-v2 on the hub (main, v1, and v2: other weights)."""
        return self.cluster.hub_revisions

    @property
    def networks(self) -> tuple[str, str]:
        """The node link and the pod network: the only addresses besides loopback a test may
        send to."""
        return (self.config.node_cidr, self.config.pod_cidr)

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 120.0
    ) -> subprocess.CompletedProcess:
        """Run the built kubectl against this cluster (`DevCluster.kubectl`); output captured
        as text."""
        return self.cluster.kubectl(*args, check=check, input=input, timeout=timeout)

    def api_client(self) -> ApiClient:
        """A kubernetes.client.ApiClient for the admin user, closed with the session."""
        client = self.cluster.api_client()
        self._clients.append(client)
        return client

    @property
    def api(self) -> ApiClient:
        """One shared admin client for the fixtures' and helpers' own calls (`kubeapi`)."""
        if self._api is None:
            self._api = self.api_client()
        return self._api

    def container_pids(self, pod: dict, container: str) -> list[int]:
        """Host pids of one container of a pod (from the cgroup kubelet made for it): what a
        test signals to crash a container for real, as an OOM kill or a segfault would."""
        status = next(s for s in pod["status"]["containerStatuses"] if s["name"] == container)
        container_id = status["containerID"].rpartition("/")[2]
        root = cgroups.V1_CPU / self.config.cluster_name
        for group in root.rglob(container_id):
            return [int(pid) for pid in (group / "cgroup.procs").read_text().split()]
        return []

    def pids(self) -> list[int]:
        """Every pid the cluster runs: control plane, node, shims and containers."""
        return self.cluster.all_pids()

    def restart_apiserver(self, compact_etcd: bool = True) -> None:
        """Every watch breaks and cannot go on from its old version (DevCluster's)."""
        self.cluster.restart_apiserver(compact_etcd=compact_etcd)

    def close(self) -> None:
        for client in self._clients:
            client.close()

    def unhealthy(self) -> list[str]:
        """The components that are not running or not healthy, each with its detail."""
        return [
            f"{c.name} {'unhealthy' if c.running else 'not running'} ({c.detail})"
            for c in self.cluster.status()
            if not c.healthy
        ]

    def require_healthy(self, before: str, grace: float = 30.0) -> None:
        """Fail the test about to run if the cluster is broken: a component not running or not
        healthy for `grace` seconds (a test that restarts one leaves it a moment to come back)."""
        if self.broken:
            pytest.fail(self.broken, pytrace=False)
        deadline = time.monotonic() + grace
        while (found := self.unhealthy()) and time.monotonic() < deadline:
            time.sleep(1.0)
        if found:
            self.broken = (
                f"the session's devcluster is broken (found before {before}): "
                + "; ".join(found)
                + f"; free disk: {free_disk(self.state_dir)}; its logs: {self.state_dir / 'logs'}"
            )
            pytest.fail(self.broken, pytrace=False)

    def snapshot(self) -> str:
        """What a failed test's report shows of the cluster: unhealthy components, the node's
        pressure conditions, pods that are not running and ready, the latest warning events."""
        lines = [f"components: {'; '.join(self.unhealthy()) or 'all healthy'}"]
        lines.append(f"free disk: {free_disk(self.state_dir)}")

        def kubectl(*args: str) -> list[str]:
            result = self.kubectl(*args, check=False, timeout=20)
            return (result.stdout or result.stderr).strip().splitlines()

        conditions = (
            'jsonpath={range .items[*].status.conditions[?(@.status=="True")]}'
            '{.type}: {.message}{"\\n"}{end}'
        )
        lines += [
            f"node condition {line}"
            for line in kubectl("get", "nodes", "-o", conditions)
            if not line.startswith("Ready:")
        ]
        pods = [
            line
            for line in kubectl("get", "pods", "-A", "-o", "wide", "--no-headers")
            if not re.search(r"\s(\d+)/\1\s+Running\s", line)
        ]
        lines.append(f"pods not running and ready ({len(pods)}):")
        lines += [f"  {line}" for line in pods[:30]]
        events = kubectl(
            "get", "events", "-A", "--field-selector=type!=Normal",
            "--sort-by=.lastTimestamp", "--no-headers",
        )  # fmt: skip
        lines.append(f"latest warning events ({len(events)}):")
        lines += [f"  {line[:300]}" for line in events[-20:]]
        return "\n".join(lines)


def free_disk(path: Path) -> str:
    usage = shutil.disk_usage(path)
    return f"{usage.free / 2**30:.1f} GiB of {usage.total / 2**30:.0f} at {path}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that used the session's devcluster carries the cluster's state in its
    report: what broke is read there, not guessed from a timeout."""
    outcome = yield
    report = outcome.get_result()
    handle = getattr(item, "funcargs", {}).get("devcluster")
    if not report.failed or not isinstance(handle, DevClusterHandle):
        return
    try:
        text = handle.snapshot()
    except Exception as error:  # the report must not hide the test's failure
        text = f"(the snapshot failed: {error!r})"
    report.sections.append(("devcluster when the test failed", text))


SLOTS = range(2, 15)  # 13 slots; the default (`make up`) cluster uses network 1
_LOCK_DIR = Path(tempfile.gettempdir()) / "warmgate-devcluster-slots"


@dataclass
class Slot:
    """A node link, pod network and containerd root no other test session on this machine
    holds. The lock is a flock, so it goes away with the process that holds it, however it
    ends. Sessions take the lowest free slot, so a lone session always finds the images its
    slot's containerd imported last time."""

    index: int
    _handle: IO

    @property
    def node_cidr(self) -> str:
        return f"10.200.{self.index}.0/30"

    @property
    def pod_cidr(self) -> str:
        return f"10.{100 + self.index}.0.0/16"

    @property
    def containerd_root(self) -> Path:
        return _slot_root(self.index)

    def release(self) -> None:
        self._handle.close()


def _try_lock(index: int) -> IO | None:
    handle = open(_LOCK_DIR / f"slot-{index}.lock", "w")  # noqa: SIM115 - held for the run
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    return handle


def _slot_root(index: int) -> Path:
    return cache_root() / "containerd" / f"test-slot-{index}"


def prune_free_slots_above(index: int) -> list[int]:
    """Remove the containerd roots (each several GB of unpacked images) of the free slots
    above `index` + 1. Sessions take the lowest free slot, so a slot two above a session's own
    is only used while three sessions overlap; kept, one per slot ever used, those roots would
    fill the disk. The slot just above stays: a session's second cluster (`make up` run by its
    test, the lifecycle tests) takes it, and finds its images imported. A slot is pruned under
    its own lock, so a session starting meanwhile waits for nothing and finds it empty.
    Returns the slots whose roots went."""
    pruned = []
    for other in SLOTS:
        if other <= index + 1 or not _slot_root(other).exists():
            continue
        handle = _try_lock(other)
        if handle is None:
            continue  # another session's
        try:
            unmount_under(_slot_root(other))  # left by a session that was killed
            shutil.rmtree(_slot_root(other), ignore_errors=True)
            pruned.append(other)
        finally:
            handle.close()
    return pruned


def reserve_slot() -> Slot:
    _LOCK_DIR.mkdir(parents=True, exist_ok=True)
    for index in SLOTS:
        handle = _try_lock(index)
        if handle is None:
            continue
        prune_free_slots_above(index)
        return Slot(index, handle)
    raise RuntimeError(f"all {len(SLOTS)} devcluster slots are held by other test sessions")


def isolated_config(state_dir: Path, slot: Slot, **overrides) -> ClusterConfig:
    """A configuration whose addresses and containerd root no other cluster here uses."""
    settings = {
        "state_dir": state_dir,
        "node_cidr": slot.node_cidr,
        "pod_cidr": slot.pod_cidr,
        "containerd_root": slot.containerd_root,
    }
    settings.update(overrides)
    return ClusterConfig.from_env(**settings)


@pytest.fixture(scope="session")
def devcluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevClusterHandle]:
    state_dir = tmp_path_factory.mktemp("devcluster")
    slot = reserve_slot()
    cluster = DevCluster(isolated_config(state_dir, slot))
    started = time.monotonic()
    cluster.up(log=lambda *_: None)
    handle = DevClusterHandle.of(cluster, start_seconds=time.monotonic() - started)
    try:
        yield handle
    finally:
        handle.close()
        cluster.down(log=lambda *_: None)
        slot.release()


@pytest.fixture
def namespace(devcluster: DevClusterHandle, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace (with its default ServiceAccount), deleted after the test. The test
    fails at once if the session's cluster is broken."""
    devcluster.require_healthy(before=request.node.nodeid)
    name = f"t-{uuid.uuid4().hex[:10]}"
    api = devcluster.api
    namespaces = kubeapi.resource_path("v1", "namespaces")
    kubeapi.call(
        api,
        "POST",
        namespaces,
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}},
    )
    account = kubeapi.resource_path("v1", "serviceaccounts", name, "default")
    deadline = time.monotonic() + 60
    while kubeapi.read(api, account) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"namespace {name}: no default ServiceAccount after 60s")
        time.sleep(0.1)
    try:
        yield name
    finally:
        # As `kubectl delete namespace --wait=false`: the namespace controller finishes it.
        with contextlib.suppress(kubeapi.ApiError, *kubeapi.UNANSWERED):
            kubeapi.call(api, "DELETE", kubeapi.resource_path("v1", "namespaces", name=name))
