"""The Helm chart: lints, renders what it promises, rejects bad values, and stays in sync with
the operator's CRD and the operator's and router's RBAC (their one source of truth)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from support.tools import load_tool

from warmgate_contract.names import NAME_LABEL, OPERATOR_NAME, ROUTER_NAME

ROOT = Path(__file__).resolve().parents[2]


CHART = ROOT / "charts" / "warmgate"
GOLDEN = Path(__file__).parent / "golden"
OPERATOR_RBAC = ROOT / "operator" / "warmgate_operator" / "rbac.yaml"
ROUTER_RBAC = ROOT / "router" / "warmgate_router" / "rbac.yaml"

sync_chart = load_tool("sync-chart")


@pytest.fixture(scope="module")
def helm() -> str:
    bin_dir = subprocess.run(
        [str(ROOT / "tools" / "k8s-bin.sh")], check=True, capture_output=True, text=True
    ).stdout.strip()
    return os.path.join(bin_dir, "helm")


def run_helm(helm: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        [helm, *args],
        capture_output=True,
        text=True,
        check=check,
        env={**os.environ, "HOME": "/tmp"},
    )


def render(helm: str, *values: str) -> list[dict]:
    args = ["template", "wg", str(CHART), "--namespace", "warmgate-system"]
    for value in values:
        args += ["--set", value]
    out = run_helm(helm, *args).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def by_kind(docs: list[dict], kind: str, part: str | None = None) -> list[dict]:
    """The documents of a kind; with `part` (OPERATOR_NAME, ROUTER_NAME), only that part's, by
    its app.kubernetes.io/name label."""
    return [
        doc
        for doc in docs
        if doc["kind"] == kind
        and (part is None or doc["metadata"].get("labels", {}).get(NAME_LABEL) == part)
    ]


def test_chart_lints(helm):
    result = run_helm(helm, "lint", str(CHART), "--strict", check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_chart_copies_are_in_sync_with_their_sources():
    for path, text in sync_chart.expected_files().items():
        assert path.exists(), f"{path} is missing: run make chart-sync"
        assert path.read_text() == text, f"{path} drifted from its source: run make chart-sync"


@pytest.mark.parametrize(
    ("name", "values"),
    [
        ("default", []),
        (
            "namespaced",
            [
                "watchNamespaces={team-a,team-b}",
                "logFormat=text",
                "image.tag=dev",
                "serverImage=registry.local/warmgate-server:dev",
                "serviceAccount.name=embedder",
                "serverImagePullSecrets={regcred,mirror-creds}",
                "serverImagePullPolicy=Never",
                "imagePullSecrets[0].name=operator-creds",
                "router.image.tag=dev",
                "router.service.type=NodePort",
                "router.service.nodePort=30080",
            ],
        ),
    ],
)
def test_rendered_manifests_match_the_snapshot(helm, name, values):
    docs = render(helm, *values)
    golden = GOLDEN / f"{name}.yaml"
    rendered = yaml.safe_dump_all(docs, sort_keys=True)
    if os.environ.get("UPDATE_GOLDEN") == "1":
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(rendered)
    assert golden.exists(), "no snapshot yet: run with UPDATE_GOLDEN=1 and review it"
    assert rendered == golden.read_text(), f"{name} render changed; UPDATE_GOLDEN=1 after review"


def test_default_install_is_cluster_wide_with_exactly_the_operators_rights(helm):
    docs = render(helm)
    rbac = yaml.safe_load(OPERATOR_RBAC.read_text())
    (role,) = by_kind(docs, "ClusterRole", OPERATOR_NAME)
    assert role["rules"] == rbac["namespaced"]
    # The one Role: the leader Lease, in the release's namespace.
    (leases,) = by_kind(docs, "Role")
    assert leases["metadata"]["namespace"] == "warmgate-system"
    assert leases["rules"] == rbac["leaderElection"]
    (lease_binding,) = by_kind(docs, "RoleBinding")
    assert lease_binding["roleRef"]["name"] == leases["metadata"]["name"]
    (binding,) = by_kind(docs, "ClusterRoleBinding", OPERATOR_NAME)
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    (account,) = by_kind(docs, "ServiceAccount", OPERATOR_NAME)
    assert binding["subjects"][0]["name"] == account["metadata"]["name"]


def test_watching_namespaces_uses_roles_there(helm):
    docs = render(helm, "watchNamespaces={team-a,team-b}")
    rbac = yaml.safe_load(OPERATOR_RBAC.read_text())
    roles = [
        r
        for r in by_kind(docs, "Role", OPERATOR_NAME)
        if not r["metadata"]["name"].endswith("-election")
    ]
    assert sorted(role["metadata"]["namespace"] for role in roles) == ["team-a", "team-b"]
    assert all(role["rules"] == rbac["namespaced"] for role in roles)
    # Nothing cluster-wide: kopf's scans of namespaces and CRDs are off.
    assert by_kind(docs, "ClusterRole") == [] and by_kind(docs, "ClusterRoleBinding") == []
    (deployment,) = by_kind(docs, "Deployment", OPERATOR_NAME)
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args


def test_operator_deployment_is_replicated_restricted_and_probed(helm):
    docs = render(helm)
    (deployment,) = by_kind(docs, "Deployment", OPERATOR_NAME)
    spec = deployment["spec"]
    # Two replicas, one leading at a time (the Lease), replaced one by one, and a budget
    # that keeps a node drain from taking both.
    assert spec["replicas"] == 2
    assert spec["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    (budget,) = by_kind(docs, "PodDisruptionBudget", OPERATOR_NAME)
    assert budget["spec"]["maxUnavailable"] == 1
    assert budget["spec"]["selector"] == spec["selector"]
    assert not by_kind(render(helm, "replicaCount=1"), "PodDisruptionBudget", OPERATOR_NAME)
    pod = spec["template"]["spec"]
    container = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert "--http-address=0.0.0.0:8081" in container["args"]
    assert "--leader-elect" in container["args"]
    env = {item["name"]: item for item in container["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert "--default-image=ghcr.io/warmgate/warmgate-server:0.1.0" in container["args"]


def test_pod_monitors_are_off_by_default_and_scrape_both_when_on(helm):
    assert not [doc for doc in render(helm) if doc["kind"] == "PodMonitor"]
    docs = render(
        helm, "metrics.operatorPodMonitor.enabled=true", "metrics.serverPodMonitor.enabled=true"
    )
    operator, servers = by_kind(docs, "PodMonitor")
    (deployment,) = by_kind(docs, "Deployment", OPERATOR_NAME)
    assert operator["spec"]["selector"] == deployment["spec"]["selector"]
    assert operator["spec"]["podMetricsEndpoints"][0]["port"] == "http"
    assert servers["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/managed-by": "warmgate"
    }
    assert servers["spec"]["namespaceSelector"] == {"any": True}
    assert servers["spec"]["podMetricsEndpoints"][0]["path"] == "/metrics"


@pytest.mark.parametrize(
    ("value", "complaint"),
    [
        ("workers=0", "workers"),
        ("logFormat=yaml", "logFormat"),
        ("image.pullPolicy=Sometimes", "pullPolicy"),
        ("watchNamespaces={Team_A}", "watchNamespaces"),
        ("healthPort=70000", "healthPort"),
        ("replicaCount=0", "replicaCount"),
        ("leaseSeconds=1", "leaseSeconds"),
        ("metrics.operatorPodMonitor.interval=often", "interval"),
        ("unknownValue=1", "unknownValue"),
        ("serverImagePullSecrets={Reg_Cred}", "serverImagePullSecrets"),
        ("serverImagePullPolicy=Sometimes", "serverImagePullPolicy"),
        ("router.replicaCount=0", "replicaCount"),
        ("router.holdSeconds=-1", "holdSeconds"),
        ("router.maxHeldRequests=-1", "maxHeldRequests"),
        ("router.activitySeconds=0", "activitySeconds"),
        ("router.service.type=Headless", "type"),
        ("router.podDisruptionBudget.minAvailable=most", "minAvailable"),
        ("router.image.pullPolicy=Sometimes", "pullPolicy"),
        ("router.unknownValue=1", "unknownValue"),
    ],
)
def test_bad_values_fail_at_install_with_the_value_named(helm, value, complaint):
    result = run_helm(helm, "template", "wg", str(CHART), "--set", value, check=False)
    assert result.returncode != 0
    assert complaint in result.stderr


DEFAULT_OPERATOR_SETTINGS = {
    "namespaces": (),
    "server_image_pull_secrets": (),
    "server_image_pull_policy": "IfNotPresent",
    "log_format": "json",
    "log_level": "INFO",
    "resync_seconds": 60.0,
    "workers": 8,
    "http_address": "0.0.0.0:8081",
    "leader_elect": True,
    "lease_seconds": 8.0,
    "default_image": "ghcr.io/warmgate/warmgate-server:0.1.0",
}


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([], {}),
        (
            [
                "watchNamespaces={team-a,team-b}",
                "serverImagePullSecrets={regcred,mirror-creds}",
                "serverImagePullPolicy=Never",
                "serverImage=registry.local/warmgate-server:dev",
                "logFormat=text",
                "logLevel=DEBUG",
                "resyncSeconds=30",
                "workers=4",
                "healthPort=9000",
                "leaseSeconds=15",
            ],
            {
                "namespaces": ("team-a", "team-b"),
                "server_image_pull_secrets": ("regcred", "mirror-creds"),
                "server_image_pull_policy": "Never",
                "default_image": "registry.local/warmgate-server:dev",
                "log_format": "text",
                "log_level": "DEBUG",
                "resync_seconds": 30.0,
                "workers": 4,
                "http_address": "0.0.0.0:9000",
                "lease_seconds": 15.0,
            },
        ),
    ],
)
def test_the_operator_accepts_every_argument_the_chart_renders(helm, values, expected):
    """The chart and the operator's flags cannot drift apart: the rendered args parse, to the
    values that were set."""
    from warmgate_operator.config import load_config

    (deployment,) = by_kind(render(helm, *values), "Deployment", OPERATOR_NAME)
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert "command" not in container  # the image's ENTRYPOINT: python -m warmgate_operator
    config = load_config(container["args"], env={})
    wanted = {**DEFAULT_OPERATOR_SETTINGS, **expected}
    assert {key: getattr(config, key) for key in wanted} == wanted
    port = int(wanted["http_address"].rsplit(":", 1)[1])
    assert container["ports"] == [{"name": "http", "containerPort": port}]
    assert container["livenessProbe"]["httpGet"]["port"] == "http"


def test_the_server_pull_policy_value_offers_what_the_operator_accepts():
    from warmgate_operator.spec import PULL_POLICIES

    schema = json.loads((CHART / "values.schema.json").read_text())
    assert tuple(schema["properties"]["serverImagePullPolicy"]["enum"]) == PULL_POLICIES


# ------------------------------------------------------------------ the router
def router_docs(docs: list[dict]) -> list[dict]:
    return [doc for doc in docs if doc["metadata"].get("labels", {}).get(NAME_LABEL) == ROUTER_NAME]


def test_the_router_is_installed_by_default_replicated_restricted_and_probed(helm):
    docs = render(helm)
    (deployment,) = by_kind(docs, "Deployment", ROUTER_NAME)
    (service,) = by_kind(docs, "Service", ROUTER_NAME)
    (budget,) = by_kind(docs, "PodDisruptionBudget", ROUTER_NAME)
    (account,) = by_kind(docs, "ServiceAccount", ROUTER_NAME)
    assert {doc["metadata"]["name"] for doc in router_docs(docs)} == {"wg-warmgate-router"}
    spec = deployment["spec"]
    assert spec["replicas"] == 2
    assert spec["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    pod_labels = spec["template"]["metadata"]["labels"]
    selector = spec["selector"]["matchLabels"]
    assert selector.items() <= pod_labels.items()
    # The Service and the budget select the router's pods and no operator pod.
    (operator,) = by_kind(docs, "Deployment", OPERATOR_NAME)
    operator_labels = operator["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"] == selector
    assert not service["spec"]["selector"].items() <= operator_labels.items()
    assert not operator["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["ports"] == [
        {"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}
    ]
    assert budget["spec"] == {"minAvailable": 1, "selector": {"matchLabels": selector}}
    assert not by_kind(render(helm, "router.replicaCount=1"), "PodDisruptionBudget", ROUTER_NAME)

    pod = spec["template"]["spec"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    (container,) = pod["containers"]
    assert container["image"] == "ghcr.io/warmgate/warmgate-router:0.1.0"
    assert container["ports"] == [{"name": "http", "containerPort": 8080}]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert container["resources"] == {
        "requests": {"cpu": "50m", "memory": "96Mi"},
        "limits": {"memory": "256Mi"},
    }
    # Spread over nodes where it can be, never held Pending where it cannot.
    (preference,) = pod["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]
    term = preference["podAffinityTerm"]
    assert term == {
        "topologyKey": "kubernetes.io/hostname",
        "labelSelector": {"matchLabels": selector},
    }
    # A node port, when asked for one.
    (node_port,) = by_kind(
        render(helm, "router.service.type=NodePort", "router.service.nodePort=30080"),
        "Service",
        ROUTER_NAME,
    )
    assert node_port["spec"]["type"] == "NodePort"
    assert node_port["spec"]["ports"][0]["nodePort"] == 30080


def test_router_disabled_renders_nothing_of_it_and_leaves_the_operator_as_it_was(helm):
    with_router = render(helm)
    without = render(helm, "router.enabled=false")
    assert router_docs(without) == []
    assert not [doc for doc in without if "router" in doc["metadata"]["name"]]
    assert without == [doc for doc in with_router if doc not in router_docs(with_router)]


@pytest.mark.parametrize("namespaced", [False, True])
def test_the_routers_rights_are_exactly_its_rbac_yaml_where_the_operator_works(helm, namespaced):
    values = ["watchNamespaces={team-a,team-b}"] if namespaced else []
    docs = render(helm, *values)
    rules = yaml.safe_load(ROUTER_RBAC.read_text())["namespaced"]
    (account,) = by_kind(docs, "ServiceAccount", ROUTER_NAME)
    role_kind, binding_kind = (
        ("Role", "RoleBinding") if namespaced else ("ClusterRole", "ClusterRoleBinding")
    )
    roles = by_kind(docs, role_kind, ROUTER_NAME)
    bindings = by_kind(docs, binding_kind, ROUTER_NAME)
    assert [role["rules"] for role in roles] == [rules] * len(roles)
    operator_roles = [
        role
        for role in by_kind(docs, role_kind, OPERATOR_NAME)
        if not role["metadata"]["name"].endswith("-election")
    ]
    # The same namespaces as the operator (cluster-wide: one ClusterRole each).
    where = sorted(role["metadata"].get("namespace", "*") for role in roles)
    assert where == sorted(role["metadata"].get("namespace", "*") for role in operator_roles)
    assert where == (["team-a", "team-b"] if namespaced else ["*"])
    for role, binding in zip(roles, bindings, strict=True):
        assert binding["metadata"].get("namespace") == role["metadata"].get("namespace")
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": role_kind,
            "name": role["metadata"]["name"],
        }
        assert binding["subjects"] == [
            {
                "kind": "ServiceAccount",
                "name": account["metadata"]["name"],
                "namespace": "warmgate-system",
            }
        ]
    if namespaced:
        assert by_kind(docs, "ClusterRole") == [] and by_kind(docs, "ClusterRoleBinding") == []
    assert not by_kind(render(helm, *values, "rbac.create=false"), role_kind, ROUTER_NAME)


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        (
            [],
            {
                "namespaces": (),
                "port": 8080,
                "hold_seconds": 120.0,
                "max_hold_seconds": None,
                "hold_ceiling": 600.0,
                "max_held_requests": 1000,
                "activity_seconds": 10.0,
                "log_format": "json",
                "log_level": "INFO",
            },
        ),
        (
            [
                "watchNamespaces={team-a,team-b}",
                "router.holdSeconds=0",
                "router.maxHoldSeconds=900",
                "router.maxHeldRequests=50",
                "router.activitySeconds=3",
                "logFormat=text",
                "logLevel=DEBUG",
            ],
            {
                "namespaces": ("team-a", "team-b"),
                "port": 8080,
                "hold_seconds": 0.0,
                "max_hold_seconds": 900.0,
                "hold_ceiling": 900.0,
                "max_held_requests": 50,
                "activity_seconds": 3.0,
                "log_format": "text",
                "log_level": "DEBUG",
            },
        ),
    ],
)
def test_the_router_accepts_every_argument_the_chart_renders(helm, values, expected, monkeypatch):
    """The chart and the router's flags cannot drift apart: the rendered args parse, to the
    values that were set, and the port they name is the container's."""
    from warmgate_router.config import parse_args

    for name in [name for name in os.environ if name.startswith("WARMGATE_ROUTER_")]:
        monkeypatch.delenv(name)
    (deployment,) = by_kind(render(helm, *values), "Deployment", ROUTER_NAME)
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert "command" not in container  # the image's ENTRYPOINT: python -m warmgate_router
    # The router's own Service (warmgate-router) would otherwise set WARMGATE_ROUTER_PORT.
    assert deployment["spec"]["template"]["spec"]["enableServiceLinks"] is False
    config = parse_args(container["args"])
    assert {key: getattr(config, key) for key in expected} == expected
    assert container["ports"] == [{"name": "http", "containerPort": config.port}]


@pytest.mark.parametrize("who", ["tests", "quickstart"])
def test_in_the_devcluster_every_pod_runs_an_image_it_built_and_never_pulls(helm, who):
    """The devcluster has no registry: each image the chart names must be one it built and
    imported, with a pull policy that never pulls (tests' installs and `make up` alike)."""
    from types import SimpleNamespace

    from support.chart import devcluster_values

    from warmgate_devcluster import images, quickstart

    hub = "http://10.200.1.1:8000"
    if who == "tests":
        values = devcluster_values(SimpleNamespace(hub_endpoint=hub))
    else:
        values = tuple(quickstart.chart_values(hub))
    args = ["template", "wg", str(CHART), "--namespace", "warmgate-system", *values]
    docs = [doc for doc in yaml.safe_load_all(run_helm(helm, *args).stdout) if doc]
    built = {image.name for image in images.APP_IMAGES}
    deployments = by_kind(docs, "Deployment")
    assert {d["metadata"]["labels"][NAME_LABEL] for d in deployments} == {
        OPERATOR_NAME,
        ROUTER_NAME,
    }
    for deployment in deployments:
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        assert container["image"] in built
        assert container["imagePullPolicy"] == "Never"
    (operator,) = by_kind(docs, "Deployment", OPERATOR_NAME)
    args = operator["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--default-image={images.SERVER.name}" in args
    assert "--server-image-pull-policy=Never" in args
