"""The devcluster against the real control-plane binaries: scheduling, probes, readiness
gates, EndpointSlices, the service proxy, restarts, termination and rolling updates."""

from __future__ import annotations

import ipaddress
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from dc_helpers import (
    CGROUPS_WRITABLE,
    NO_CGROUPS,
    condition,
    container_pid,
    cpu_cgroup,
    deployment_manifest,
    http_json,
    nodeport_service,
    pod_manifest,
    server_container,
    wait_for,
)
from kubernetes import client
from kubernetes.client.rest import ApiException

from warmgate_devcluster import procs

pytestmark = pytest.mark.cluster

WARMED = "warmgate.dev/warmed"
# The generated client defaults PATCH bodies to JSON Patch; ours are strategic merge patches.
SMP = "application/strategic-merge-patch+json"


@pytest.fixture
def core(devcluster):
    return client.CoreV1Api(devcluster.api_client())


@pytest.fixture
def apps(devcluster):
    return client.AppsV1Api(devcluster.api_client())


@pytest.fixture
def discovery(devcluster):
    return client.DiscoveryV1Api(devcluster.api_client())


def slice_endpoints(discovery, namespace: str, service: str) -> dict[str, dict]:
    """pod name -> {"ready": bool, "address": str} across the Service's EndpointSlices."""
    slices = discovery.list_namespaced_endpoint_slice(
        namespace, label_selector=f"kubernetes.io/service-name={service}"
    ).items
    found = {}
    for item in slices:
        for endpoint in item.endpoints or []:
            found[endpoint.target_ref.name] = {
                "ready": bool(endpoint.conditions.ready),
                "address": endpoint.addresses[0],
            }
    return found


def pods_of(core, namespace: str, app: str):
    return core.list_namespaced_pod(namespace, label_selector=f"app={app}").items


def ready_pod(core, namespace: str, name: str):
    """The pod once Ready (so its server runs and has installed its signal handlers)."""
    return wait_for(
        lambda: (
            (p := core.read_namespaced_pod(name, namespace))
            and condition(p, "Ready") == "True"
            and p
        ),
        f"pod {name} to be Ready",
    )


def gone(core, namespace: str, name: str) -> bool:
    try:
        core.read_namespaced_pod(name, namespace)
    except ApiException as exc:
        return exc.status == 404
    return False


def test_deployment_becomes_ready_after_probe_and_is_routed(
    devcluster, namespace, core, apps, discovery
):
    container = server_container(
        "--ready-after",
        "3",
        env=[
            {"name": "MY_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "MY_NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "GREETING", "value": "hello $(MY_NS)"},
        ],
    )
    apps.create_namespaced_deployment(namespace, deployment_manifest("web", container))
    service = core.create_namespaced_service(namespace, nodeport_service("web"))
    node_port = service.spec.ports[0].node_port

    # The real scheduler binds it to our node; the agent runs it and reports a loopback IP.
    pod = wait_for(
        lambda: next(
            (
                p
                for p in pods_of(core, namespace, "web")
                if p.status.pod_ip and p.status.phase == "Running"
            ),
            None,
        ),
        "the pod to run",
    )
    assert pod.spec.node_name == devcluster.node_name
    ip = ipaddress.ip_address(pod.status.pod_ip)
    assert ip.is_loopback and pod.status.pod_ip != "127.0.0.1"
    assert pod.status.host_ip == "127.0.0.1"
    pid = container_pid(pod)
    assert pid and procs.pid_running(pid)

    # Not Ready while /ready answers 503, and no ready endpoint for it meanwhile.
    saw_unready_endpoint = False
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        pod = core.read_namespaced_pod(pod.metadata.name, namespace)
        endpoints = slice_endpoints(discovery, namespace, "web")
        pod_ready = condition(pod, "Ready") == "True"
        entry = endpoints.get(pod.metadata.name)
        if entry and entry["ready"]:
            # The endpoint turns ready only after the pod did (read just before).
            assert (
                pod_ready
                or condition(core.read_namespaced_pod(pod.metadata.name, namespace), "Ready")
                == "True"
            )
            break
        if not pod_ready:
            saw_unready_endpoint = True
        time.sleep(0.1)
    else:
        raise AssertionError("the EndpointSlice never listed the pod as ready")
    assert saw_unready_endpoint, "the pod was Ready before its readiness probe could pass"
    pod = core.read_namespaced_pod(pod.metadata.name, namespace)
    started = pod.status.container_statuses[0].state.running.started_at
    ready_at = next(c.last_transition_time for c in pod.status.conditions if c.type == "Ready")
    assert (ready_at - started).total_seconds() >= 2  # --ready-after 3, whole-second stamps
    assert pod.status.container_statuses[0].ready
    assert endpoints[pod.metadata.name]["address"] == pod.status.pod_ip

    # The service proxy routes real HTTP to it, and the env came from the downward API.
    status, body = wait_for(
        lambda: http_json(f"http://127.0.0.1:{node_port}/"), "the proxy to answer"
    )
    assert status == 200 and body["pod"] == pod.metadata.name
    status, env = http_json(f"http://127.0.0.1:{node_port}/env")
    assert env["MY_IP"] == pod.status.pod_ip == env["POD_IP"]
    assert env["POD_NAME"] == pod.metadata.name
    assert env["GREETING"] == f"hello {namespace}"


def test_service_without_ready_endpoints_refuses(devcluster, namespace, core):
    container = server_container("--ready-after", "3600")
    core.create_namespaced_pod(namespace, pod_manifest("never", container))
    service = core.create_namespaced_service(namespace, nodeport_service("never"))
    wait_for(
        lambda: (p := core.read_namespaced_pod("never", namespace)).status.phase == "Running" and p,
        "the pod to run",
    )
    url = f"http://127.0.0.1:{service.spec.ports[0].node_port}/"

    def refused() -> bool:
        try:
            urllib.request.urlopen(url, timeout=3)
        except (urllib.error.URLError, ConnectionError, OSError):
            return True
        return False

    assert wait_for(refused, "a connection to be refused")
    assert condition(core.read_namespaced_pod("never", namespace), "Ready") == "False"


def test_failing_liveness_probe_restarts_the_process(devcluster, namespace, core):
    container = server_container("--fail-liveness-after", "2", liveness=True, readiness=False)
    container["livenessProbe"]["initialDelaySeconds"] = 1  # the server binds in ~0.2s
    core.create_namespaced_pod(namespace, pod_manifest("sick", container))
    first = wait_for(
        lambda: container_pid(core.read_namespaced_pod("sick", namespace)), "the first process"
    )

    def restarted_twice():
        pod = core.read_namespaced_pod("sick", namespace)
        status = pod.status.container_statuses[0]
        return pod if status.restart_count >= 2 and status.last_state.terminated else None

    pod = wait_for(restarted_twice, "two restarts", timeout=60)
    terminated = pod.status.container_statuses[0].last_state.terminated
    assert terminated.finished_at >= terminated.started_at
    assert container_pid(pod) != first
    assert not procs.pid_running(first)
    events = core.list_namespaced_event(namespace, field_selector="involvedObject.name=sick")
    assert any(e.reason == "Killing" and "liveness" in e.message for e in events.items)


def test_exited_container_restarts_with_backoff(devcluster, namespace, core):
    container = {"name": "crash", "image": "busybox", "command": ["sh", "-c", "exit 3"]}
    core.create_namespaced_pod(namespace, pod_manifest("crash", container))

    def crash_looping():
        pod = core.read_namespaced_pod("crash", namespace)
        statuses = pod.status.container_statuses or []
        return statuses and statuses[0].restart_count >= 2 and statuses[0].last_state.terminated

    terminated = wait_for(crash_looping, "a crash loop", timeout=60)
    assert terminated.exit_code == 3 and terminated.reason == "Error"


def test_readiness_gate_holds_ready_until_condition_true(devcluster, namespace, core):
    container = server_container()
    core.create_namespaced_pod(
        namespace, pod_manifest("gated", container, readinessGates=[{"conditionType": WARMED}])
    )

    pod = wait_for(
        lambda: (
            (p := core.read_namespaced_pod("gated", namespace))
            and condition(p, "ContainersReady") == "True"
            and p
        ),
        "the container to be ready",
    )
    ready = next(c for c in pod.status.conditions if c.type == "Ready")
    assert ready.status == "False" and ready.reason == "ReadinessGatesNotReady"
    # It stays so while the gate condition is absent.
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        assert condition(core.read_namespaced_pod("gated", namespace), "Ready") == "False"
        time.sleep(0.2)

    def set_gate(status: str) -> None:
        core.patch_namespaced_pod_status(
            "gated",
            namespace,
            {"status": {"conditions": [{"type": WARMED, "status": status, "reason": "Test"}]}},
            _content_type=SMP,
        )

    set_gate("True")
    pod = wait_for(
        lambda: (
            (p := core.read_namespaced_pod("gated", namespace))
            and condition(p, "Ready") == "True"
            and p
        ),
        "Ready after the gate turned True",
    )
    assert condition(pod, WARMED) == "True"  # the agent kept the operator's condition
    set_gate("False")
    wait_for(
        lambda: condition(core.read_namespaced_pod("gated", namespace), "Ready") == "False",
        "not Ready after the gate turned False",
    )
    assert condition(core.read_namespaced_pod("gated", namespace), WARMED) == "False"


def test_deleting_a_pod_sends_sigterm_and_the_process_is_gone(
    devcluster, namespace, core, tmp_path: Path
):
    marker = tmp_path / "term"
    container = server_container("--term-marker", str(marker))
    container["lifecycle"] = {"preStop": {"exec": {"command": ["sleep", "1"]}}}
    core.create_namespaced_pod(namespace, pod_manifest("victim", container))
    pid = container_pid(ready_pod(core, namespace, "victim"))
    started = time.monotonic()
    core.delete_namespaced_pod("victim", namespace)
    wait_for(lambda: gone(core, namespace, "victim"), "the pod object to be removed")
    assert time.monotonic() - started >= 1  # preStop ran first
    assert marker.read_text().strip() == f"SIGTERM {pid}"
    assert not procs.pid_running(pid)


def test_grace_period_ends_with_sigkill(devcluster, namespace, core, tmp_path: Path):
    marker = tmp_path / "term"
    container = server_container("--term-marker", str(marker), "--term-delay", "60")
    manifest = pod_manifest("stubborn", container)
    manifest["spec"]["terminationGracePeriodSeconds"] = 2
    core.create_namespaced_pod(namespace, manifest)
    pid = container_pid(ready_pod(core, namespace, "stubborn"))
    started = time.monotonic()
    core.delete_namespaced_pod("stubborn", namespace)
    wait_for(lambda: gone(core, namespace, "stubborn"), "the pod object to be removed", 30)
    elapsed = time.monotonic() - started
    assert 1.5 <= elapsed < 20
    assert marker.read_text().startswith("SIGTERM")
    assert not procs.pid_running(pid)


def test_configmap_volume_is_mounted_and_refreshed(devcluster, namespace, core):
    core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "conf"}, "data": {"greeting": "hello", "ignored": "x"}}
    )
    container = server_container(
        readiness=False, env=[{"name": "CONF_FILE", "value": "/etc/conf/app/greeting.txt"}]
    )
    container["volumeMounts"] = [{"name": "conf", "mountPath": "/etc/conf"}]
    core.create_namespaced_pod(
        namespace,
        pod_manifest(
            "mounted",
            container,
            volumes=[
                {
                    "name": "conf",
                    "configMap": {
                        "name": "conf",
                        "items": [{"key": "greeting", "path": "app/greeting.txt"}],
                    },
                }
            ],
        ),
    )
    pod = ready_pod(core, namespace, "mounted")
    _, env = wait_for(
        lambda: http_json(f"http://{pod.status.pod_ip}:8080/env"), "the server to answer"
    )
    host_path = Path(env["CONF_FILE"])
    assert host_path != Path("/etc/conf/app/greeting.txt")
    assert host_path.read_text() == "hello"
    assert not (host_path.parent.parent / "ignored").exists()
    core.patch_namespaced_config_map(
        "conf", namespace, {"data": {"greeting": "bonjour"}}, _content_type=SMP
    )
    wait_for(lambda: host_path.read_text() == "bonjour", "the file to follow the ConfigMap")


def test_rolling_update_keeps_a_ready_endpoint(devcluster, namespace, core, apps, discovery):
    container = server_container("--ready-after", "1", "--term-delay", "1")
    deployment = deployment_manifest(
        "roll",
        container,
        replicas=2,
        strategy={"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
    )
    apps.create_namespaced_deployment(namespace, deployment)
    node_port = (
        core.create_namespaced_service(namespace, nodeport_service("roll")).spec.ports[0].node_port
    )

    def ready_count() -> int:
        return sum(e["ready"] for e in slice_endpoints(discovery, namespace, "roll").values())

    wait_for(lambda: ready_count() == 2, "two ready endpoints", 60)
    before = {p.metadata.name for p in pods_of(core, namespace, "roll")}

    samples: list[int] = []
    failures: list[str] = []
    served_by: set[str] = set()
    stop = threading.Event()

    def watch_endpoints() -> None:
        while not stop.is_set():
            samples.append(ready_count())
            try:
                status, body = http_json(f"http://127.0.0.1:{node_port}/", timeout=5)
                served_by.add(body.get("pod", ""))
                if status != 200:
                    failures.append(f"status {status}")
            except Exception as exc:
                failures.append(repr(exc))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch_endpoints, daemon=True)
    watcher.start()
    try:
        apps.patch_namespaced_deployment(
            "roll",
            namespace,
            {"spec": {"template": {"metadata": {"annotations": {"rollout": "2"}}}}},
            _content_type=SMP,
        )

        def rolled_out() -> bool:
            current = apps.read_namespaced_deployment("roll", namespace)
            names = {p.metadata.name for p in pods_of(core, namespace, "roll")}
            return (
                current.status.updated_replicas == 2
                and current.status.ready_replicas == 2
                and current.status.replicas == 2
                and not names & before
                and ready_count() == 2
            )

        wait_for(rolled_out, "the rollout to finish", 120)
    finally:
        stop.set()
        watcher.join(10)
    assert samples and min(samples) >= 1, f"ready endpoints dropped to {min(samples)}"
    assert not failures, failures[:5]
    assert served_by & before and served_by - before  # old pods served, then new ones


def test_startup_probe_gates_liveness_and_tcp_readiness(devcluster, namespace, core):
    container = server_container("--ready-after", "2", readiness=False)
    # Liveness on /ready would kill the server during its first 2s, were it not gated.
    container["startupProbe"] = {
        "httpGet": {"path": "/ready", "port": "http"},
        "periodSeconds": 1,
        "failureThreshold": 10,
    }
    container["livenessProbe"] = {
        "httpGet": {"path": "/ready", "port": 8080},
        "periodSeconds": 1,
        "failureThreshold": 1,
    }
    container["readinessProbe"] = {"tcpSocket": {"port": "http"}, "periodSeconds": 1}
    core.create_namespaced_pod(namespace, pod_manifest("slow", container))
    early = wait_for(
        lambda: (
            (p := core.read_namespaced_pod("slow", namespace))
            and (p.status.container_statuses or [None])[0]
            and p.status.container_statuses[0].state.running
            and p
        ),
        "the container to run",
    )
    assert early.status.container_statuses[0].started is False
    pod = ready_pod(core, namespace, "slow")
    status = pod.status.container_statuses[0]
    assert status.started and status.ready and status.restart_count == 0


def test_init_container_prepares_an_empty_dir(devcluster, namespace, core):
    init = {
        "name": "prepare",
        "image": "busybox",
        # The path is an argument of its own: only whole arguments are rewritten.
        "command": ["sh", "-c", 'echo "prepared-by-$POD_NAME" > "$1"', "sh", "/work/state.txt"],
        "volumeMounts": [{"name": "work", "mountPath": "/work"}],
    }
    container = server_container(env=[{"name": "STATE", "value": "/work/state.txt"}])
    container["volumeMounts"] = [{"name": "work", "mountPath": "/work"}]
    core.create_namespaced_pod(
        namespace,
        pod_manifest(
            "init", container, initContainers=[init], volumes=[{"name": "work", "emptyDir": {}}]
        ),
    )
    pod = ready_pod(core, namespace, "init")
    assert condition(pod, "Initialized") == "True"
    assert pod.status.init_container_statuses[0].state.terminated.exit_code == 0
    _, env = wait_for(lambda: http_json(f"http://{pod.status.pod_ip}:8080/env"), "the server")
    status, body = http_json(f"http://{pod.status.pod_ip}:8080/file?path={env['STATE']}")
    assert status == 200 and body["content"].strip() == "prepared-by-init"


@pytest.mark.skipif(not CGROUPS_WRITABLE, reason=NO_CGROUPS)
def test_each_pod_gets_a_cpu_cgroup_with_kubelet_shares_and_quota(devcluster, namespace, core):
    limited = server_container()
    limited["resources"] = {"requests": {"cpu": "500m"}, "limits": {"cpu": "1500m"}}
    core.create_namespaced_pod(namespace, pod_manifest("limited", limited))
    core.create_namespaced_pod(namespace, pod_manifest("besteffort", server_container()))
    groups = {}
    for name in ("limited", "besteffort"):
        pod = ready_pod(core, namespace, name)
        group = cpu_cgroup(container_pid(pod))
        assert group is not None and group.name == pod.metadata.uid, group
        groups[name] = group
    # kubelet: shares = request x 1024 per CPU (at least 2); quota = limit x the 100 ms period.
    assert (groups["limited"] / "cpu.shares").read_text().strip() == "512"
    assert (groups["limited"] / "cpu.cfs_quota_us").read_text().strip() == "150000"
    assert (groups["besteffort"] / "cpu.shares").read_text().strip() == "2"
    assert (groups["besteffort"] / "cpu.cfs_quota_us").read_text().strip() == "-1"
    assert groups["limited"].parent == groups["besteffort"].parent  # the cluster's "kubepods"

    core.delete_namespaced_pod("limited", namespace)
    wait_for(lambda: gone(core, namespace, "limited"), "the pod object to be removed")
    wait_for(lambda: not groups["limited"].exists(), "the pod's cgroup to be removed")
    assert groups["besteffort"].exists()
