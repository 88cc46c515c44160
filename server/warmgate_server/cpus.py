"""How many CPUs this process may use (its affinity, capped by its cgroup's CPU limit: a pod's
`resources.limits.cpu`) and how to share them: model workers and torch threads per worker."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from .config import ServerConfig

log = logging.getLogger(__name__)


def _cgroup_cpu_limit(
    root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")
) -> float | None:
    """The CPU limit of this process's own cgroup (a pod's resources.limits.cpu), or None.

    cgroup v2: `cpu.max` ("200000 100000" = 2 CPUs, "max 100000" = none); cgroup v1:
    `cpu.cfs_quota_us` / `cpu.cfs_period_us` (-1 = none), in the `cpu` hierarchy. The cgroup is
    the one /proc/self/cgroup names (inside a container's cgroup namespace that is "/").
    """
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _hierarchy, controllers, path = line.split(":", 2)
        relative = path.lstrip("/")
        if controllers == "":
            try:
                quota, period = (root / relative / "cpu.max").read_text().split()[:2]
                return None if quota == "max" else int(quota) / int(period)
            except (OSError, ValueError):
                continue
        if "cpu" in controllers.split(","):
            for mount in (root / "cpu", root / controllers):
                try:
                    quota_us = int((mount / relative / "cpu.cfs_quota_us").read_text())
                    period_us = int((mount / relative / "cpu.cfs_period_us").read_text())
                except (OSError, ValueError):
                    continue
                return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us
    return None


def usable_cpus() -> int:
    """The CPUs this process may use: its affinity, capped by its cgroup CPU limit, which
    sched_getaffinity does not see (a pod limited to 2 CPUs on a 64-CPU node sees 64)."""
    count = len(os.sched_getaffinity(0))
    limit = _cgroup_cpu_limit()
    if limit is not None:
        count = min(count, max(1, int(limit)))
    return count


@dataclass(frozen=True)
class ThreadPlan:
    """How the CPUs are split: `workers` forward passes at once, `threads` torch threads each,
    `tokenizers` threads tokenizing side by side."""

    workers: int
    threads: int
    tokenizers: int = 1
    solo_threads: int = 0
    """Torch threads of a batch that runs solo (every worker's, on a CPU with two or more
    workers; the scheduler's `solo`), else 0: no batch does."""


def plan_threads(config: ServerConfig, device_type: str, cpus: int | None = None) -> ThreadPlan:
    """Defaults: on a GPU one worker (the device serialises its passes anyway); on a CPU two
    workers when there are at least two CPUs, like Triton's two instances of a CPU model.

    Two single-threaded passes side by side use two cores fully, where one pass on two threads
    loses time at every operator's fork and join (small matrices: 384 wide for MiniLM); a batch
    arriving while the other worker is busy starts at once instead of queueing behind it. A
    small batch that is all there is to do runs solo on every worker's cores instead (the
    scheduler's `solo`, workers.SOLO_TOKENS): a lone request's latency is what two threads give.
    """
    cpus = cpus or usable_cpus()
    workers = config.model_workers or (1 if device_type == "cuda" or cpus < 2 else 2)
    threads = config.torch_threads or max(1, cpus // workers)
    # On a CPU the model threads want every core, and one tokenizer thread keeps up with them;
    # on a GPU the CPUs are free for tokenizing, which must keep up with the device.
    tokenizers = config.tokenization_workers or (
        1 if device_type == "cpu" else max(1, min(4, cpus // 4))
    )
    solo = workers * threads if device_type == "cpu" and workers > 1 else 0
    return ThreadPlan(workers, threads, tokenizers, solo)
