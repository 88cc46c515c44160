"""Finding the binaries: Kubernetes' (KUBEBUILDER_ASSETS first, else tools/k8s-bin.sh) and the
node's (containerd, runc, CNI plugins, metrics-server, pause: tools/node-bin.sh)."""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

from warmgate_devcluster.config import repo_root

REQUIRED = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubelet",
    "kube-proxy",
    "kubectl",
)
NODE_REQUIRED = (
    "containerd",
    "containerd-shim-runc-v2",
    "ctr",
    "runc",
    "cni/bridge",
    "cni/host-local",
    "cni/loopback",
    "cni/portmap",
    "metrics-server",
    "coredns",
    "pause",
)


class BinariesUnavailable(RuntimeError):
    pass


def has_all(folder: str | Path | None, names: tuple[str, ...] = REQUIRED) -> bool:
    if not folder:
        return False
    folder = Path(folder)
    return all(os.access(folder / name, os.X_OK) for name in names)


def _build_script() -> Path | None:
    """tools/k8s-bin.sh of the checkout, or the script WARMGATE_K8S_BIN names."""
    override = os.environ.get("WARMGATE_K8S_BIN")
    if override and Path(override).is_file():
        return Path(override)
    root = repo_root()
    if root is not None:
        return root / "tools" / "k8s-bin.sh"
    return None


def find_bin_dir(*, build: bool = True) -> Path:
    """The folder with etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl.

    Order: KUBEBUILDER_ASSETS when it has them all; WARMGATE_K8S_BIN when it is such a folder;
    else tools/k8s-bin.sh, which prints its cached folder at once or builds it (tens of minutes
    the first time) when `build` is true.
    """
    for candidate in (os.environ.get("KUBEBUILDER_ASSETS"), os.environ.get("WARMGATE_K8S_BIN")):
        if candidate and Path(candidate).is_dir() and has_all(candidate):
            return Path(candidate)
    script = _build_script()
    if script is None:
        raise BinariesUnavailable(
            "no control-plane binaries: set KUBEBUILDER_ASSETS to a folder holding "
            + ", ".join(REQUIRED)
            + ", or run from a warmgate checkout (tools/k8s-bin.sh builds them)"
        )
    env = dict(os.environ)
    try:
        result = subprocess.run(
            ["bash", str(script)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=None,  # the build's progress goes to the caller's terminal
            text=True,
            check=True,
            # k8s-bin.sh answers at once when everything is cached; without `build`, a
            # script that starts compiling is stopped rather than waited for.
            timeout=None if build else 30,
        )
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        raise BinariesUnavailable(f"{script} failed: {exc}") from exc
    folder = Path(result.stdout.strip().splitlines()[-1])
    if not has_all(folder):
        raise BinariesUnavailable(f"{script} printed {folder}, which lacks some of {REQUIRED}")
    return folder


@functools.cache
def find_node_bin_dir(*, build: bool = True) -> Path:
    """The folder with the node's binaries: WARMGATE_NODE_BIN when it holds them all, else
    what tools/node-bin.sh prints (it builds them the first time, a few minutes)."""
    override = os.environ.get("WARMGATE_NODE_BIN")
    if override and has_all(override, NODE_REQUIRED):
        return Path(override)
    root = repo_root()
    if root is None:
        raise BinariesUnavailable(
            "no node binaries: set WARMGATE_NODE_BIN to a folder holding "
            + ", ".join(NODE_REQUIRED)
            + ", or run from a warmgate checkout (tools/node-bin.sh builds them)"
        )
    script = root / "tools" / "node-bin.sh"
    try:
        result = subprocess.run(
            ["bash", str(script)],
            stdout=subprocess.PIPE,
            stderr=None,
            text=True,
            check=True,
            timeout=None if build else 30,
        )
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        raise BinariesUnavailable(f"{script} failed: {exc}") from exc
    folder = Path(result.stdout.strip().splitlines()[-1])
    if not has_all(folder, NODE_REQUIRED):
        raise BinariesUnavailable(f"{script} printed {folder}, which lacks some of {NODE_REQUIRED}")
    return folder
