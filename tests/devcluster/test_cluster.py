"""The devcluster (cluster.py): up and down leave nothing behind, and the real node against the
real control plane: kubelet runs containers from the imported images (runc, CNI), probes and
readiness gates decide Ready, kube-proxy routes Services (node ports on the node's address,
ClusterIPs inside the node), CoreDNS answers Service names, metrics-server serves `kubectl top`,
and `kubectl logs`/`exec` reach the containers."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException
from support.pods import (
    condition,
    deployment_manifest,
    http_json,
    nodeport_service,
    pod_manifest,
    script_configmap,
    server_container,
)

from warmgate_contract.names import WARMED_CONDITION
from warmgate_devcluster import cgroups, kubeapi, procs
from warmgate_devcluster.cluster import (
    COMPONENTS,
    CONTROL_PLANE,
    NODE,
    DevCluster,
    mounts_under,
)
from warmgate_devcluster.images import BASE
from warmgate_devcluster.pytest_plugin import DevClusterHandle, isolated_config, reserve_slot
from warmgate_devcluster.testkit import audit_writes, describe_audit, wait_until

pytestmark = pytest.mark.cluster

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
    return wait_until(
        lambda: (
            (p := core.read_namespaced_pod(name, namespace))
            and condition(p, "Ready") == "True"
            and p
        ),
        timeout,
        f"pod {name} to be Ready",
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
        pod_manifest(
            "gated", server_container(), readinessGates=[{"conditionType": WARMED_CONDITION}]
        ),
    )
    pod = wait_until(
        lambda: (
            (p := core.read_namespaced_pod("gated", namespace))
            and condition(p, "ContainersReady") == "True"
            and p
        ),
        90,
        "containers ready",
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
        {
            "status": {
                "conditions": [
                    {"type": WARMED_CONDITION, "status": "True", "lastTransitionTime": now}
                ]
            }
        },
        _content_type=SMP,
    )
    pod = ready_pod(core, namespace, "gated", timeout=30)
    assert condition(pod, WARMED_CONDITION) == "True"
    # Later status updates by kubelet keep the operator's condition.
    assert {c.type for c in pod.status.conditions} >= {"Ready", "ContainersReady", WARMED_CONDITION}


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
            try:
                code, body = http_json(f"http://{devcluster.node_ip}:{node_port}/", timeout=3)
            except OSError:  # refused or timed out: not routed yet
                continue
            if code == 200:
                pods.add(body["pod"])
        return pods

    served = wait_until(answering_pods, 90, "kube-proxy to route the node port")
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
    wait_until(
        lambda: core.read_namespaced_pod("client", namespace).status.phase == "Succeeded",
        90,
        "the client pod to finish",
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

    wait_until(restarted, 90, "kubelet to restart the container")
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

    line = wait_until(top, 120, "metrics-server to report the pod (kubectl top)", every=2)
    _name, cpu, memory = line.split()
    assert cpu.endswith("m") and memory.endswith("Mi")


def test_the_audit_log_records_who_wrote_what_and_when(devcluster, namespace):
    """The apiserver's audit log answers "who wrote this?": each write with its verb, object,
    user agent and time; reads are not recorded."""
    started = time.time()
    devcluster.kubectl("-n", namespace, "create", "configmap", "audited", "--from-literal=a=1")
    devcluster.kubectl("-n", namespace, "get", "configmap", "audited")
    devcluster.kubectl("-n", namespace, "label", "configmap", "audited", "seen=yes")
    devcluster.kubectl("-n", namespace, "delete", "configmap", "audited")
    ended = time.time()
    mine = [
        e
        for e in audit_writes(
            devcluster.config.audit_log, started, ended, namespace, user_agents=("kubectl",)
        )
        if (e.get("objectRef") or {}).get("name") == "audited"
    ]
    assert [(e["verb"], e["objectRef"]["resource"]) for e in mine] == [
        ("create", "configmaps"),
        ("patch", "configmaps"),
        ("delete", "configmaps"),
    ], [describe_audit(e) for e in mine]
    assert all(e["responseStatus"]["code"] in (200, 201) for e in mine)
    # The window and the filters select: a later write is outside it, other clients are not
    # kubectl.
    devcluster.kubectl("-n", namespace, "create", "configmap", "later")

    def names(since: float, until: float, *agents: str) -> set[str]:
        events = audit_writes(devcluster.config.audit_log, since, until, namespace, agents)
        return {(e.get("objectRef") or {}).get("name") for e in events}

    assert "later" not in names(started, ended)
    assert "later" in names(ended, time.time())
    assert "audited" not in names(started, ended, "warmgate-operator")


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
    wait_until(lambda: gone(core, namespace, "brief"), 30, "the pod to be deleted")
    # The testserver exits on SIGTERM at once: well inside its 5 s grace period.
    assert time.monotonic() - started < 15
    assert not [pid for pid in pids if procs.pid_running(pid)]


def test_a_deployment_rolls_to_a_new_template(devcluster, namespace, core, apps):
    apply(devcluster, namespace, deployment_manifest("roll", server_container(), replicas=1))
    wait_until(
        lambda: (
            (apps.read_namespaced_deployment("roll", namespace).status.ready_replicas or 0) == 1
        ),
        90,
        "the first pod",
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

    wait_until(rolled, 120, "the rollout")


# ------------------------------------------------------------------ up and down
def cpu_group(pid: int) -> str:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _hierarchy, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return path.lstrip("/")
    raise AssertionError(f"pid {pid} is in no cpu cgroup")


def test_up_status_down_leave_nothing_behind(tmp_path, report):
    slot = reserve_slot()  # not the session cluster's network nor anyone else's
    # The cluster's own images only: this test needs no model server.
    cluster = DevCluster(isolated_config(tmp_path / "state", slot, app_images=False))
    config = cluster.config
    started = time.monotonic()
    try:
        assert cluster.up(log=lambda *_: None) is True
        start_seconds = time.monotonic() - started
        assert cluster.up(log=lambda *_: None) is False  # already running: left alone
        health = {item.name: item for item in cluster.status()}
        assert set(health) == set(COMPONENTS)
        assert all(item.running and item.healthy for item in health.values()), health
        # The control plane shares the machine at a small weight; the node does not.
        control_plane = cgroups.V1_CPU / config.control_plane_group
        assert (control_plane / "cpu.shares").read_text().strip() == "256"
        assert {cpu_group(health[name].pid) for name in CONTROL_PLANE} == {
            config.control_plane_group
        }
        assert {cpu_group(health[name].pid) for name in NODE} == {config.node_group}

        # A running pod, so that tear-down has a container, a shim and mounts to remove too.
        run_a_pod(cluster, "left")
        pids = cluster.all_pids()
        assert len(pids) > len(COMPONENTS) + 2  # + shims and containers (pause, the server)
        assert all(procs.pid_running(pid) for pid in pids)
        assert mounts_under(cluster.state_dir, config.run_dir)
    finally:
        cluster.down(log=lambda *_: None)
        slot.release()
    assert not [pid for pid in pids if procs.pid_running(pid)]
    assert not cluster.network.netns_path.exists()
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert cluster.network.host_link not in links
    assert not mounts_under(cluster.state_dir, config.run_dir, config.containerd_dir)
    for name in (config.cluster_name, config.node_group, config.control_plane_group):
        assert not (cgroups.V1_CPU / name).exists(), name
    assert cluster.down(log=lambda *_: None) is False
    report(f"devcluster start: {start_seconds:.1f}s")


def run_a_pod(cluster: DevCluster, name: str) -> None:
    """Apply a pod's manifests (kubectl, as a user would) and wait until its container runs."""
    cluster.kubectl("apply", "-f", "-", input=json.dumps(script_configmap()))
    cluster.kubectl("apply", "-f", "-", input=json.dumps(pod_manifest(name, server_container())))
    path = kubeapi.resource_path("v1", "pods", "default", name)

    with cluster.api_client() as api:

        def running() -> bool:
            pod = kubeapi.read(api, path) or {}
            statuses = (pod.get("status") or {}).get("containerStatuses") or [{}]
            return bool(statuses[0].get("ready"))

        wait_until(running, 90, f"pod {name} to run")


def test_the_next_up_removes_what_a_killed_cluster_left(tmp_path):
    """A session killed without `down` (a machine restart, kill -9 of the test run) leaves its
    node's namespace, the route to its pods, mounts and cgroups behind; the next cluster on
    the same addresses must come up anyway and remove them."""
    slot = reserve_slot()
    killed = DevCluster(isolated_config(tmp_path / "k", slot, app_images=False))
    following = DevCluster(isolated_config(tmp_path / "f", slot, app_images=False))
    try:
        killed.up(log=lambda *_: None)
        run_a_pod(killed, "orphan")

        # One component dying mid-session (kube-proxy here) breaks the cluster for the tests
        # after it: the next test that needs it fails at once, naming the component, and the
        # one after that without checking again, instead of each waiting out its own timeout.
        handle = DevClusterHandle.of(killed)
        os.kill(killed.records()["kube-proxy"].pid, signal.SIGKILL)
        with pytest.raises(pytest.fail.Exception, match="kube-proxy not running") as first:
            handle.require_healthy(before="the next test", grace=2)
        assert "the next test" in str(first.value) and "free disk" in str(first.value)
        began = time.monotonic()
        with pytest.raises(pytest.fail.Exception) as second:
            handle.require_healthy(before="the test after it")
        assert str(second.value) == str(first.value) and time.monotonic() - began < 1
        # A failed test's report shows the cluster: the dead component, the pods.
        snapshot = handle.snapshot()
        assert "kube-proxy not running" in snapshot and "pods not running and ready" in snapshot

        for _ in range(10):  # kubelet or a shim may start something while the others die
            pids = killed.all_pids()
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            wait_until(lambda p=pids: not any(procs.pid_running(x) for x in p), 10, "the kill")
        assert not killed.all_pids()
        # What the killed cluster left: its namespace, the route to its pods, mounts, cgroups.
        assert killed.network.netns_path.exists()
        assert mounts_under(killed.state_dir, killed.config.run_dir)
        assert (cgroups.V1_CPU / killed.config.node_group).exists()

        messages: list[str] = []
        assert following.up(log=messages.append) is True
        reaped = [m for m in messages if "abandoned devcluster" in m]
        assert reaped and str(killed.state_dir) in reaped[0], messages
        assert all(item.healthy for item in following.status())
        assert not killed.network.netns_path.exists()
        assert not mounts_under(killed.state_dir, killed.config.run_dir)
        for name in (killed.config.cluster_name, killed.config.node_group):
            assert not (cgroups.V1_CPU / name).exists(), name
        run_a_pod(following, "after")
    finally:
        following.down(log=lambda *_: None)
        killed.down(log=lambda *_: None)
        slot.release()


def test_cli_status_and_kubeconfig(tmp_path):
    run = [sys.executable, "-m", "warmgate_devcluster", "--state-dir", str(tmp_path)]
    result = subprocess.run([*run, "kubeconfig"], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == str(tmp_path / "kubeconfig")
    result = subprocess.run([*run, "status"], capture_output=True, text=True)
    assert result.returncode == 1 and "not running" in result.stdout
