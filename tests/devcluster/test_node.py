"""The devcluster's real node against the real control plane: kubelet runs containers from the
imported images (runc, CNI), probes and readiness gates decide Ready, kube-proxy routes Services
(node ports on the node's address, ClusterIPs inside the node), CoreDNS answers Service names,
metrics-server serves `kubectl top`, and `kubectl logs`/`exec` reach the containers."""

from __future__ import annotations

import ipaddress
import json
import time

import pytest
from dc_helpers import (
    condition,
    deployment_manifest,
    http_json,
    nodeport_service,
    pod_manifest,
    script_configmap,
    server_container,
    wait_for,
)
from kubernetes import client
from kubernetes.client.rest import ApiException

from warmgate_devcluster import cgroups, procs
from warmgate_devcluster.images import BASE

pytestmark = pytest.mark.cluster

WARMED = "warmgate.dev/warmed"
# The generated client defaults PATCH bodies to JSON Patch; ours are strategic merge patches.
SMP = "application/strategic-merge-patch+json"


@pytest.fixture
def core(devcluster, namespace):
    api = client.CoreV1Api(devcluster.api_client())
    api.create_namespaced_config_map(namespace, script_configmap())
    return api


@pytest.fixture
def apps(devcluster):
    return client.AppsV1Api(devcluster.api_client())


def apply(devcluster, namespace: str, manifest: dict) -> None:
    devcluster.kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(manifest))


def ready_pod(core, namespace: str, name: str, timeout: float = 90):
    return wait_for(
        lambda: (
            (p := core.read_namespaced_pod(name, namespace))
            and condition(p, "Ready") == "True"
            and p
        ),
        f"pod {name} to be Ready",
        timeout,
    )


def gone(core, namespace: str, name: str) -> bool:
    try:
        core.read_namespaced_pod(name, namespace)
    except ApiException as exc:
        return exc.status == 404
    return False


def test_a_pod_runs_as_a_container_with_an_address_of_the_pod_network(devcluster, namespace, core):
    apply(devcluster, namespace, pod_manifest("web", server_container()))
    pod = ready_pod(core, namespace, "web")

    assert pod.spec.node_name == devcluster.node_name
    assert ipaddress.ip_address(pod.status.pod_ip) in ipaddress.ip_network(
        devcluster.config.pod_cidr
    )
    assert pod.status.host_ip == devcluster.node_ip
    (status,) = pod.status.container_statuses
    assert status.container_id.startswith("containerd://")
    assert status.image == BASE.name and status.ready
    # This machine reaches the pod's own address (the route through the node), and the process
    # inside sees the downward API and its own pid namespace.
    code, body = http_json(f"http://{pod.status.pod_ip}:8080/")
    assert code == 200 and body["pod"] == "web" and body["pid"] == 1
    node = client.CoreV1Api(devcluster.api_client()).read_node(devcluster.node_name)
    assert node.status.node_info.container_runtime_version.startswith("containerd://2.")
    assert node.status.node_info.kubelet_version == "v1.36.3"


def test_readiness_gate_holds_ready_until_its_condition_is_true(devcluster, namespace, core):
    apply(
        devcluster,
        namespace,
        pod_manifest("gated", server_container(), readinessGates=[{"conditionType": WARMED}]),
    )
    pod = wait_for(
        lambda: (
            (p := core.read_namespaced_pod("gated", namespace))
            and condition(p, "ContainersReady") == "True"
            and p
        ),
        "containers ready",
        90,
    )
    # kubelet: every container ready, but a gate condition is missing, so the pod is not Ready,
    # through several probe periods and status syncs.
    watched_until = time.monotonic() + 3
    while time.monotonic() < watched_until:
        assert condition(core.read_namespaced_pod("gated", namespace), "Ready") == "False"
        time.sleep(0.2)
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    core.patch_namespaced_pod_status(
        "gated",
        namespace,
        {"status": {"conditions": [{"type": WARMED, "status": "True", "lastTransitionTime": now}]}},
        _content_type=SMP,
    )
    pod = ready_pod(core, namespace, "gated", timeout=30)
    assert condition(pod, WARMED) == "True"
    # Later status updates by kubelet keep the operator's condition.
    assert {c.type for c in pod.status.conditions} >= {"Ready", "ContainersReady", WARMED}


def test_services_route_to_ready_pods_by_node_port_cluster_ip_and_dns(devcluster, namespace, core):
    ready = server_container()
    apply(devcluster, namespace, deployment_manifest("front", ready, replicas=1))
    never = server_container("--ready-after", "3600")
    never_ready = deployment_manifest("front-warming", never, replicas=1)
    never_ready["spec"]["template"]["metadata"]["labels"]["app"] = "front"
    never_ready["spec"]["selector"]["matchLabels"] = {"app": "front", "tier": "warming"}
    never_ready["spec"]["template"]["metadata"]["labels"]["tier"] = "warming"
    apply(devcluster, namespace, never_ready)
    apply(devcluster, namespace, nodeport_service("front"))
    service = core.read_namespaced_service("front", namespace)
    node_port = service.spec.ports[0].node_port

    def answering_pods() -> set[str]:
        pods = set()
        for _ in range(12):
            code, body = http_json(f"http://{devcluster.node_ip}:{node_port}/", timeout=3)
            if code == 200:
                pods.add(body["pod"])
        return pods

    served = wait_for(answering_pods, "kube-proxy to route the node port", 90)
    assert all(name.startswith("front-") and "warming" not in name for name in served), served

    # From inside the cluster: the Service's DNS name (CoreDNS) and its ClusterIP (kube-proxy).
    probe = (
        "import json, socket, urllib.request\n"
        f"address = socket.gethostbyname('front.{namespace}.svc.cluster.local')\n"
        "body = json.load(urllib.request.urlopen('http://front/', timeout=5))\n"
        "print(json.dumps({'address': address, 'pod': body['pod']}))\n"
    )
    client_pod = pod_manifest(
        "client",
        {
            "name": "client",
            "image": BASE.name,
            "imagePullPolicy": "Never",
            "command": ["python3", "-c", probe],
        },
        restartPolicy="Never",
    )
    apply(devcluster, namespace, client_pod)
    wait_for(
        lambda: core.read_namespaced_pod("client", namespace).status.phase == "Succeeded",
        "the client pod to finish",
        90,
    )
    answer = json.loads(core.read_namespaced_pod_log("client", namespace).strip())
    assert answer["address"] == service.spec.cluster_ip
    assert answer["pod"] in served


def test_failing_liveness_probe_restarts_the_container(devcluster, namespace, core):
    container = server_container("--fail-liveness-after", "2", liveness=True)
    apply(devcluster, namespace, pod_manifest("flaky", container))

    def restarted() -> bool:
        statuses = core.read_namespaced_pod("flaky", namespace).status.container_statuses
        return bool(statuses) and statuses[0].restart_count >= 1

    wait_for(restarted, "kubelet to restart the container", 90)
    events = core.list_namespaced_event(namespace, field_selector="involvedObject.name=flaky")
    reasons = {event.reason for event in events.items}
    assert {"Unhealthy", "Killing"} <= reasons, reasons


def test_logs_exec_and_metrics_reach_the_container(devcluster, namespace, core):
    apply(devcluster, namespace, pod_manifest("talk", server_container()))
    pod = ready_pod(core, namespace, "talk")
    http_json(f"http://{pod.status.pod_ip}:8080/")

    logs = devcluster.kubectl("-n", namespace, "logs", "talk").stdout
    assert "testserver 1 on 0.0.0.0:8080" in logs
    exec_result = devcluster.kubectl(
        "-n", namespace, "exec", "talk", "--", "python3", "-c", "import os; print(os.getuid())"
    )
    assert exec_result.stdout.strip() == "0"

    def top() -> str | None:
        result = devcluster.kubectl("-n", namespace, "top", "pod", "talk", "--no-headers",
                                    check=False)  # fmt: skip
        return result.stdout if result.returncode == 0 and "talk" in result.stdout else None

    line = wait_for(top, "metrics-server to report the pod (kubectl top)", 120, interval=2)
    _name, cpu, memory = line.split()
    assert cpu.endswith("m") and memory.endswith("Mi")


def pod_cgroup(devcluster, uid: str):
    """The pod's cgroup in the cpu hierarchy, which kubelet made below this cluster's root."""
    root = cgroups.V1_CPU / devcluster.config.cluster_name
    return next(group for group in root.rglob(f"pod{uid}") if group.is_dir())


def pids_in(group) -> set[int]:
    return {int(pid) for f in group.rglob("cgroup.procs") for pid in f.read_text().split()}


def test_a_cpu_limit_is_a_cfs_quota_on_the_pods_cgroup(devcluster, namespace, core):
    limited = server_container(resources={"requests": {"cpu": "250m"}, "limits": {"cpu": "500m"}})
    apply(devcluster, namespace, pod_manifest("limited", limited))
    pod = ready_pod(core, namespace, "limited")
    group = pod_cgroup(devcluster, pod.metadata.uid)
    assert (group / "cpu.cfs_quota_us").read_text().strip() == "50000"
    assert (group / "cpu.shares").read_text().strip() == "256"
    assert pids_in(group), "the container's processes run in the pod's cgroup"


def test_deleting_a_pod_stops_its_container_within_the_grace_period(devcluster, namespace, core):
    apply(devcluster, namespace, pod_manifest("brief", server_container()))
    pod = ready_pod(core, namespace, "brief")
    pids = pids_in(pod_cgroup(devcluster, pod.metadata.uid))
    assert pids
    started = time.monotonic()
    core.delete_namespaced_pod("brief", namespace)
    wait_for(lambda: gone(core, namespace, "brief"), "the pod to be deleted", 30)
    # The testserver exits on SIGTERM at once: well inside its 5 s grace period.
    assert time.monotonic() - started < 15
    assert not [pid for pid in pids if procs.pid_running(pid)]


def test_a_deployment_rolls_to_a_new_template(devcluster, namespace, core, apps):
    apply(devcluster, namespace, deployment_manifest("roll", server_container(), replicas=1))
    wait_for(
        lambda: (
            (apps.read_namespaced_deployment("roll", namespace).status.ready_replicas or 0) == 1
        ),
        "the first pod",
        90,
    )
    first = {
        p.metadata.name
        for p in core.list_namespaced_pod(namespace, label_selector="app=roll").items
    }
    changed = deployment_manifest("roll", server_container("--ready-after", "1"), replicas=1)
    apply(devcluster, namespace, changed)

    def rolled() -> bool:
        deployment = apps.read_namespaced_deployment("roll", namespace)
        pods = core.list_namespaced_pod(namespace, label_selector="app=roll").items
        names = {p.metadata.name for p in pods if not p.metadata.deletion_timestamp}
        return (
            deployment.status.updated_replicas == 1
            and deployment.status.ready_replicas == 1
            and names
            and not names & first
        )

    wait_for(rolled, "the rollout", 120)
