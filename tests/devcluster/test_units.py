"""The devcluster's pure parts: configuration, the node network's addresses, the node's
configuration files, certificates, image input hashes and the load generator's checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from warmgate_devcluster import images, node
from warmgate_devcluster.config import ClusterConfig
from warmgate_devcluster.loadgen import check_local_target, server_timings, total_ms
from warmgate_devcluster.network import NodeNetwork
from warmgate_devcluster.pki import ADMIN, KUBE_PROXY, create_pki, kubelet_identity


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


def test_certificates_name_their_users_and_the_apiserver_addresses(tmp_path):
    identities = [ADMIN, KUBE_PROXY, kubelet_identity("devcluster")]
    pki = create_pki(tmp_path, serving_ips=["10.200.1.1", "10.96.0.1"], clients=identities)
    serving = x509.load_pem_x509_certificate(pki.serving_cert.read_bytes())
    names = serving.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {str(ip) for ip in names.get_values_for_type(x509.IPAddress)} == {
        "127.0.0.1",
        "10.200.1.1",
        "10.96.0.1",
    }
    assert "kubernetes.default.svc" in names.get_values_for_type(x509.DNSName)
    kubelet = x509.load_pem_x509_certificate(
        pki.client_cert(kubelet_identity("devcluster")).read_bytes()
    )
    subject = kubelet.subject
    assert subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "system:node:devcluster"
    assert subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == "system:nodes"
    usage = kubelet.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    ca = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
    kubelet.verify_directly_issued_by(ca)
    assert oct(pki.ca_key.stat().st_mode & 0o777) == "0o600"


def test_an_image_is_rebuilt_only_when_what_goes_into_it_changes(tmp_path, monkeypatch):
    (tmp_path / "constraints.txt").write_text("torch==2\n")
    (tmp_path / "Dockerfile").write_text("FROM scratch\n")
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(images, "repo_root", lambda: tmp_path)
    _build, inputs = images._dockerfile_image("Dockerfile", ("constraints.txt", "pkg"))
    first = inputs()
    # Caches the build leaves out do not count.
    (package / "__pycache__").mkdir()
    (package / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    assert inputs() == first
    (package / "a.py").write_text("x = 2\n")
    assert inputs() != first
    (package / "a.py").write_text("x = 1\n")
    assert inputs() == first
    (package / "a.py").chmod(0o755)
    assert inputs() != first


def test_load_only_targets_this_machine():
    check_local_target("http://127.0.0.1:8080/")
    check_local_target("http://localhost:8080/")
    check_local_target("http://10.200.2.2:30001/", networks=("10.200.2.0/30",))
    with pytest.raises(ValueError, match=r"not 10\.200\.2\.2"):
        check_local_target("http://10.200.2.2:30001/")
    with pytest.raises(ValueError, match=r"not 192\.0\.2\.2"):
        check_local_target("http://192.0.2.2/", networks=("10.200.2.0/30",))


def test_server_timing_header_is_read_as_milliseconds() -> None:
    def server_timing_ms(header: str | None) -> float | None:
        return total_ms(server_timings(header))

    assert server_timing_ms("embed;dur=12.5") == 12.5
    assert server_timing_ms('queue;dur=2, model;desc="forward";dur=8') == 10.0
    assert server_timing_ms(None) is None and server_timing_ms("cache;desc=hit") is None
    assert server_timing_ms("embed;dur=soon") is None
    # warmgate-server's stages add up to its `embed` total, which is what counts, not their sum
    stages = "tokenize;dur=0.4, queue;dur=0.1, model;dur=14.0, model-cpu;dur=13.5, embed;dur=15.2"
    assert server_timing_ms(stages) == 15.2


def test_a_machine_that_cannot_run_the_node_is_told_what_it_needs(monkeypatch):
    from warmgate_devcluster import cluster

    monkeypatch.setattr(cluster.platform, "system", lambda: "Darwin")
    with pytest.raises(cluster.NodeUnsupported, match="Linux"):
        cluster.preflight()
    monkeypatch.setattr(cluster.platform, "system", lambda: "Linux")
    monkeypatch.setattr(cluster.os, "geteuid", lambda: 1000)
    with pytest.raises(cluster.NodeUnsupported, match="root") as raised:
        cluster.preflight()
    assert "Installing into a real cluster" in str(raised.value)
