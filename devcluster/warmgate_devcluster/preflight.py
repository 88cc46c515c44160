"""What the devcluster's real node needs from this machine, said before anything starts.

Standard library only: `make up` and `make test` run it with the system Python before they
make the venv and build Kubernetes and the node (about ten minutes the first time), so a
machine that cannot run the node is told at once:

    PYTHONPATH=devcluster python3 -m warmgate_devcluster.preflight --target up

(every make target that runs the node does so: up, test, test-e2e, test-chart, test-kubectl,
bench-operator, bench-rollout).

`DevCluster.up` runs the same checks, with the commands the node runs (which `make node-bin`
installs, so the early check leaves them out).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
from pathlib import Path

from warmgate_devcluster import cgroups
from warmgate_devcluster.config import cache_root

NODE_COMMANDS = ("ip", "nsenter", "iptables", "iptables-restore", "mount")
# Free disk the cache folder's filesystem needs: a first run builds Kubernetes, the node and the
# images (buildah's store, a containerd root with the several-GB server image unpacked, the
# wheelhouse: about 25 GiB, the venv and Go's caches besides); later runs reuse them and need room
# for what a run writes (pods' model downloads, logs, etcd, a rebuilt code layer).
FIRST_RUN_FREE_GIB = 30
LATER_RUN_FREE_GIB = 8
# What a user who cannot run the node can do instead of a test target.
TESTS_WITHOUT_NODE = " `make test-unit` runs the tests that need no cluster."


class NodeUnsupported(RuntimeError):
    """This machine cannot run the real node; the message says what it needs."""


def problems(*, commands: bool = True) -> list[str]:
    """What this machine lacks for the real node ([] when nothing)."""
    found = []
    if platform.system() != "Linux":
        found.append(f"Linux (this is {platform.system()}): kubelet and containerd run here")
    elif os.geteuid() != 0:
        found.append(
            "root: the node creates a network namespace, cgroups and mounts (run `make up` as "
            "root, or use a cluster you already have: see README, 'Installing into a real cluster')"
        )
    else:
        missing = cgroups.missing_controllers()
        if missing:
            found.append(f"cgroup v1 controllers mounted under /sys/fs/cgroup: {missing}")
        if not Path("/dev/kmsg").exists():
            found.append("/dev/kmsg (kubelet's OOM watcher reads it)")
        room = disk_shortfall()
        if room:
            found.append(room)
        if commands:
            for command in NODE_COMMANDS:
                if shutil.which(command) is None:
                    found.append(f"the `{command}` command (tools/node-deps.sh installs it)")
    return found


def disk_shortfall(cache: Path | None = None) -> str | None:
    """What is short of free disk where the cache folder lives (None when there is room)."""
    cache = cache or cache_root()
    built = (cache / "buildah").is_dir()
    need = LATER_RUN_FREE_GIB if built else FIRST_RUN_FREE_GIB
    existing = cache
    while not existing.exists():
        existing = existing.parent
    free = shutil.disk_usage(existing).free / 2**30
    if free >= need:
        return None
    why = "a run" if built else "a first run (it builds Kubernetes, the node and the images)"
    return (
        f"{need} GiB of free disk for {why} where the cache folder {cache} lives ({free:.1f} GiB "
        "free): free some, or point WARMGATE_CACHE at a bigger disk"
    )


def message(found: list[str]) -> str:
    return "the devcluster's real node needs: " + "; ".join(found) + "."


def check(*, commands: bool = True) -> None:
    """Raise NodeUnsupported, saying what is missing, unless this machine can run the node."""
    found = problems(commands=commands)
    if found:
        raise NodeUnsupported(message(found))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m warmgate_devcluster.preflight")
    parser.add_argument("--target", default="up", help="the make target asking")
    args = parser.parse_args(argv)
    found = problems(commands=False)
    if not found:
        return 0
    instead = TESTS_WITHOUT_NODE if args.target.startswith("test") else ""
    print(f"make {args.target}: {message(found)}{instead}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
