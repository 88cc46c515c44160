"""kubelet's CPU isolation for pods that are processes: one cgroup per pod (cgroup v1 `cpu`).

kubelet puts every pod in its own cgroup under a `kubepods` parent: `cpu.shares` from the sum of
the containers' CPU requests (1024 per CPU, at least 2, so BestEffort pods get 2) and a CFS quota
from their limits. The scheduler then shares the CPUs between pods, not between threads: a pod
that starts up (imports, weight loading, a warmup using every core) gets its share of the CPUs
and no more, however many threads it runs, and a serving pod that wakes for a request is not
queued behind them.

The control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler) runs on
machines of its own in a real cluster, not on the node that serves. Here it shares the node, so
it gets a cgroup of its own with a small weight (`control_plane_group`): it still uses every
cycle the pods leave idle, but when the CPUs are contested (a rollout: surge pods starting, and
the control plane busy with the very same rollout) it cannot crowd the serving pods out.

Used when this process may create cgroups under the `cpu` controller (root, cgroup v1, as on
the development machines); otherwise `CpuCgroups.create` and `control_plane_group` return None
and processes share the CPUs thread by thread.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
from pathlib import Path

log = logging.getLogger(__name__)

V1_CPU = Path("/sys/fs/cgroup/cpu")
MIN_SHARES = 2  # kubelet's MinShares: a BestEffort pod's cpu.shares
SHARES_PER_CPU = 1024
PERIOD_US = 100_000  # kubelet's CFS period
MIN_QUOTA_US = 1_000  # kubelet's MinQuotaPeriod


def cpu_millis(quantity: str | int | float) -> int:
    """A Kubernetes CPU quantity in millicores: "100m" -> 100, "1.5" -> 1500, 2 -> 2000."""
    text = str(quantity).strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(m?)", text)
    if match is None:
        raise ValueError(f"not a CPU quantity: {quantity!r}")
    value = float(match.group(1))
    return round(value if match.group(2) else value * 1000)


def pod_cpu(pod: dict) -> tuple[int, int | None]:
    """(requested millicores, limit millicores or None) of a pod's containers, as kubelet sums
    them: a container with a limit and no request requests its limit; the pod has a limit only
    when every container has one."""
    requested, limit, every_limited = 0, 0, True
    for container in pod["spec"].get("containers") or []:
        resources = container.get("resources") or {}
        limit_value = (resources.get("limits") or {}).get("cpu")
        request_value = (resources.get("requests") or {}).get("cpu", limit_value)
        if request_value is not None:
            requested += cpu_millis(request_value)
        if limit_value is None:
            every_limited = False
        else:
            limit += cpu_millis(limit_value)
    return requested, (limit if every_limited and limit else None)


def shares_for(millis: int) -> int:
    return max(MIN_SHARES, millis * SHARES_PER_CPU // 1000)


def quota_for(millis: int | None) -> int:
    """cpu.cfs_quota_us for a limit (-1: none)."""
    return -1 if millis is None else max(MIN_QUOTA_US, millis * PERIOD_US // 1000)


class CpuCgroups:
    """The devcluster's `kubepods`: one parent cgroup, one child per pod (by uid)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @classmethod
    def create(cls, name: str, cpus: int, mount: Path = V1_CPU) -> CpuCgroups | None:
        """The parent cgroup `name` (its share: every CPU, like kubepods), or None when cgroups
        cannot be made here (not root, no cgroup v1 `cpu` controller)."""
        root = mount / name
        try:
            root.mkdir(exist_ok=True)
            (root / "cpu.shares").write_text(str(cpus * SHARES_PER_CPU))
        except OSError as exc:
            log.info("no per-pod CPU isolation (cannot create %s: %s)", root, exc)
            return None
        groups = cls(root)
        groups.prune()
        return groups

    def pod(self, uid: str, pod: dict) -> Path | None:
        """The pod's cgroup, made now with its shares and quota; None when that fails."""
        requested, limit = pod_cpu(pod)
        path = self.root / uid
        try:
            path.mkdir(exist_ok=True)
            (path / "cpu.shares").write_text(str(shares_for(requested)))
            (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (path / "cpu.cfs_quota_us").write_text(str(quota_for(limit)))
        except (OSError, ValueError) as exc:
            log.warning("pod %s: no CPU cgroup (%s)", uid, exc)
            return None
        return path

    def remove(self, uid: str) -> None:
        """Remove a pod's cgroup once its processes are gone (stragglers go to the parent)."""
        remove_group(self.root / uid, self.root)

    def prune(self) -> None:
        """Pod cgroups a previous agent left behind."""
        for child in self.root.iterdir():
            if child.is_dir():
                remove_group(child, self.root)

    def close(self) -> None:
        self.prune()
        with contextlib.suppress(OSError):
            self.root.rmdir()


def control_plane_group(name: str, shares: int, mount: Path = V1_CPU) -> Path | None:
    """The cgroup `name` with `shares` (a fresh one: a leftover of a stopped cluster is
    replaced), or None when cgroups cannot be made here."""
    path = mount / name
    remove_group(path, mount)
    try:
        path.mkdir()
        (path / "cpu.shares").write_text(str(max(MIN_SHARES, shares)))
    except OSError as exc:
        log.info("control plane not in a cgroup of its own (cannot create %s: %s)", path, exc)
        return None
    return path


def remove_group(path: Path, parent: Path = V1_CPU) -> None:
    """Remove a cgroup; processes still in it move to `parent` (by default the root)."""
    with contextlib.suppress(OSError):
        for pid in (path / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (parent / "cgroup.procs").write_text(pid)
    with contextlib.suppress(OSError):
        path.rmdir()


def launch_in(cgroup: Path, argv: list[str]) -> list[str]:
    """`argv` run inside `cgroup`: a shell joins the cgroup, then execs the command (same pid),
    so the process is in its pod's cgroup before its first instruction of real work."""
    return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cgroup / "cgroup.procs"), *argv]


def cluster_group_name(state_dir: Path) -> str:
    """One parent cgroup per devcluster state folder (several clusters may run at once)."""
    digest = hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:12]
    return f"warmgate-devcluster-{digest}"


def control_plane_group_name(state_dir: Path) -> str:
    return f"{cluster_group_name(state_dir)}-control-plane"
