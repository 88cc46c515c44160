"""The devcluster's one configuration object: validation, environment, cluster.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from warmgate_devcluster.config import ClusterConfig


def test_config_rejects_networks_that_cannot_work():
    with pytest.raises(ValueError, match="private IPv4"):
        ClusterConfig(pod_cidr="8.8.0.0/16")
    with pytest.raises(ValueError, match="private IPv4"):
        ClusterConfig(node_cidr="127.0.0.0/30")
    with pytest.raises(ValueError, match="/30"):
        ClusterConfig(node_cidr="10.200.1.0/24")
    with pytest.raises(ValueError, match="overlaps"):
        ClusterConfig(pod_cidr="10.96.0.0/16")  # the Service range
    with pytest.raises(ValueError, match="node_port_range"):
        ClusterConfig(node_port_range="30000")
    with pytest.raises(ValueError, match="control_plane_cpu_shares"):
        ClusterConfig(control_plane_cpu_shares=-1)
    # kubelet could not bind its sockets below it, and would start without them.
    with pytest.raises(ValueError, match="too long"):
        ClusterConfig(state_dir=Path("/tmp") / ("x" * 80))


def test_config_reads_the_environment_and_round_trips_through_cluster_json(tmp_path):
    environ = {
        "WARMGATE_DEVCLUSTER_CONTROL_PLANE_CPU_SHARES": "0",
        "WARMGATE_DEVCLUSTER_APP_IMAGES": "false",
        "WARMGATE_DEVCLUSTER_POD_CIDR": "10.150.0.0/16",
    }
    config = ClusterConfig.from_env(environ, state_dir=tmp_path)
    assert config.control_plane_cpu_shares == 0 and config.app_images is False
    assert config.pod_cidr == "10.150.0.0/16"
    again = ClusterConfig.from_dict(json.loads(config.to_json()))
    assert again == config
    # Names that tell two clusters apart come from the state folder.
    other = ClusterConfig.from_env({}, state_dir=tmp_path / "other")
    assert other.cluster_name != config.cluster_name
    assert other.network.name != config.network.name
