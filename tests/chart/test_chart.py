"""The Helm chart: lints, renders what it promises, rejects bad values, and stays in sync with
the operator's CRD and RBAC (its one source of truth)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from support.tools import load_tool

ROOT = Path(__file__).resolve().parents[2]


CHART = ROOT / "charts" / "warmgate"
GOLDEN = Path(__file__).parent / "golden"

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


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [doc for doc in docs if doc["kind"] == kind]


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
    rbac = yaml.safe_load((ROOT / "operator" / "warmgate_operator" / "rbac.yaml").read_text())
    (role,) = by_kind(docs, "ClusterRole")
    assert role["rules"] == rbac["namespaced"]
    # The one Role: the leader Lease, in the release's namespace.
    (leases,) = by_kind(docs, "Role")
    assert leases["metadata"]["namespace"] == "warmgate-system"
    assert leases["rules"] == rbac["leaderElection"]
    (lease_binding,) = by_kind(docs, "RoleBinding")
    assert lease_binding["roleRef"]["name"] == leases["metadata"]["name"]
    (binding,) = by_kind(docs, "ClusterRoleBinding")
    (account,) = by_kind(docs, "ServiceAccount")
    assert binding["subjects"][0]["name"] == account["metadata"]["name"]


def test_watching_namespaces_uses_roles_there(helm):
    docs = render(helm, "watchNamespaces={team-a,team-b}")
    rbac = yaml.safe_load((ROOT / "operator" / "warmgate_operator" / "rbac.yaml").read_text())
    roles = [r for r in by_kind(docs, "Role") if not r["metadata"]["name"].endswith("-election")]
    assert sorted(role["metadata"]["namespace"] for role in roles) == ["team-a", "team-b"]
    assert all(role["rules"] == rbac["namespaced"] for role in roles)
    # Nothing cluster-wide: kopf's scans of namespaces and CRDs are off.
    assert by_kind(docs, "ClusterRole") == [] and by_kind(docs, "ClusterRoleBinding") == []
    (deployment,) = by_kind(docs, "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args


def test_operator_deployment_is_replicated_restricted_and_probed(helm):
    docs = render(helm)
    (deployment,) = by_kind(docs, "Deployment")
    spec = deployment["spec"]
    # Two replicas, one leading at a time (the Lease), replaced one by one, and a budget
    # that keeps a node drain from taking both.
    assert spec["replicas"] == 2
    assert spec["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    (budget,) = by_kind(docs, "PodDisruptionBudget")
    assert budget["spec"]["maxUnavailable"] == 1
    assert budget["spec"]["selector"] == spec["selector"]
    assert not by_kind(render(helm, "replicaCount=1"), "PodDisruptionBudget")
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
    (deployment,) = by_kind(docs, "Deployment")
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

    (deployment,) = by_kind(render(helm, *values), "Deployment")
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
