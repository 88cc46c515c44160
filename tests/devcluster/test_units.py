"""Pure parts of the devcluster: pod spec translation, pod status, EndpointSlices, proxy
endpoint choice, image map. No cluster needed."""

from __future__ import annotations

import datetime as dt
import json
from decimal import Decimal

import pytest

from warmgate_devcluster import podspec
from warmgate_devcluster.config import ClusterConfig
from warmgate_devcluster.endpointslices import desired_slices
from warmgate_devcluster.imagemap import ImageMap, repository_of
from warmgate_devcluster.podstatus import ContainerView, PodView, pod_phase, status_patch
from warmgate_devcluster.proxy import listeners_for, ready_endpoints
from warmgate_devcluster.runtime import sleep_seconds

NOW = dt.datetime(2026, 11, 29, 22, 0, tzinfo=dt.UTC)


def pod(**spec) -> dict:
    return {
        "metadata": {"name": "p", "namespace": "ns", "uid": "u1", "labels": {"app": "a"}},
        "spec": {"containers": [{"name": "c", "image": "x"}], **spec},
        "status": {},
    }


def test_quantities():
    assert podspec.parse_quantity("500m") == Decimal("0.5")
    assert podspec.parse_quantity("1Gi") == 2**30
    assert podspec.parse_quantity("2") == 2
    with pytest.raises(ValueError):
        podspec.parse_quantity("lots")


def test_env_expansion_downward_api_and_references():
    container = {
        "name": "c",
        "resources": {"limits": {"memory": "1Gi"}},
        "env": [
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
            {
                "name": "MEM",
                "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}},
            },
            {"name": "CPU", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
            {"name": "URL", "value": "http://$(IP):80/$$(IP)/$(NOPE)"},
            {"name": "KEY", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "k"}}},
        ],
    }
    configmaps = {("ns", "cm"): {"data": {"k": "v"}}}
    env = podspec.container_env(
        pod(),
        container,
        pod_ip="127.0.16.3",
        host_ip="127.0.0.1",
        base={"PATH": "/bin"},
        configmaps=lambda ns, n: configmaps.get((ns, n)),
        secrets=lambda ns, n: None,
        node_allocatable={"cpu": "16"},
    )
    assert env["IP"] == "127.0.16.3" and env["NAME"] == "p" and env["APP"] == "a"
    assert env["MEM"] == "1024" and env["CPU"] == "16"
    assert env["URL"] == "http://127.0.16.3:80/$(IP)/$(NOPE)"
    assert env["KEY"] == "v" and env["PATH"] == "/bin"
    with pytest.raises(podspec.MissingReference):
        podspec.container_env(
            pod(),
            container,
            pod_ip="",
            host_ip="",
            base={},
            configmaps=lambda ns, n: None,
            secrets=lambda ns, n: None,
            node_allocatable={"cpu": "1"},
        )


def test_command_and_args_follow_kubernetes_semantics():
    image = {"command": ["python", "-m", "server"], "args": ["--default"]}
    assert podspec.container_argv({}, image, {}) == ["python", "-m", "server", "--default"]
    assert podspec.container_argv({"args": ["--port", "$(P)"]}, image, {"P": "80"}) == [
        "python",
        "-m",
        "server",
        "--port",
        "80",
    ]
    assert podspec.container_argv({"command": ["sleep"], "args": ["5"]}, image, {}) == [
        "sleep",
        "5",
    ]
    assert podspec.container_argv({"command": ["sleep"]}, image, {}) == ["sleep"]


def test_only_the_pods_words_are_rewritten():
    container = {
        "args": ["/work/in.txt"],
        "env": [{"name": "OUT", "value": "/work/out"}],
        "volumeMounts": [{"name": "w", "mountPath": "/work"}],
    }
    table = podspec.mount_table(container, {"w": "/state/w"})
    base = {"PYTHONPATH": "/work/main/devcluster"}
    env = podspec.container_env(
        pod(),
        container,
        pod_ip="",
        host_ip="",
        base=base,
        configmaps=lambda ns, n: None,
        secrets=lambda ns, n: None,
        node_allocatable={},
        mounts=table,
    )
    assert env == {"PYTHONPATH": "/work/main/devcluster", "OUT": "/state/w/out"}
    image = {"command": ["/work/main/.venv/bin/python", "-m", "x"]}
    assert podspec.container_argv(container, image, env, table) == [
        "/work/main/.venv/bin/python",
        "-m",
        "x",
        "/state/w/in.txt",
    ]


def test_mount_paths_are_rewritten_to_host_folders():
    container = {
        "volumeMounts": [
            {"name": "cfg", "mountPath": "/etc/app"},
            {"name": "deep", "mountPath": "/etc/app/deep"},
        ]
    }
    table = podspec.mount_table(container, {"cfg": "/s/cfg", "deep": "/s/deep"})
    assert podspec.rewrite("/etc/app/x.yaml", table) == "/s/cfg/x.yaml"
    assert podspec.rewrite("/etc/app/deep/y", table) == "/s/deep/y"
    assert podspec.rewrite("--profile=/etc/app/p.json", table) == "--profile=/s/cfg/p.json"
    assert podspec.rewrite("/etc/application", table) == "/etc/application"


def ready_view(ready: bool = True) -> PodView:
    container = ContainerView(
        name="c",
        image="x",
        state={"running": {"startedAt": "t"}},
        started=True,
        ready=ready,
        ever_started=True,
    )
    return PodView(
        pod_ip="127.0.16.2",
        host_ip="127.0.0.1",
        start_time="t",
        network_ready=True,
        initialized=True,
        init_failed=False,
        containers=[container],
        init_containers=[],
    )


def conditions(patch: dict) -> dict[str, dict]:
    return {c["type"]: c for c in patch["status"]["conditions"]}


def test_ready_waits_for_containers_and_readiness_gates():
    gated = pod(readinessGates=[{"conditionType": "warmgate.dev/warmed"}])
    memory: dict = {}
    patch = status_patch(gated, ready_view(False), NOW, memory)
    assert conditions(patch)["Ready"]["reason"] == "ContainersNotReady"
    patch = status_patch(gated, ready_view(True), NOW, memory)
    ready = conditions(patch)["Ready"]
    assert ready["status"] == "False" and ready["reason"] == "ReadinessGatesNotReady"
    assert conditions(patch)["ContainersReady"]["status"] == "True"
    gated["status"]["conditions"] = [{"type": "warmgate.dev/warmed", "status": "True"}]
    patch = status_patch(gated, ready_view(True), NOW, memory)
    assert conditions(patch)["Ready"]["status"] == "True"
    # Only the agent's own conditions are patched, and stale reasons are cleared.
    assert "warmgate.dev/warmed" not in conditions(patch)
    assert conditions(patch)["Ready"]["reason"] is None
    assert patch["metadata"]["uid"] == "u1" and patch["status"]["podIP"] == "127.0.16.2"


def test_transition_time_kept_while_status_unchanged():
    memory: dict = {}
    first = conditions(status_patch(pod(), ready_view(True), NOW, memory))
    later = NOW + dt.timedelta(minutes=5)
    second = conditions(status_patch(pod(), ready_view(True), later, memory))
    assert first["Ready"]["lastTransitionTime"] == second["Ready"]["lastTransitionTime"]
    third = conditions(status_patch(pod(), ready_view(False), later, memory))
    assert third["Ready"]["lastTransitionTime"] != first["Ready"]["lastTransitionTime"]


def test_phase():
    view = ready_view()
    assert pod_phase(view) == "Running"
    done = ContainerView(
        name="c", image="x", state={"terminated": {"exitCode": 0}}, ever_started=True, final=True
    )
    assert pod_phase(PodView("", "", "", True, True, False, [done], [])) == "Succeeded"
    failed = ContainerView(
        name="c", image="x", state={"terminated": {"exitCode": 2}}, ever_started=True, final=True
    )
    assert pod_phase(PodView("", "", "", True, True, False, [failed], [])) == "Failed"
    waiting = ContainerView(name="c", image="x")
    assert pod_phase(PodView("", "", "", True, True, False, [waiting], [])) == "Pending"


def endpoint_pod(name: str, ip: str, ready: bool, deleting: bool = False) -> dict:
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": name,
            "labels": {"app": "a"},
            **({"deletionTimestamp": "t"} if deleting else {}),
        },
        "spec": {
            "nodeName": "n",
            "containers": [{"name": "c", "ports": [{"name": "http", "containerPort": 8080}]}],
        },
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


SERVICE = {
    "metadata": {"name": "svc", "namespace": "ns", "uid": "s1"},
    "spec": {
        "type": "NodePort",
        "selector": {"app": "a"},
        "ports": [
            {"name": "web", "port": 80, "targetPort": "http", "nodePort": 30123, "protocol": "TCP"}
        ],
    },
}


def test_desired_slices_follow_pod_readiness():
    pods = [
        endpoint_pod("a", "127.0.16.1", True),
        endpoint_pod("b", "127.0.16.2", False),
        endpoint_pod("c", "127.0.16.3", True, deleting=True),
        {
            **endpoint_pod("d", "127.0.16.4", True),
            "metadata": {"name": "d", "namespace": "ns", "uid": "d", "labels": {"app": "other"}},
        },
    ]
    (slice_,) = desired_slices(SERVICE, pods)
    assert slice_["addressType"] == "FQDN"
    assert slice_["ports"] == [{"name": "web", "port": 8080, "protocol": "TCP"}]
    assert slice_["metadata"]["labels"]["kubernetes.io/service-name"] == "svc"
    by_name = {e["targetRef"]["name"]: e["conditions"] for e in slice_["endpoints"]}
    assert by_name == {
        "a": {"ready": True, "serving": True, "terminating": False},
        "b": {"ready": False, "serving": False, "terminating": False},
        "c": {"ready": False, "serving": True, "terminating": True},
    }
    (empty,) = desired_slices(SERVICE, [])
    assert empty["endpoints"] == [] and empty["ports"] == []


def test_proxy_listens_on_node_ports_and_picks_ready_loopback_endpoints():
    assert listeners_for([SERVICE]) == {30123: ("ns/svc", "web")}
    slices = desired_slices(
        SERVICE,
        [
            endpoint_pod("a", "127.0.16.1", True),
            endpoint_pod("b", "127.0.16.2", False),
            endpoint_pod("e", "10.1.2.3", True),
        ],
    )
    for item in slices:
        item["metadata"]["labels"] = {"kubernetes.io/service-name": "svc"}
    assert ready_endpoints(slices, "ns/svc", "web") == [("127.0.16.1", 8080)]
    assert ready_endpoints(slices, "ns/svc", "other") == []


def test_image_map():
    images = ImageMap.from_config(None, None)
    server = images.resolve("ghcr.io/acme/warmgate-server:1.0")
    assert server["command"][1:] == ["-m", "warmgate_server"]
    assert server["env"]["HF_HUB_OFFLINE"] == "1"
    assert images.resolve("warmgate.dev/testserver")["command"][-1] == (
        "warmgate_devcluster.testserver"
    )
    assert images.resolve("nginx:1.27") is None
    assert repository_of("localhost:5000/a/b:tag@sha256:00") == "localhost:5000/a/b"


def test_image_map_file_entries_come_first(tmp_path):
    path = tmp_path / "images.yaml"
    path.write_text("- match: warmgate-server\n  kind: suffix\n  command: [echo, hi]\n")
    assert ImageMap.from_config(path, None).resolve("x/warmgate-server")["command"] == [
        "echo",
        "hi",
    ]


def test_pre_stop_sleep_is_recognised():
    assert sleep_seconds(["sleep", "5"]) == 5
    assert sleep_seconds(["/bin/sh", "-c", "sleep 2.5"]) == 2.5
    assert sleep_seconds(["sh", "-c", "echo; sleep 1"]) is None


def test_config_rejects_bad_blocks():
    with pytest.raises(ValueError, match=r"127\.0\.0\.0/8"):
        ClusterConfig(pod_cidr="10.0.0.0/20")
    with pytest.raises(ValueError, match=r"127\.0\.0\.1"):
        ClusterConfig(pod_cidr="127.0.0.0/16")
    with pytest.raises(ValueError, match="node_port_range"):
        ClusterConfig(node_port_range="30000")
    with pytest.raises(ValueError, match="control_plane_cpu_shares"):
        ClusterConfig(control_plane_cpu_shares=-1)


def test_control_plane_weight_comes_from_the_environment_as_a_number(tmp_path):
    environ = {"WARMGATE_DEVCLUSTER_CONTROL_PLANE_CPU_SHARES": "0"}
    config = ClusterConfig.from_env(environ, state_dir=tmp_path)
    assert config.control_plane_cpu_shares == 0  # no cgroup of its own
    # the agents read the configuration back from cluster.json
    again = ClusterConfig.from_dict(json.loads(ClusterConfig(state_dir=tmp_path).to_json()))
    assert again.control_plane_cpu_shares == 256


def test_pod_ips_are_unique_loopback_addresses_and_reused_last():
    from warmgate_devcluster.agent import LoopbackIpam

    ipam = LoopbackIpam("127.0.16.0/24")
    first, second = ipam.allocate(), ipam.allocate()
    assert first != second and first.startswith("127.0.16.") and first != "127.0.16.0"
    ipam.release(first)
    third = ipam.allocate()
    assert third not in (first, second)
    for _ in range(252):  # 254 host addresses in a /24, two in use
        ipam.allocate()
    with pytest.raises(RuntimeError):
        ipam.allocate()


def test_cpu_quantities_and_pod_cpu_as_kubelet_sums_them() -> None:
    from warmgate_devcluster.cgroups import cpu_millis, pod_cpu, quota_for, shares_for

    assert [cpu_millis(q) for q in ("100m", "1", "1.5", 2, "0.25")] == [100, 1000, 1500, 2000, 250]
    with pytest.raises(ValueError, match="not a CPU quantity"):
        cpu_millis("one")

    def pod(*resources: dict) -> dict:
        return {"spec": {"containers": [{"name": f"c{i}", "resources": r}
                                        for i, r in enumerate(resources)]}}  # fmt: skip

    assert pod_cpu(pod({})) == (0, None)
    assert pod_cpu(pod({"limits": {"cpu": "2"}})) == (2000, 2000)  # request defaults to limit
    both = {"requests": {"cpu": "250m"}, "limits": {"cpu": "1"}}
    assert pod_cpu(pod(both, {"requests": {"cpu": "250m"}})) == (500, None)  # one unlimited
    assert pod_cpu(pod(both, both)) == (500, 2000)
    assert (shares_for(0), shares_for(100), shares_for(2000)) == (2, 102, 2048)
    assert (quota_for(None), quota_for(5), quota_for(1500)) == (-1, 1000, 150000)


def test_server_timing_header_is_read_as_milliseconds() -> None:
    from warmgate_devcluster.loadgen import server_timings, total_ms

    def server_timing_ms(header: str | None) -> float | None:
        return total_ms(server_timings(header))

    assert server_timing_ms("embed;dur=12.5") == 12.5
    assert server_timing_ms('queue;dur=2, model;desc="forward";dur=8') == 10.0
    assert server_timing_ms(None) is None and server_timing_ms("cache;desc=hit") is None
    assert server_timing_ms("embed;dur=soon") is None
    # warmgate-server's stages add up to its `embed` total, which is what counts, not their sum
    stages = "tokenize;dur=0.4, queue;dur=0.1, model;dur=14.0, model-cpu;dur=13.5, embed;dur=15.2"
    assert server_timing_ms(stages) == 15.2
