"""A real local Kubernetes for warmgate's development and tests.

Real etcd, kube-apiserver, kube-controller-manager and kube-scheduler, plus a node agent that
runs pods as local processes (stand-in for kubelet and a container runtime), an EndpointSlice
controller that can represent loopback pod IPs, and a service proxy for NodePort Services.
See docs/devcluster.md.
"""

from warmgate_devcluster.cluster import DevCluster
from warmgate_devcluster.config import ClusterConfig

__all__ = ["ClusterConfig", "DevCluster"]
