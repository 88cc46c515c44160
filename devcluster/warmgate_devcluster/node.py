"""The real node: configuration files and command lines of containerd, kubelet and kube-proxy.

Pure builders (no I/O but the returned text): `cluster.py` writes the files and runs the
commands inside the node's network namespace (`network.py`). What this machine needs and why:

- cgroup v1 and no systemd: kubelet runs with `failCgroupV1: false` and the cgroupfs driver,
  its pods under a cgroup root of this cluster's own (`/warmgate-devcluster-<hash>`), so two
  clusters on one machine never remove each other's pod cgroups.
- root here lacks CAP_SYS_RESOURCE: containerd's `restrict_oom_score_adj` keeps runc from
  lowering a container's oom_score_adj below its own (a sandbox fails without it).
- no registry can be reached: every image is imported into containerd (`images.py`), the
  sandbox image is a locally built pause image pinned so it is never garbage-collected or
  pulled, and image garbage collection is off (a server image is several GB to import again).
- no resolver the pods may use: `resolvConf: ""`, and the cluster DNS (CoreDNS, an add-on the
  devcluster installs) answers cluster.local names only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from warmgate_devcluster.network import NodeNetwork
from warmgate_devcluster.pki import Pki

CNI_NETWORK = "warmgate"
CNI_BRIDGE = "cni0"
CLUSTER_DOMAIN = "cluster.local"


@dataclass(frozen=True)
class NodePaths:
    """Where one node keeps its state. `run_dir` is short (unix socket paths are limited to 108
    bytes) and outside the state folder; so is `containerd_root`, kept between runs for its
    imported images."""

    state_dir: Path
    run_dir: Path
    containerd_root: Path

    @property
    def containerd_config(self) -> Path:
        return self.state_dir / "node" / "containerd.toml"

    @property
    def containerd_state(self) -> Path:
        return self.run_dir / "containerd"

    @property
    def containerd_socket(self) -> Path:
        return self.run_dir / "containerd.sock"

    @property
    def cni_conf_dir(self) -> Path:
        return self.state_dir / "node" / "cni"

    @property
    def cni_state_dir(self) -> Path:
        return self.state_dir / "node" / "cni-state"

    @property
    def kubelet_root(self) -> Path:
        return self.state_dir / "node" / "kubelet"

    @property
    def kubelet_config(self) -> Path:
        return self.state_dir / "node" / "kubelet.yaml"

    @property
    def kubelet_kubeconfig(self) -> Path:
        return self.state_dir / "node" / "kubelet.kubeconfig"

    @property
    def kube_proxy_config(self) -> Path:
        return self.state_dir / "node" / "kube-proxy.yaml"

    @property
    def kube_proxy_kubeconfig(self) -> Path:
        return self.state_dir / "node" / "kube-proxy.kubeconfig"

    @property
    def pod_logs(self) -> Path:
        return self.state_dir / "logs" / "pods"


def containerd_toml(paths: NodePaths, node_bin: Path, sandbox_image: str) -> str:
    """containerd 2.x configuration (version 3) for one node."""
    return f"""version = 3
root = {json.dumps(str(paths.containerd_root))}
state = {json.dumps(str(paths.containerd_state))}
disabled_plugins = [
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.blockfile",
  "io.containerd.snapshotter.v1.erofs",
  "io.containerd.tracing.processor.v1.otlp",
  "io.containerd.internal.v1.tracing",
]

[grpc]
  address = {json.dumps(str(paths.containerd_socket))}

[plugins]
  [plugins.'io.containerd.cri.v1.images']
    snapshotter = 'overlayfs'
    [plugins.'io.containerd.cri.v1.images'.pinned_images]
      sandbox = {json.dumps(sandbox_image)}

  [plugins.'io.containerd.cri.v1.runtime']
    # This machine's root lacks CAP_SYS_RESOURCE: runc may not lower oom_score_adj.
    restrict_oom_score_adj = true
    netns_mounts_under_state_dir = true
    [plugins.'io.containerd.cri.v1.runtime'.containerd]
      default_runtime_name = 'runc'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
        runtime_type = 'io.containerd.runc.v2'
        [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
          BinaryName = {json.dumps(str(node_bin / "runc"))}
          SystemdCgroup = false
    [plugins.'io.containerd.cri.v1.runtime'.cni]
      bin_dirs = [{json.dumps(str(node_bin / "cni"))}]
      conf_dir = {json.dumps(str(paths.cni_conf_dir))}
      max_conf_num = 1

  [plugins.'io.containerd.grpc.v1.cri']
    stream_server_address = '127.0.0.1'
    stream_server_port = '0'
"""


def cni_conflist(network: NodeNetwork, paths: NodePaths) -> str:
    """A bridge for the node's pods (the bridge is their gateway; hairpin so a pod reaches
    itself through its own Service), host-local addresses from the node's pod CIDR, portmap for
    hostPort, and no masquerade: nothing leaves the node's namespace."""
    conflist = {
        "cniVersion": "1.0.0",
        "name": CNI_NETWORK,
        "plugins": [
            {
                "type": "bridge",
                "bridge": CNI_BRIDGE,
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": network.node_pod_cidr}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(paths.cni_state_dir),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }
    return json.dumps(conflist, indent=2) + "\n"


def kubelet_yaml(
    network: NodeNetwork, paths: NodePaths, pki: Pki, cgroup_root: str, max_pods: int
) -> str:
    config = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        # kubelet 1.35+ refuses cgroup v1 unless told otherwise; this machine has no v2.
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": cgroup_root,
        "failSwapOn": False,
        "containerRuntimeEndpoint": f"unix://{paths.containerd_socket}",
        "address": network.node_ip,
        "port": 10250,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": 10248,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(pki.ca_cert)},
        },
        "authorization": {"mode": "Webhook"},
        # Pods ask the cluster DNS (CoreDNS); the node's own resolver is never handed to them,
        # so no name lookup leaves the machine.
        "resolvConf": "",
        "clusterDNS": [network.dns_service_ip],
        "clusterDomain": CLUSTER_DOMAIN,
        "podLogsDir": str(paths.pod_logs),
        "maxPods": max_pods,
        "serializeImagePulls": False,
        # Images cannot be pulled again here: never collect them.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        # A shared development machine: evict only when really out of room.
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "nodefs.inodesFree": "1%",
            "imagefs.available": "1%",
        },
        "shutdownGracePeriod": "0s",
        "shutdownGracePeriodCriticalPods": "0s",
        "staticPodPath": "",
        "registerNode": True,
    }
    return json.dumps(config, indent=2) + "\n"


def kubelet_argv(kubelet: Path, network: NodeNetwork, paths: NodePaths, node_name: str) -> list:
    return network.enter(
        [
            str(kubelet),
            f"--config={paths.kubelet_config}",
            f"--kubeconfig={paths.kubelet_kubeconfig}",
            f"--root-dir={paths.kubelet_root}",
            f"--cert-dir={paths.kubelet_root / 'pki'}",
            f"--node-ip={network.node_ip}",
            f"--hostname-override={node_name}",
            "--v=1",
        ]
    )


def kube_proxy_yaml(network: NodeNetwork, paths: NodePaths, node_name: str) -> str:
    config = {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(paths.kube_proxy_kubeconfig)},
        "mode": "iptables",
        "hostnameOverride": node_name,
        "clusterCIDR": network.pod_cidr,
        "bindAddress": network.node_ip,
        # This machine checks kube-proxy's health from outside the node's namespace.
        "healthzBindAddress": f"{network.node_ip}:10256",
        "metricsBindAddress": "127.0.0.1:10249",
        "nodePortAddresses": [f"{network.node_ip}/32"],
        # conntrack's table size is a machine-wide setting: leave it alone.
        "conntrack": {"maxPerCore": 0},
        "iptables": {"localhostNodePorts": False},
    }
    return json.dumps(config, indent=2) + "\n"


def kube_proxy_argv(kube_proxy: Path, network: NodeNetwork, paths: NodePaths) -> list:
    return network.enter([str(kube_proxy), f"--config={paths.kube_proxy_config}", "--v=1"])


def containerd_argv(node_bin: Path, network: NodeNetwork, paths: NodePaths) -> list:
    return network.enter([str(node_bin / "containerd"), f"--config={paths.containerd_config}"])
