"""`helm install` into the devcluster, then the operator exactly as the installed Deployment
would run it (image entrypoint + the manifest's args, the chart ServiceAccount's token), driving
a real MiniLM server pod to Ready. RBAC is the chart's and nothing else: the first test shows a
missing rule is caught, the second that the chart's rules are enough."""

from __future__ import annotations

import json
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_support import (
    CHART,
    ROOT,
    UNMAPPED_IMAGE,
    InstalledOperator,
    condition,
    free_port,
    get_json,
    helm,
    service_account_kubeconfig,
    tiny_minilm,
    wait_until,
)

pytestmark = pytest.mark.cluster

# A real server pod on a busy 2-core machine: torch import, model load, two shapes.
READY_TIMEOUT = 300
WARMED = "warmgate.dev/warmed"
RBAC_DENIAL = 'cannot patch resource "pods/status"'


@dataclass
class Release:
    name: str
    namespace: str
    fullname: str
    health_port: int
    operator: InstalledOperator


@pytest.fixture(scope="module")
def release(devcluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Release]:
    """The chart installed with its defaults (cluster-wide ClusterRole) into a fresh namespace,
    and its operator running. Module-scoped: the tests share one warming server pod."""
    namespace = f"chart-{uuid.uuid4().hex[:8]}"
    name = f"wg-{namespace}"  # ClusterRoles are cluster-wide: one name per release
    tmp = tmp_path_factory.mktemp("chart-install")
    health_port = free_port()
    devcluster.kubectl("create", "namespace", namespace)
    helm(
        devcluster, "install", name, str(CHART), "--namespace", namespace,
        "--set", f"healthPort={health_port}", "--set", "resyncSeconds=5",
    )  # fmt: skip
    try:
        (deployment,) = get_json(
            devcluster, "deployment", "-n", namespace, "-l", f"app.kubernetes.io/instance={name}"
        )["items"]
        account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
        kubeconfig = service_account_kubeconfig(
            devcluster, namespace, account, tmp / "operator.kubeconfig"
        )
        operator = InstalledOperator(deployment, kubeconfig, tmp / "operator.log")
        yield Release(name, namespace, f"{name}-warmgate", health_port, operator)
    finally:
        if (tmp / "operator.log").exists():  # shown by pytest when a test failed
            print("\n".join((tmp / "operator.log").read_text().splitlines()[-40:]))
        helm(devcluster, "uninstall", name, "--namespace", namespace, check=False)
        devcluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


@pytest.fixture(scope="module")
def running(release: Release) -> Iterator[Release]:
    release.operator.start()
    try:
        yield release
    finally:
        release.operator.stop()


def apply_minilm(cluster: Any, namespace: str) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(tiny_minilm()))


def server_pods(cluster: Any, namespace: str) -> list[dict[str, Any]]:
    return get_json(cluster, "pods", "-n", namespace, "-l", "warmgate.dev/service=minilm")["items"]


def test_installed_deployment_runs_the_image_entrypoint_with_the_charts_arguments(
    devcluster: Any, running: Release
) -> None:
    operator = running.operator
    assert "command" not in operator.container, "the image's ENTRYPOINT must run"
    assert operator.argv[1:3] == ["-m", "warmgate_operator"]
    assert f"--liveness-endpoint=http://0.0.0.0:{running.health_port}/healthz" in operator.argv
    assert operator.service_account == running.fullname

    # The chart's liveness probe target answers once kopf is up.
    def healthy() -> bool:
        assert operator.alive(), operator.log()[-3000:]
        try:
            url = f"http://127.0.0.1:{running.health_port}/healthz"
            with urllib.request.urlopen(url, timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    wait_until(healthy, 60, "the operator's liveness endpoint")


def test_without_pods_status_patch_the_warm_gate_stays_shut(
    devcluster: Any, running: Release
) -> None:
    """Drop the one rule the warm gate needs from the installed ClusterRole: the server warms,
    but the operator cannot open the gate, so nothing is Ready and the log says why (403)."""
    role = get_json(devcluster, "clusterrole", running.fullname)
    rules = role["rules"]
    index = next(i for i, rule in enumerate(rules) if rule["resources"] == ["pods/status"])
    devcluster.kubectl(
        "patch", "clusterrole", running.fullname, "--type=json",
        "-p", json.dumps([{"op": "remove", "path": f"/rules/{index}"}]),
    )  # fmt: skip
    try:
        apply_minilm(devcluster, running.namespace)

        def denied() -> bool:
            assert running.operator.alive(), running.operator.log()[-3000:]
            return any(RBAC_DENIAL in line for line in running.operator.messages())

        wait_until(denied, READY_TIMEOUT, "a 403 on pods/status in the operator's log", every=1)
        (pod,) = server_pods(devcluster, running.namespace)
        assert condition(pod, "ContainersReady").get("status") == "True"  # the server is warm
        assert condition(pod, WARMED).get("status") != "True"
        assert condition(pod, "Ready").get("status") != "True"
        emb = get_json(devcluster, "emb", "minilm", "-n", running.namespace)
        assert condition(emb, "Ready").get("status") != "True", emb.get("status")
        assert emb["status"].get("warmedReplicas", 0) == 0
    finally:
        # `helm upgrade` puts the chart's rules back (three-way merge against the live object).
        helm(
            devcluster, "upgrade", running.name, str(CHART), "--namespace", running.namespace,
            "--reuse-values",
        )  # fmt: skip
    restored = get_json(devcluster, "clusterrole", running.fullname)
    assert restored["rules"] == rules


def test_with_the_charts_rules_minilm_becomes_ready_and_warmed(
    devcluster: Any, running: Release
) -> None:
    log_offset = len(running.operator.log())
    apply_minilm(devcluster, running.namespace)
    started = time.monotonic()
    result = devcluster.kubectl(
        "wait", "--for=condition=Ready", "emb/minilm", "-n", running.namespace,
        f"--timeout={READY_TIMEOUT}s", check=False, timeout=READY_TIMEOUT + 30,
    )  # fmt: skip
    emb = get_json(devcluster, "emb", "minilm", "-n", running.namespace)
    assert result.returncode == 0, (result.stderr, emb.get("status"))
    print(f"Ready after {time.monotonic() - started:.0f}s")
    status = emb["status"]
    assert status["readySummary"] == "1/1"
    assert status["warmedReplicas"] == 1
    assert condition(emb, "Warmed")["status"] == "True"
    (pod,) = server_pods(devcluster, running.namespace)
    assert condition(pod, WARMED)["status"] == "True"
    # An RBAC denial reads `... is forbidden: User "system:serviceaccount:..." cannot ...`.
    denials = [line for line in running.operator.messages(log_offset) if "forbidden: User" in line]
    assert not denials, denials[:3]


def test_crds_upgrade_with_the_documented_command(devcluster: Any, release: Release) -> None:
    """Helm never upgrades crds/; NOTES and the chart README give this command instead."""
    crds = helm(devcluster, "show", "crds", str(CHART)).stdout
    source = (ROOT / "crds" / "warmgate.dev_embeddingservices.yaml").read_text()
    assert crds.strip() == source.strip()
    result = devcluster.kubectl(
        "apply", "--server-side", "--force-conflicts", "-f", "-", input=crds, check=False
    )
    assert result.returncode == 0, result.stderr
    notes = helm(devcluster, "get", "notes", release.name, "-n", release.namespace).stdout
    assert "helm show crds" in notes and "--server-side --force-conflicts" in notes
    readme = (Path(CHART) / "README.md").read_text()
    assert "helm show crds" in readme and "--server-side --force-conflicts" in readme


def test_watching_one_namespace_runs_on_a_role_there_and_nothing_more(
    devcluster: Any, namespace: str, tmp_path: Path
) -> None:
    """`watchNamespaces`: a Role in the namespace plus the discovery-only ClusterRole. The
    operator, run from that Deployment's args as its ServiceAccount, reconciles an
    EmbeddingService there (pods stay in ErrImagePull: no server process is needed)."""
    name = f"wgn-{namespace}"
    helm(
        devcluster, "install", name, str(CHART), "--namespace", namespace,
        "--set", f"watchNamespaces={{{namespace}}}", "--set", f"healthPort={free_port()}",
    )  # fmt: skip
    operator = None
    try:
        (deployment,) = get_json(
            devcluster, "deployment", "-n", namespace, "-l", f"app.kubernetes.io/instance={name}"
        )["items"]
        account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
        user = f"system:serviceaccount:{namespace}:{account}"

        def can(verb: str, resource: str, where: str, *extra: str) -> str:
            return devcluster.kubectl(
                "auth", "can-i", verb, resource, *extra, "-n", where, f"--as={user}", check=False
            ).stdout.strip()

        assert can("patch", "pods", namespace, "--subresource=status") == "yes"
        assert can("patch", "pods", "default", "--subresource=status") == "no"
        assert can("create", "deployments", "default") == "no"
        kubeconfig = service_account_kubeconfig(
            devcluster, namespace, account, tmp_path / "operator.kubeconfig"
        )
        operator = InstalledOperator(deployment, kubeconfig, tmp_path / "operator.log").start()
        assert f"--namespace={namespace}" in operator.argv
        body = tiny_minilm("minilm", image=UNMAPPED_IMAGE)
        devcluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(body))

        def degraded_status() -> dict[str, Any] | None:
            assert operator.alive(), operator.log()[-3000:]
            emb = get_json(devcluster, "emb", "minilm", "-n", namespace)
            status = emb.get("status") or {}
            current = status.get("observedGeneration") == emb["metadata"]["generation"]
            return emb if current and condition(emb, "Degraded").get("status") == "True" else None

        emb = wait_until(degraded_status, 90, "status written by the namespaced operator")
        assert condition(emb, "Degraded")["reason"] == "PodsFailing"
        for kind, child in (("deployment", "minilm"), ("service", "minilm"),
                            ("configmap", "minilm-warmup-profile")):  # fmt: skip
            assert get_json(devcluster, kind, child, "-n", namespace) is not None, kind
        denials = [line for line in operator.messages() if "forbidden: User" in line]
        assert not denials, denials[:3]
    finally:
        if operator is not None:
            operator.stop()
        helm(devcluster, "uninstall", name, "--namespace", namespace, check=False)
