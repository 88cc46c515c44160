"""A real local Kubernetes for warmgate's development and tests.

A real control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler) and a real
node in a network namespace of its own (containerd with runc and the CNI plugins, kubelet,
kube-proxy), built from source at pinned versions, with CoreDNS and metrics-server as pods, the
images built by buildah, and a local model hub. See docs/devcluster.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from warmgate_devcluster.cluster import DevCluster
    from warmgate_devcluster.config import ClusterConfig

__all__ = ["ClusterConfig", "DevCluster"]


def __getattr__(name: str) -> Any:
    # Imported on first use, so that `preflight` runs on the system Python before the venv
    # (with the Kubernetes client) exists.
    if name == "DevCluster":
        from warmgate_devcluster.cluster import DevCluster

        return DevCluster
    if name == "ClusterConfig":
        from warmgate_devcluster.config import ClusterConfig

        return ClusterConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
