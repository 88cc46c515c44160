"""The Helm chart: lints, renders what it promises, rejects bad values, and stays in sync with
the operator's CRD and RBAC (its one source of truth)."""

from __future__ import annotations

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
    assert role["rules"] == rbac["namespaced"] + rbac["cluster"]
    assert not by_kind(docs, "Role")
    (binding,) = by_kind(docs, "ClusterRoleBinding")
    (account,) = by_kind(docs, "ServiceAccount")
    assert binding["subjects"][0]["name"] == account["metadata"]["name"]


def test_watching_namespaces_uses_roles_there(helm):
    docs = render(helm, "watchNamespaces={team-a,team-b}")
    rbac = yaml.safe_load((ROOT / "operator" / "warmgate_operator" / "rbac.yaml").read_text())
    roles = by_kind(docs, "Role")
    assert sorted(role["metadata"]["namespace"] for role in roles) == ["team-a", "team-b"]
    assert all(role["rules"] == rbac["namespaced"] for role in roles)
    (discovery,) = by_kind(docs, "ClusterRole")
    assert discovery["rules"] == rbac["cluster"]
    (deployment,) = by_kind(docs, "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args


def test_operator_deployment_is_single_restricted_and_probed(helm):
    (deployment,) = by_kind(render(helm), "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    container = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert "--liveness-endpoint=http://0.0.0.0:8081/healthz" in container["args"]
    assert "--default-image=ghcr.io/warmgate/warmgate-server:0.1.0" in container["args"]


@pytest.mark.parametrize(
    ("value", "complaint"),
    [
        ("workers=0", "workers"),
        ("logFormat=yaml", "logFormat"),
        ("image.pullPolicy=Sometimes", "pullPolicy"),
        ("watchNamespaces={Team_A}", "watchNamespaces"),
        ("healthPort=70000", "healthPort"),
        ("unknownValue=1", "unknownValue"),
        ("serverImagePullSecrets={Reg_Cred}", "serverImagePullSecrets"),
    ],
)
def test_bad_values_fail_at_install_with_the_value_named(helm, value, complaint):
    result = run_helm(helm, "template", "wg", str(CHART), "--set", value, check=False)
    assert result.returncode != 0
    assert complaint in result.stderr


DEFAULT_OPERATOR_SETTINGS = {
    "namespaces": (),
    "server_image_pull_secrets": (),
    "log_format": "json",
    "log_level": "INFO",
    "resync_seconds": 60.0,
    "workers": 8,
    "liveness_endpoint": "http://0.0.0.0:8081/healthz",
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
                "serverImage=registry.local/warmgate-server:dev",
                "logFormat=text",
                "logLevel=DEBUG",
                "resyncSeconds=30",
                "workers=4",
                "healthPort=9000",
            ],
            {
                "namespaces": ("team-a", "team-b"),
                "server_image_pull_secrets": ("regcred", "mirror-creds"),
                "default_image": "registry.local/warmgate-server:dev",
                "log_format": "text",
                "log_level": "DEBUG",
                "resync_seconds": 30.0,
                "workers": 4,
                "liveness_endpoint": "http://0.0.0.0:9000/healthz",
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
    port = int(wanted["liveness_endpoint"].rsplit(":", 1)[1].split("/")[0])
    assert container["ports"] == [{"name": "health", "containerPort": port}]
    assert container["livenessProbe"]["httpGet"]["port"] == "health"
