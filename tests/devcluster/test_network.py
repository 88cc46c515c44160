"""The node network's names and addresses (pure; creating it is test_cluster's)."""

from __future__ import annotations

from warmgate_devcluster.network import NodeNetwork


def test_node_network_addresses():
    network = NodeNetwork("wg-0123abcd", "10.200.3.0/30", "10.103.0.0/16", "10.96.0.0/16")
    assert (network.host_ip, network.node_ip) == ("10.200.3.1", "10.200.3.2")
    assert network.node_pod_cidr == "10.103.0.0/24" and network.bridge_ip == "10.103.0.1"
    assert network.kubernetes_service_ip == "10.96.0.1"
    assert network.dns_service_ip == "10.96.0.10"
    assert len(network.host_link) <= 15  # the kernel's limit on link names
    assert network.contains("10.103.0.7") and network.contains("10.200.3.2")
    assert not network.contains("10.96.0.1") and not network.contains("192.0.2.2")
    assert network.enter(["kubelet"]) == [
        "nsenter",
        "--net=/run/netns/wg-0123abcd",
        "--",
        "kubelet",
    ]
