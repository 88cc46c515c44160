"""`helm install` into the devcluster: the chart's Deployment runs the operator image on the
node, in-cluster, as the chart's ServiceAccount (its token, its RBAC and nothing else), and drives
a real MiniLM server container to Ready. The first test shows the image starts as the chart
runs it, the second that a missing rule is caught, the third that the chart's rules are
enough."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.chart import (
    CHART,
    ROOT,
    UNMAPPED_IMAGE,
    condition,
    devcluster_values,
    get_json,
    helm,
    log_messages,
    operator_log,
    operator_selector,
    tiny_minilm,
    wait_until,
)

from warmgate_devcluster.images import OPERATOR

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


REPLICAS = 2  # the chart's default replicaCount


def operator_pods(cluster: Any, namespace: str, release: str) -> list[dict[str, Any]] | None:
    """The chart's operator pods, once all of them exist (None before)."""
    pods = get_json(cluster, "pods", "-n", namespace, "-l", operator_selector(release))["items"]
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    return live if len(live) == REPLICAS else None


@pytest.fixture(scope="module")
def release(devcluster: Any) -> Iterator[Release]:
    """The chart installed with its defaults (cluster-wide ClusterRole) into a fresh namespace,
    its operator running on the node. Module-scoped: the tests share one warming server pod."""
    namespace = f"chart-{uuid.uuid4().hex[:8]}"
    name = f"wg-{namespace}"  # ClusterRoles are cluster-wide: one name per release
    devcluster.kubectl("create", "namespace", namespace)
    helm(
        devcluster, "install", name, str(CHART), "--namespace", namespace,
        *devcluster_values(devcluster), "--set", "resyncSeconds=5", "--wait", "--timeout=3m",
    )  # fmt: skip
    try:
        yield Release(name, namespace, f"{name}-warmgate")
    finally:
        # shown by pytest when a test failed
        print("\n".join(operator_log(devcluster, namespace, name).splitlines()[-40:]))
        helm(devcluster, "uninstall", name, "--namespace", namespace, check=False)
        devcluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def apply_minilm(cluster: Any, namespace: str) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(tiny_minilm()))


def server_pods(cluster: Any, namespace: str) -> list[dict[str, Any]]:
    return get_json(cluster, "pods", "-n", namespace, "-l", "warmgate.dev/service=minilm")["items"]


def test_the_operator_image_runs_in_cluster_as_the_chart_configures_it(
    devcluster: Any, release: Release
) -> None:
    pods = wait_until(
        lambda: operator_pods(devcluster, release.namespace, release.name), 60, "operator pods"
    )
    spec = pods[0]["spec"]
    (container,) = spec["containers"]
    assert "command" not in container, "the image's ENTRYPOINT must run"
    assert container["image"] == OPERATOR.name and container["imagePullPolicy"] == "Never"
    assert spec["serviceAccountName"] == release.fullname
    assert spec["securityContext"]["runAsUser"] == 10001
    assert container["securityContext"]["readOnlyRootFilesystem"] is True

    # kubelet's liveness probe (the operator's /healthz, which a standby answers too) passes
    # on both replicas, and they stay up: no restarts.
    def settled() -> list[dict[str, Any]] | None:
        current = operator_pods(devcluster, release.namespace, release.name) or []
        statuses = [(p.get("status", {}).get("containerStatuses") or [{}])[0] for p in current]
        return current if current and all(s.get("ready") for s in statuses) else None

    pods = wait_until(settled, 120, "the operator containers to run")
    for pod in pods:
        (status,) = pod["status"]["containerStatuses"]
        log = operator_log(devcluster, release.namespace, release.name)
        assert status["restartCount"] == 0, log
        events = get_json(
            devcluster, "events", "-n", release.namespace,
            "--field-selector", f"involvedObject.name={pod['metadata']['name']}",
        )["items"]  # fmt: skip
        assert not [e for e in events if e.get("reason") == "Unhealthy"], events
    # One of them leads: it holds the Lease in the release's namespace (the chart's Role).
    lease = wait_until(
        lambda: get_json(devcluster, "lease", "warmgate-operator", "-n", release.namespace),
        60,
        "the leader Lease",
    )
    assert lease["spec"]["holderIdentity"] in {p["metadata"]["name"] for p in pods}
    # It talks to the apiserver as its ServiceAccount, through the in-cluster Service and DNS.
    messages = log_messages(operator_log(devcluster, release.namespace, release.name))
    assert messages, "the operator logs JSON lines (the chart's logFormat)"


def test_without_pods_status_patch_the_warm_gate_stays_shut(
    devcluster: Any, release: Release
) -> None:
    """Drop the one rule the warm gate needs from the installed ClusterRole: the server warms,
    but the operator cannot open the gate, so nothing is Ready and the log says why (403)."""
    role = get_json(devcluster, "clusterrole", release.fullname)
    rules = role["rules"]
    index = next(i for i, rule in enumerate(rules) if rule["resources"] == ["pods/status"])
    devcluster.kubectl(
        "patch", "clusterrole", release.fullname, "--type=json",
        "-p", json.dumps([{"op": "remove", "path": f"/rules/{index}"}]),
    )  # fmt: skip
    try:
        apply_minilm(devcluster, release.namespace)

        def denied() -> bool:
            log = operator_log(devcluster, release.namespace, release.name)
            return any(RBAC_DENIAL in line for line in log_messages(log))

        wait_until(denied, READY_TIMEOUT, "a 403 on pods/status in the operator's log", every=2)
        (pod,) = server_pods(devcluster, release.namespace)
        assert condition(pod, "ContainersReady").get("status") == "True"  # the server is warm
        assert condition(pod, WARMED).get("status") != "True"
        assert condition(pod, "Ready").get("status") != "True"
        emb = get_json(devcluster, "emb", "minilm", "-n", release.namespace)
        assert condition(emb, "Ready").get("status") != "True", emb.get("status")
        assert emb["status"].get("warmedReplicas", 0) == 0
    finally:
        # `helm upgrade` puts the chart's rules back (three-way merge against the live object).
        helm(
            devcluster, "upgrade", release.name, str(CHART), "--namespace", release.namespace,
            "--reuse-values",
        )  # fmt: skip
    restored = get_json(devcluster, "clusterrole", release.fullname)
    assert restored["rules"] == rules


def test_with_the_charts_rules_minilm_becomes_ready_and_warmed(
    devcluster: Any, release: Release
) -> None:
    seen = len(log_messages(operator_log(devcluster, release.namespace, release.name)))
    apply_minilm(devcluster, release.namespace)
    started = time.monotonic()
    result = devcluster.kubectl(
        "wait", "--for=condition=Ready", "emb/minilm", "-n", release.namespace,
        f"--timeout={READY_TIMEOUT}s", check=False, timeout=READY_TIMEOUT + 30,
    )  # fmt: skip
    emb = get_json(devcluster, "emb", "minilm", "-n", release.namespace)
    assert result.returncode == 0, (result.stderr, emb.get("status"))
    print(f"Ready after {time.monotonic() - started:.0f}s")
    status = emb["status"]
    assert status["readySummary"] == "1/1"
    assert status["warmedReplicas"] == 1
    assert condition(emb, "Warmed")["status"] == "True"
    (pod,) = server_pods(devcluster, release.namespace)
    assert condition(pod, WARMED)["status"] == "True"
    # An RBAC denial reads `... is forbidden: User "system:serviceaccount:..." cannot ...`.
    log = operator_log(devcluster, release.namespace, release.name)
    denials = [line for line in log_messages(log)[seen:] if "forbidden: User" in line]
    assert not denials, denials[:3]


def test_crds_upgrade_with_the_documented_command(devcluster: Any, release: Release) -> None:
    """Helm never upgrades crds/; NOTES and the chart README give this command instead."""
    crds = helm(devcluster, "show", "crds", str(CHART)).stdout
    # Every CRD, each its own document (helm joins the files as they are: each starts with
    # `---`, or kubectl would read one document with the keys of both).
    sources = [yaml.safe_load(path.read_text()) for path in sorted((ROOT / "crds").glob("*.yaml"))]
    assert [doc for doc in yaml.safe_load_all(crds) if doc] == sources
    assert len(sources) == 2
    result = devcluster.kubectl(
        "apply", "--server-side", "--force-conflicts", "-f", "-", input=crds, check=False
    )
    assert result.returncode == 0, result.stderr
    notes = helm(devcluster, "get", "notes", release.name, "-n", release.namespace).stdout
    assert "helm show crds" in notes and "--server-side --force-conflicts" in notes
    readme = (Path(CHART) / "README.md").read_text()
    assert "helm show crds" in readme and "--server-side --force-conflicts" in readme


def test_watching_one_namespace_runs_on_a_role_there_and_nothing_more(
    devcluster: Any, namespace: str, release: Release
) -> None:
    """`watchNamespaces`: a Role in the namespace, and no cluster-wide permission. The
    operator, in-cluster as that release's ServiceAccount, reconciles an EmbeddingService there
    (its pods stay in ErrImagePull: no server is needed). The cluster-wide release of this
    module is scaled to zero meanwhile, so only the namespaced operator can have done it."""
    cluster_wide = ("deployment", release.fullname, "-n", release.namespace)
    devcluster.kubectl("scale", *cluster_wide, "--replicas=0")
    name = f"wgn-{namespace}"
    try:
        helm(
            devcluster, "install", name, str(CHART), "--namespace", namespace,
            *devcluster_values(devcluster), "--set", f"watchNamespaces={{{namespace}}}",
            "--wait", "--timeout=3m",
        )  # fmt: skip
        (deployment,) = get_json(
            devcluster, "deployment", "-n", namespace, "-l", operator_selector(name)
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
        args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        assert f"--namespace={namespace}" in args
        body = tiny_minilm("minilm", image=UNMAPPED_IMAGE)
        devcluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(body))

        def degraded_status() -> dict[str, Any] | None:
            emb = get_json(devcluster, "emb", "minilm", "-n", namespace)
            status = emb.get("status") or {}
            current = status.get("observedGeneration") == emb["metadata"]["generation"]
            return emb if current and condition(emb, "Degraded").get("status") == "True" else None

        emb = wait_until(degraded_status, 120, "status written by the namespaced operator")
        assert condition(emb, "Degraded")["reason"] == "PodsFailing"
        for kind, child in (("deployment", "minilm"), ("service", "minilm"),
                            ("configmap", "minilm-warmup-profile")):  # fmt: skip
            assert get_json(devcluster, kind, child, "-n", namespace) is not None, kind
        log = operator_log(devcluster, namespace, name)
        denials = [line for line in log_messages(log) if "forbidden: User" in line]
        assert not denials, denials[:3]
    finally:
        helm(devcluster, "uninstall", name, "--namespace", namespace, check=False)
        devcluster.kubectl("scale", *cluster_wide, "--replicas=1", check=False)
