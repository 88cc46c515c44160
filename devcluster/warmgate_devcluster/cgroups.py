"""The devcluster's cgroups (cgroup v1): three groups per cluster, named after its state folder.

- `<cluster>-control-plane` (cpu controller): etcd, the apiserver, the controller manager and
  the scheduler. On a real cluster they run on machines of their own, not on the node that
  serves; here they share it, so they get a small weight (`cpu.shares`, 256 by default): every
  cycle the pods leave idle, but when the CPUs are contested (a rollout: surge pods starting,
  and the control plane busy with that very rollout) they cannot crowd the serving pods out.
- `<cluster>-node` (cpu controller): containerd, its shims, kubelet and kube-proxy, as
  `system.slice` holds them on a real node. `down` finds every shim here by pid.
- `<cluster>` in every v1 hierarchy: kubelet's `cgroupRoot`. kubelet makes `kubepods` and the
  per-pod groups below it and sets their shares, quotas and memory limits itself; a root of the
  cluster's own keeps two clusters on one machine from removing each other's pods.

Used when this process may create cgroups (root, cgroup v1); `control_plane_group` returns None
otherwise, and `up` refuses to start a node without them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

CGROUP_MOUNT = Path("/sys/fs/cgroup")
V1_CPU = CGROUP_MOUNT / "cpu"
V1_MEMORY = CGROUP_MOUNT / "memory"
MIN_SHARES = 2  # kubelet's MinShares


def v1_hierarchies(mount: Path = CGROUP_MOUNT) -> list[Path]:
    """The mounted cgroup v1 hierarchies (cpu, memory, pids, ..., the named systemd one), not
    the unified (v2) one a hybrid machine also mounts."""
    found = []
    with contextlib.suppress(OSError):
        for path in sorted(mount.iterdir()):
            if path.is_symlink() or not path.is_dir() or path.name == "unified":
                continue
            if (path / "cgroup.procs").exists():
                found.append(path)
    return found


def missing_controllers(required=("cpu", "cpuacct", "cpuset", "memory", "pids")) -> list[str]:
    """Controllers kubelet needs that this machine does not mount as cgroup v1."""
    mounted = {path.name for path in v1_hierarchies()}
    for path in v1_hierarchies():
        mounted.update(path.name.split(","))
    return [name for name in required if name not in mounted]


def control_plane_group(name: str, shares: int, mount: Path = V1_CPU) -> Path | None:
    """The cpu cgroup `name` with `shares` (a fresh one: a leftover of a stopped cluster is
    replaced), or None when cgroups cannot be made here."""
    path = mount / name
    remove_group(path, mount)
    try:
        path.mkdir()
        (path / "cpu.shares").write_text(str(max(MIN_SHARES, shares)))
    except OSError as exc:
        log.info("no cgroup of its own (cannot create %s: %s)", path, exc)
        return None
    return path


@contextlib.contextmanager
def memory_limited(name: str, limit_bytes: int, mount: Path = V1_MEMORY) -> Iterator[Path]:
    """A fresh memory cgroup `name` limited to `limit_bytes` (swap included, where the kernel
    accounts it), removed on exit: processes launched in it (`launch_in`) are killed by the
    kernel past the limit, as in a container with that memory limit."""
    path = mount / name
    remove_group(path, mount)
    path.mkdir()
    try:
        (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
        with contextlib.suppress(OSError):  # absent without swap accounting
            (path / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
        yield path
    finally:
        remove_group(path, mount)


def oom_kills(group: Path) -> int:
    """How many processes the kernel killed in `group` for going past its memory limit."""
    for line in (group / "memory.oom_control").read_text().splitlines():
        if line.startswith("oom_kill "):
            return int(line.split()[1])
    return 0


def create_root(name: str) -> None:
    """kubelet's cgroupRoot `/name`, made in every v1 hierarchy (kubelet checks it exists).
    A cpuset group starts with no CPUs or memory nodes: it gets its parent's."""
    for hierarchy in v1_hierarchies():
        path = hierarchy / name
        path.mkdir(exist_ok=True)
        for key in ("cpuset.cpus", "cpuset.mems"):
            parent_value = hierarchy / key
            if parent_value.exists() and not (path / key).read_text().strip():
                (path / key).write_text(parent_value.read_text().strip())


def pids_in_tree(name: str) -> set[int]:
    """Every process in `/name` or below it, in any v1 hierarchy."""
    found: set[int] = set()
    for hierarchy in v1_hierarchies():
        top = hierarchy / name
        if not top.is_dir():
            continue
        for procs_file in top.rglob("cgroup.procs"):
            with contextlib.suppress(OSError, ValueError):
                found.update(int(pid) for pid in procs_file.read_text().split())
    found.discard(os.getpid())
    return found


def kill_tree(name: str, timeout: float = 10.0) -> int:
    """SIGKILL every process in `/name` and below, by pid, until none is left. Returns how many
    were killed."""
    killed: set[int] = set()
    deadline = time.monotonic() + timeout
    while True:
        pids = pids_in_tree(name)
        if not pids:
            return len(killed)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)
        killed |= pids
        if time.monotonic() > deadline:
            log.warning("processes still in %s after %.0fs: %s", name, timeout, sorted(pids))
            return len(killed)
        time.sleep(0.1)


def remove_tree(name: str) -> None:
    """Remove `/name` and every group below it, deepest first, in every v1 hierarchy."""
    for hierarchy in v1_hierarchies():
        top = hierarchy / name
        if not top.is_dir():
            continue
        groups = sorted(
            (p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True
        )
        for group in [*groups, top]:
            remove_group(group, hierarchy)


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
    so the process is in its group before its first instruction of real work."""
    return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cgroup / "cgroup.procs"), *argv]
