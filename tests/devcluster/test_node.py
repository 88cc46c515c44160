"""The node's configuration files: containerd, CNI, kubelet, kube-proxy."""

from __future__ import annotations

import json
from pathlib import Path

from warmgate_devcluster import images, node
from warmgate_devcluster.config import ClusterConfig
from warmgate_devcluster.pki import ADMIN, create_pki


def test_node_configuration_for_cgroup_v1_without_systemd(tmp_path):
    config = ClusterConfig(state_dir=tmp_path)
    paths = node.NodePaths(tmp_path, config.run_dir, tmp_path / "containerd")
    pki = create_pki(tmp_path / "pki", serving_ips=["10.200.1.1"], clients=[ADMIN])
    kubelet = json.loads(
        node.kubelet_yaml(config.network, paths, pki, f"/{config.cluster_name}", 110)
    )
    assert kubelet["failCgroupV1"] is False and kubelet["cgroupDriver"] == "cgroupfs"
    assert kubelet["cgroupRoot"] == f"/{config.cluster_name}"
    assert kubelet["address"] == config.network.node_ip
    assert kubelet["clusterDNS"] == ["10.96.0.10"] and kubelet["resolvConf"] == ""
    assert kubelet["authentication"]["anonymous"]["enabled"] is False
    toml = node.containerd_toml(paths, Path("/bin/node"), images.PAUSE.name)
    assert "restrict_oom_score_adj = true" in toml
    assert f'sandbox = "{images.PAUSE.name}"' in toml
    assert str(paths.containerd_socket) in toml and len(str(paths.containerd_socket)) < 108
    conflist = json.loads(node.cni_conflist(config.network, paths))
    bridge = conflist["plugins"][0]
    assert bridge["ipMasq"] is False and bridge["hairpinMode"] is True
    assert bridge["ipam"]["ranges"] == [[{"subnet": config.network.node_pod_cidr}]]
    proxy = json.loads(node.kube_proxy_yaml(config.network, paths, "devcluster"))
    assert proxy["nodePortAddresses"] == [f"{config.network.node_ip}/32"]
    assert proxy["conntrack"]["maxPerCore"] == 0  # a machine-wide setting: left alone
