"""The operator as a process against the devcluster's real apiserver, controllers and garbage
collector, driven with kubectl the way a user would."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.request
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from support.cluster import (
    OperatorProcess,
    apply,
    example,
    get_json,
    install_crd,
    items,
    operator_metrics,
    operator_requests,
)

from warmgate_devcluster import procs
from warmgate_devcluster.testkit import READ_VERBS, audit_writes, describe_audit, wait_until
from warmgate_operator.config import USER_AGENT as OPERATOR_USER_AGENT

pytestmark = pytest.mark.cluster

RESYNC = "2"


@pytest.fixture(scope="module")
def crd(devcluster: Any) -> None:
    install_crd(devcluster)


@pytest.fixture
def operator(
    devcluster: Any, crd: None, namespace: str, tmp_path: Path
) -> Iterator[OperatorProcess]:
    op = OperatorProcess(
        devcluster, tmp_path / "operator.log", "--namespace", namespace, "--resync-seconds", RESYNC
    ).start()
    try:
        yield op
    finally:
        op.stop()
        # Shown by pytest when the test failed.
        print("\n".join(op.log_path.read_text(errors="replace").splitlines()[-60:]))


def patch(cluster: Any, namespace: str, name: str, spec: dict[str, Any]) -> None:
    cluster.kubectl(
        "patch", "emb", name, "-n", namespace, "--type", "merge", "-p", json.dumps({"spec": spec})
    )


def child(cluster: Any, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
    return get_json(cluster, kind, name, "-n", namespace)


def wait_child(cluster: Any, kind: str, namespace: str, name: str, timeout: float = 60) -> dict:
    return wait_until(
        lambda: child(cluster, kind, namespace, name), timeout=timeout, what=f"{kind}/{name}"
    )


def wait_status(cluster: Any, namespace: str, name: str, timeout: float = 60) -> dict[str, Any]:
    """The EmbeddingService once its status describes its current generation."""

    def current() -> dict[str, Any] | None:
        es = get_json(cluster, "emb", name, "-n", namespace)
        status = (es or {}).get("status") or {}
        if es and status.get("observedGeneration") == es["metadata"]["generation"]:
            return es
        return None

    return wait_until(current, timeout=timeout, what=f"status of emb/{name}")


def replicasets(cluster: Any, namespace: str, name: str) -> list[dict[str, Any]]:
    return items(cluster, "replicasets", namespace, f"app.kubernetes.io/instance={name}")


def event_time(stamp: str) -> float:
    """An event's time (RFC 3339, with or without a fraction) as Unix time."""
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def controller_ref(obj: dict[str, Any]) -> dict[str, Any]:
    (ref,) = [r for r in obj["metadata"]["ownerReferences"] if r.get("controller")]
    return ref


def test_apply_creates_owned_children(devcluster: Any, namespace: str, operator: Any) -> None:
    apply(devcluster, namespace, example())
    es = get_json(devcluster, "emb", "minilm", "-n", namespace)
    uid = es["metadata"]["uid"]
    children = {
        "deployment": "minilm",
        "service": "minilm",
        "configmap": "minilm-warmup-profile",
        "poddisruptionbudget": "minilm",
    }
    for kind, name in children.items():
        obj = wait_child(devcluster, kind, namespace, name)
        ref = controller_ref(obj)
        assert (ref["kind"], ref["name"], ref["uid"]) == ("EmbeddingService", "minilm", uid), kind
        assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "warmgate"
        managers = {m["manager"] for m in obj["metadata"]["managedFields"]}
        assert "warmgate" in managers, kind
    assert child(devcluster, "hpa", namespace, "minilm") is None

    deployment = child(devcluster, "deployment", namespace, "minilm")
    pod = deployment["spec"]["template"]["spec"]
    (server,) = pod["containers"]
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert pod["readinessGates"] == [{"conditionType": "warmgate.dev/warmed"}]
    assert server["startupProbe"]["httpGet"]["path"] == "/started"
    assert server["startupProbe"]["failureThreshold"] == 150
    assert server["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert "--model=sentence-transformers/all-MiniLM-L6-v2" in server["args"]
    assert server["securityContext"]["readOnlyRootFilesystem"] is True

    service = child(devcluster, "service", namespace, "minilm")
    assert service["spec"]["type"] == "NodePort"
    (port,) = service["spec"]["ports"]
    assert (port["port"], port["targetPort"]) == (80, "http")
    assert port["nodePort"] > 0

    es = wait_status(devcluster, namespace, "minilm")
    status = es["status"]
    assert status["selector"] == (
        "app.kubernetes.io/instance=minilm,app.kubernetes.io/name=warmgate-server"
    )
    assert {c["type"] for c in status["conditions"]} == {
        "Ready",
        "Progressing",
        "Warmed",
        "Degraded",
        "Conflict",
        "MemoryPressure",
    }
    assert not es["metadata"].get("finalizers"), "the operator must not block deletion"
    # kopf carries the EmbeddingServices but writes nothing to them: no annotation of its
    # own (last-handled-configuration, progress) and no status key warmgate does not write.
    assert not [a for a in es["metadata"].get("annotations") or {} if "kopf" in a]
    assert "kopf" not in status

    # The pods cannot pull their image: a person reading the status is told so.
    def failing() -> dict[str, Any] | None:
        conditions = {
            c["type"]: c
            for c in (get_json(devcluster, "emb", "minilm", "-n", namespace)["status"]).get(
                "conditions", []
            )
        }
        degraded = conditions.get("Degraded", {})
        return degraded if degraded.get("reason") == "PodsFailing" else None

    degraded = wait_until(failing, timeout=60, what="Degraded=PodsFailing")
    assert degraded["status"] == "True"
    table = devcluster.kubectl("get", "emb", "-n", namespace).stdout
    assert "sentence-transformers/all-MiniLM-L6-v2" in table
    assert "/2" in table and "PodsFailing" in table
    events = devcluster.kubectl(
        "get", "events", "-n", namespace, "--field-selector", "involvedObject.name=minilm"
    ).stdout
    assert "Created" in events


def test_spec_update_changes_only_what_changed(
    devcluster: Any, namespace: str, operator: Any
) -> None:
    apply(devcluster, namespace, example())
    wait_child(devcluster, "deployment", namespace, "minilm")
    wait_status(devcluster, namespace, "minilm")
    wait_until(lambda: len(replicasets(devcluster, namespace, "minilm")) == 1, what="first RS")
    before = child(devcluster, "deployment", namespace, "minilm")
    configmap_rv = child(devcluster, "configmap", namespace, "minilm-warmup-profile")["metadata"][
        "resourceVersion"
    ]

    # A Service setting: the Service changes, the pods do not roll.
    patch(devcluster, namespace, "minilm", {"service": {"port": 8081}})
    wait_until(
        lambda: (
            child(devcluster, "service", namespace, "minilm")["spec"]["ports"][0]["port"] == 8081
        ),
        what="service port 8081",
    )
    wait_status(devcluster, namespace, "minilm")
    after = child(devcluster, "deployment", namespace, "minilm")
    assert after["metadata"]["generation"] == before["metadata"]["generation"]
    assert after["spec"]["template"] == before["spec"]["template"]
    assert len(replicasets(devcluster, namespace, "minilm")) == 1
    configmap = child(devcluster, "configmap", namespace, "minilm-warmup-profile")
    assert configmap["metadata"]["resourceVersion"] == configmap_rv

    # NodePort -> ClusterIP: the apiserver-assigned node port must not block the change.
    patch(devcluster, namespace, "minilm", {"service": {"type": "ClusterIP"}})
    wait_until(
        lambda: child(devcluster, "service", namespace, "minilm")["spec"]["type"] == "ClusterIP",
        what="service type ClusterIP",
    )
    assert "nodePort" not in child(devcluster, "service", namespace, "minilm")["spec"]["ports"][0]

    # The replica count: no new template either.
    patch(devcluster, namespace, "minilm", {"replicas": 3})
    wait_until(
        lambda: child(devcluster, "deployment", namespace, "minilm")["spec"]["replicas"] == 3,
        what="3 replicas",
    )
    assert len(replicasets(devcluster, namespace, "minilm")) == 1

    # The model revision: a model reload, so a new template and a new ReplicaSet.
    patch(devcluster, namespace, "minilm", {"model": {"revision": "v2"}})

    def reloaded() -> dict[str, Any] | None:
        dep = child(devcluster, "deployment", namespace, "minilm")
        annotations = dep["spec"]["template"]["metadata"]["annotations"]
        return dep if annotations["warmgate.dev/model-revision"] == "v2" else None

    dep = wait_until(reloaded, what="template revision v2")
    (server,) = dep["spec"]["template"]["spec"]["containers"]
    assert "--model-revision=v2" in server["args"]
    old_hash = before["spec"]["template"]["metadata"]["annotations"]["warmgate.dev/spec-hash"]
    assert dep["spec"]["template"]["metadata"]["annotations"]["warmgate.dev/spec-hash"] != old_hash
    wait_until(lambda: len(replicasets(devcluster, namespace, "minilm")) == 2, what="second RS")
    assert child(devcluster, "service", namespace, "minilm")["spec"]["ports"][0]["port"] == 8081


def test_autoscaling_toggle(devcluster: Any, namespace: str, operator: Any) -> None:
    apply(devcluster, namespace, example())
    wait_child(devcluster, "deployment", namespace, "minilm")
    patch(
        devcluster,
        namespace,
        "minilm",
        {"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 5}},
    )
    hpa = wait_child(devcluster, "hpa", namespace, "minilm")
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 5)
    # The HPA scales the EmbeddingService (its scale subresource: serving pods only), and the
    # operator sizes the Deployment from spec.replicas.
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "warmgate.dev/v1alpha1",
        "kind": "EmbeddingService",
        "name": "minilm",
    }
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300
    assert controller_ref(hpa)["kind"] == "EmbeddingService"
    assert child(devcluster, "deployment", namespace, "minilm")["spec"]["replicas"] == 2

    # A decision through the scale subresource (what the HPA writes) sizes the Deployment,
    # the standby pool on top of it; the Deployment itself is the operator's to size.
    devcluster.kubectl("scale", "emb/minilm", "-n", namespace, "--replicas=4")
    wait_until(
        lambda: child(devcluster, "deployment", namespace, "minilm")["spec"]["replicas"] == 4,
        what="the Deployment at the scale's 4",
    )
    patch(devcluster, namespace, "minilm", {"standbyReplicas": 1})
    wait_until(
        lambda: child(devcluster, "deployment", namespace, "minilm")["spec"]["replicas"] == 5,
        what="4 serving + 1 standby",
    )
    service = child(devcluster, "service", namespace, "minilm")
    assert service["spec"]["selector"]["warmgate.dev/role"] == "serving"

    def serving_selector() -> dict[str, Any] | None:
        es = get_json(devcluster, "emb", "minilm", "-n", namespace)
        return es if "warmgate.dev/role=serving" in es["status"].get("selector", "") else None

    es = wait_until(serving_selector, what="the scale selector to name serving pods")
    assert es["status"]["desiredServingReplicas"] == 4
    devcluster.kubectl("scale", "deployment", "minilm", "-n", namespace, "--replicas=1")
    wait_until(
        lambda: child(devcluster, "deployment", namespace, "minilm")["spec"]["replicas"] == 5,
        what="the operator to size the Deployment again",
    )
    assert child(devcluster, "pdb", namespace, "minilm") is not None

    patch(devcluster, namespace, "minilm", {"autoscaling": {"enabled": False}})
    wait_until(
        lambda: child(devcluster, "hpa", namespace, "minilm") is None, what="HPA to be deleted"
    )
    wait_until(
        lambda: child(devcluster, "deployment", namespace, "minilm")["spec"]["replicas"] == 5,
        what="spec.replicas (4) and the pool (1) still in charge",
    )


def test_kubectl_scale(devcluster: Any, namespace: str, operator: Any) -> None:
    apply(devcluster, namespace, example())
    wait_child(devcluster, "deployment", namespace, "minilm")
    devcluster.kubectl("scale", "emb/minilm", "-n", namespace, "--replicas=3")
    wait_until(
        lambda: child(devcluster, "deployment", namespace, "minilm")["spec"]["replicas"] == 3,
        what="Deployment scaled to 3",
    )

    def scaled() -> dict[str, Any] | None:
        scale = get_json(devcluster, "emb", "minilm", "-n", namespace, "--subresource=scale")
        return scale if scale["status"].get("replicas") == 3 else None

    scale = wait_until(scaled, what="scale subresource status 3")
    assert scale["spec"]["replicas"] == 3
    assert "app.kubernetes.io/instance=minilm" in scale["status"]["selector"]


def test_delete_garbage_collects_children(devcluster: Any, namespace: str, operator: Any) -> None:
    apply(devcluster, namespace, example())
    for kind in ("deployment", "service", "poddisruptionbudget"):
        wait_child(devcluster, kind, namespace, "minilm")
    wait_child(devcluster, "configmap", namespace, "minilm-warmup-profile")
    devcluster.kubectl("delete", "emb", "minilm", "-n", namespace, "--timeout=30s")
    for kind in ("deployment", "service", "configmap", "poddisruptionbudget", "replicaset"):
        wait_until(
            lambda kind=kind: not items(devcluster, kind, namespace),
            timeout=90,
            what=f"{kind}s to be garbage collected",
        )


def _converged(cluster: Any, namespace: str, names: set[str]) -> bool:
    deployments = {d["metadata"]["name"] for d in items(cluster, "deployments", namespace)}
    services = {s["metadata"]["name"] for s in items(cluster, "services", namespace)}
    configmaps = {c["metadata"]["name"] for c in items(cluster, "configmaps", namespace)}
    return (
        deployments == names
        and services == names
        and configmaps == {f"{n}-warmup-profile" for n in names}
    )


def test_operator_restart_converges_without_duplicates_or_orphans(
    devcluster: Any, crd: None, namespace: str, tmp_path: Path
) -> None:
    first = OperatorProcess(
        devcluster, tmp_path / "first.log", "--namespace", namespace, "--resync-seconds", RESYNC
    ).start()
    try:
        for name in ("alpha", "beta", "gamma"):
            apply(devcluster, namespace, example(name))
        wait_child(devcluster, "deployment", namespace, "alpha")
    finally:
        first.stop(signal.SIGKILL)  # mid-way: no clean shutdown

    # While it is down: a spec change, a deletion, and a child removed by hand.
    patch(devcluster, namespace, "beta", {"model": {"revision": "v2"}})
    devcluster.kubectl("delete", "emb", "gamma", "-n", namespace)
    devcluster.kubectl("delete", "deployment", "alpha", "-n", namespace)

    second = OperatorProcess(
        devcluster, tmp_path / "second.log", "--namespace", namespace, "--resync-seconds", RESYNC
    ).start()
    try:
        wait_until(
            lambda: _converged(devcluster, namespace, {"alpha", "beta"}),
            timeout=90,
            what="exactly alpha's and beta's children",
        )
        beta = child(devcluster, "deployment", namespace, "beta")
        assert beta["spec"]["template"]["metadata"]["annotations"][
            "warmgate.dev/model-revision"
        ] == ("v2")
        for name in ("alpha", "beta"):
            es = wait_status(devcluster, namespace, name)
            for kind, child_name in (
                ("deployment", name),
                ("service", name),
                ("configmap", f"{name}-warmup-profile"),
                ("pdb", name),
            ):
                obj = child(devcluster, kind, namespace, child_name)
                assert controller_ref(obj)["uid"] == es["metadata"]["uid"], (kind, child_name)
        assert second.alive()
    finally:
        second.stop()
        print((tmp_path / "second.log").read_text(errors="replace")[-4000:])


READ_METHODS = ("GET", "LIST")
CHILD_RESOURCES = (
    "deployments",
    "services",
    "configmaps",
    "horizontalpodautoscalers",
    "poddisruptionbudgets",
)


def child_writes(port: int) -> dict[str, int]:
    """The operator's writes to children so far, read live from its /metrics (a request is
    counted before it is sent): no file written once a second that could predate them."""
    return {
        key: n for key, n in operator_requests(port).items() if key.split()[1] in CHILD_RESOURCES
    }


def reconciles(port: int) -> float:
    return (operator_metrics(port) or {}).get(
        ("warmgate_operator_reconciles_total", (("result", "ok"),)), 0.0
    )


def write_reasons(op: Any) -> list[str]:
    """The operator's log lines for each child it created, updated or deleted, with why."""
    return [
        message
        for message in (line.get("message", "") for line in op.log_lines())
        if message.startswith(("creating ", "updating ", "deleting "))
    ]


def settled_writes(port: int, op: Any, timeout: float = 90) -> dict[str, int]:
    """The operator's child writes once they stay the same over a whole resync and more."""
    gap = float(RESYNC) + 1.5
    previous = child_writes(port)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(gap)
        current = child_writes(port)
        if current == previous:
            return current
        previous = current
    raise AssertionError(
        f"the operator kept writing children for {timeout:g}s: {write_reasons(op)[-10:]}"
    )


def test_idle_operator_writes_nothing_and_reads_nothing(
    devcluster: Any, crd: None, namespace: str, tmp_path: Path
) -> None:
    http_port, kopf_port = procs.free_ports(2)
    started = time.time()
    op = OperatorProcess(
        devcluster, tmp_path / "idle.log", "--namespace", namespace,
        "--resync-seconds", RESYNC, "--http-address", f"127.0.0.1:{http_port}",
        "--kopf-probe-address", f"127.0.0.1:{kopf_port}",
    ).start()  # fmt: skip
    try:
        # kopf's own liveness endpoint: its probe says the first listings are in.
        def kopf_probe() -> dict[str, Any] | None:
            try:
                url = f"http://127.0.0.1:{kopf_port}/healthz"
                with urllib.request.urlopen(url, timeout=2) as answer:
                    return json.loads(answer.read())
            except OSError:
                return None

        assert wait_until(kopf_probe, timeout=30, what="kopf's liveness endpoint") == {
            "listed": True
        }

        # The endpoint of the chart's liveness probe, and of Prometheus.
        def healthy() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/healthz", timeout=2):
                    return True
            except OSError:
                return False

        wait_until(healthy, timeout=30, what="the operator's liveness endpoint")
        wait_until(lambda: operator_metrics(http_port), timeout=30, what="the operator's /metrics")
        # No pods: nothing in the cluster changes on its own.
        apply(devcluster, namespace, example("quiet", replicas=0))
        # Every child kind (HPA, PDB, a NodePort Service whose port the apiserver assigns).
        apply(
            devcluster,
            namespace,
            example("busy", autoscaling={"enabled": True, "minReplicas": 2, "maxReplicas": 3}),
        )
        wait_child(devcluster, "hpa", namespace, "busy")
        wait_child(devcluster, "pdb", namespace, "busy")

        def quiet_ready() -> bool:
            es = wait_status(devcluster, namespace, "quiet")
            ready = {c["type"]: c for c in es["status"]["conditions"]}["Ready"]
            return ready["status"] == "True"

        wait_until(quiet_ready, what="quiet Ready (scaled to zero)")
        wait_status(devcluster, namespace, "busy")

        def versions() -> dict[str, str]:
            out = {}
            for kind in ("emb", "deployments", "services", "configmaps"):
                for obj in get_json(devcluster, kind, "-n", namespace)["items"]:
                    if obj["metadata"]["name"].startswith("quiet"):
                        out[f"{kind}/{obj['metadata']['name']}"] = obj["metadata"][
                            "resourceVersion"
                        ]
            return out

        # Idle starts once the operator has converged: its child writes (server-side apply
        # creates with a PATCH too) stop changing over a whole resync and more. An operator
        # that keeps writing never converges and fails here, with its reasons.
        writes_before = settled_writes(http_port, op)
        reconciles_before, reasons_before = reconciles(http_port), len(write_reasons(op))
        reads_before = operator_requests(http_port, READ_METHODS)
        before = versions()
        window_start = time.time()
        time.sleep(3 * float(RESYNC) + 2)  # several resyncs
        writes_after = child_writes(http_port)
        reads_after = operator_requests(http_port, READ_METHODS)
        window_end = time.time()
        # The apiserver's own record: no write from the operator (its client, or kopf's) to
        # anything in the namespace. Independent of the operator's counting.
        audited = audit_writes(
            devcluster.config.audit_log,
            window_start,
            window_end,
            namespace,
            user_agents=(OPERATOR_USER_AGENT, "kopf/"),
        )
        # Each write in the idle window, with the field the operator found different.
        why = write_reasons(op)[reasons_before:]
        changed = {
            key: (writes_before.get(key, 0), n)
            for key, n in writes_after.items()
            if n != writes_before.get(key, 0)
        }
        assert audited == [], [describe_audit(event) for event in audited]
        # Reconcile and the resync read the watch cache: no GET or LIST of anything (the
        # watches themselves renew every few minutes, whatever the number of services). The
        # apiserver's record of reads of EmbeddingServices and aliases says the same for kopf,
        # which carries them, as for the operator's own client (its audits).
        assert reads_after == reads_before
        read = audit_writes(
            devcluster.config.audit_log, window_start, window_end, namespace,
            user_agents=(OPERATOR_USER_AGENT, "kopf/"), verbs=READ_VERBS,
        )  # fmt: skip
        assert [e for e in read if e["verb"] != "watch"] == [], [describe_audit(e) for e in read]
        assert changed == {}, f"child writes while idle (before, after): {changed}; why: {why}"
        assert versions() == before
        assert reconciles(http_port) > reconciles_before  # it did look
        # kopf listed and watched the EmbeddingServices (it carries them) and wrote nothing,
        # over the whole test.
        whole = audit_writes(
            devcluster.config.audit_log, started, time.time(), namespace, user_agents=("kopf/",),
            verbs=READ_VERBS,
        )  # fmt: skip
        assert {(e["verb"], e["objectRef"]["resource"]) for e in whole} >= {
            ("list", "embeddingservices"),
            ("watch", "embeddingservices"),
        }, [describe_audit(e) for e in whole]
        kopf_writes = audit_writes(
            devcluster.config.audit_log, started, time.time(), namespace, user_agents=("kopf/",)
        )
        assert kopf_writes == [], [describe_audit(e) for e in kopf_writes]
    finally:
        op.stop()
    lines = [line for line in op.log_lines() if "api requests made" in line.get("message", "")]
    assert lines, "the operator reports its API requests on exit"


def test_operator_runs_with_exactly_its_rbac_rules(
    devcluster: Any, crd: None, namespace: str, tmp_path: Path
) -> None:
    """Run as a ServiceAccount bound to the rules in warmgate_operator/rbac.yaml: a missing
    permission stalls the reconcile and fails the test."""
    from warmgate_operator import rbac

    role = rbac.cluster_role(f"warmgate-operator-{namespace}")
    devcluster.kubectl("apply", "-f", "-", input=json.dumps(role))
    devcluster.kubectl("create", "serviceaccount", "warmgate-operator", "-n", namespace)
    devcluster.kubectl(
        "create", "clusterrolebinding", role["metadata"]["name"],
        f"--clusterrole={role['metadata']['name']}",
        f"--serviceaccount={namespace}:warmgate-operator",
    )  # fmt: skip
    try:
        token = devcluster.kubectl(
            "create", "token", "warmgate-operator", "-n", namespace, "--duration=1h"
        ).stdout.strip()
        admin = yaml.safe_load(Path(devcluster.kubeconfig).read_text())
        cluster = admin["clusters"][0]
        kubeconfig = tmp_path / "operator.kubeconfig"
        kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [cluster],
                    "users": [{"name": "operator", "user": {"token": token}}],
                    "contexts": [
                        {
                            "name": "operator",
                            "context": {"cluster": cluster["name"], "user": "operator"},
                        }
                    ],
                    "current-context": "operator",
                }
            )
        )
        as_operator = SimpleNamespace(env=dict(devcluster.env, KUBECONFIG=str(kubeconfig)))
        # Cluster-wide, as the chart runs it by default.
        op = OperatorProcess(as_operator, tmp_path / "rbac.log", "--resync-seconds", RESYNC).start()
        try:
            apply(devcluster, namespace, example(autoscaling={"enabled": True, "minReplicas": 2}))
            for kind in ("deployment", "service", "hpa", "pdb"):
                wait_child(devcluster, kind, namespace, "minilm")
            es = wait_status(devcluster, namespace, "minilm")
            conditions = {c["type"]: c for c in es["status"]["conditions"]}
            assert conditions["Degraded"]["reason"] not in ("ApplyFailed", "ChildConflict")
            # Aliases: watched, and their status written.
            apply(devcluster, namespace, alias_body("search", "minilm"))
            alias_ready(devcluster, namespace, "search", "Resolved")
            patch(devcluster, namespace, "minilm", {"autoscaling": {"enabled": False}})
            wait_until(
                lambda: child(devcluster, "hpa", namespace, "minilm") is None, what="HPA gone"
            )
            events = devcluster.kubectl("get", "events", "-n", namespace).stdout
            assert "Created" in events
            log = (tmp_path / "rbac.log").read_text(errors="replace")
            # An RBAC denial reads `... is forbidden: User "system:serviceaccount:..." cannot ...`.
            assert "forbidden: User" not in log, log[-3000:]
        finally:
            op.stop()
    finally:
        devcluster.kubectl("delete", "clusterrolebinding,clusterrole", role["metadata"]["name"],
                           check=False)  # fmt: skip


def test_a_service_deleted_while_the_watch_was_away_gets_no_children_again(
    devcluster: Any, crd: None, namespace: str, tmp_path: Path
) -> None:
    """A real relist: the operator is stopped (SIGSTOP) while the apiserver restarts on a
    compacted etcd, and two EmbeddingServices are deleted meanwhile: one beside another that
    stays, and the only one of a second watched namespace. When the operator runs again its
    watches cannot go on from where they were (410): kopf lists the services again (the
    second namespace's listing is empty, and kopf tells nothing of it), the operator's own
    watches list the children again, and its audits (or the owner GET before a create) find
    both services gone. Neither gets its children again, while the one that stays is still
    reconciled."""
    lone = f"{namespace}-lone"
    devcluster.kubectl("create", "namespace", lone)
    (http_port,) = procs.free_ports(1)
    op = OperatorProcess(
        devcluster, tmp_path / "relist.log", "--namespace", namespace, "--namespace", lone,
        "--resync-seconds", RESYNC, "--http-address", f"127.0.0.1:{http_port}",
    ).start()  # fmt: skip
    try:
        for name in ("kept", "gone"):
            apply(devcluster, namespace, example(name, replicas=0))
        apply(devcluster, lone, example("alone", replicas=0))
        for where, name in ((namespace, "kept"), (namespace, "gone"), (lone, "alone")):
            wait_child(devcluster, "deployment", where, name)
            wait_status(devcluster, where, name)
        assert op.proc is not None
        writes_before = len(write_reasons(op))
        os.kill(op.proc.pid, signal.SIGSTOP)
        try:
            devcluster.restart_apiserver(compact_etcd=True)
            devcluster.kubectl("delete", "emb", "gone", "-n", namespace, "--wait=true")
            devcluster.kubectl("delete", "emb", "alone", "-n", lone, "--wait=true")
            for where, name in ((namespace, "gone"), (lone, "alone")):
                wait_until(
                    lambda where=where, name=name: (
                        child(devcluster, "deployment", where, name) is None
                    ),
                    timeout=60,
                    what=f"the garbage collector to delete {name}'s Deployment",
                )
        finally:
            os.kill(op.proc.pid, signal.SIGCONT)

        def relisted() -> bool:
            metrics = operator_metrics(http_port) or {}
            return all(
                metrics.get(("warmgate_operator_watch_relists_total", (("resource", plural),)))
                for plural in ("embeddingservices", "deployments")
            )

        wait_until(relisted, timeout=60, what="the operator to list again after the 410")

        def forgotten(where: str, name: str) -> bool:
            """The operator let the service go: its audit found it gone, or the owner GET that
            precedes a create did, when a child watch's relist made a reconcile look first
            (both are the feed's design, and which comes first is a race)."""
            said = {line.get("message", "") for line in op.log_lines()}
            return (
                f"embeddingservices in {where}: 1 gone while the watch was away" in said
                or f"{where}/{name} was deleted while the watch was away: forgotten" in said
            )

        for where, name in ((namespace, "gone"), (lone, "alone")):
            wait_until(
                lambda where=where, name=name: forgotten(where, name),
                timeout=30,
                what=f"the operator to forget {where}/{name}",
            )
        looked = reconciles(http_port)
        wait_until(
            lambda: reconciles(http_port) >= looked + 3,
            timeout=30,
            what="three more reconciles (resyncs)",
        )
        assert child(devcluster, "deployment", namespace, "gone") is None
        assert child(devcluster, "deployment", lone, "alone") is None
        assert child(devcluster, "deployment", namespace, "kept") is not None
        since = write_reasons(op)[writes_before:]
        ghosts = ("/gone", "/alone")  # their Deployment, Service, ConfigMap (-warmup-profile)
        assert not [r for r in since if any(g in r.split(":")[0] for g in ghosts)], since
    finally:
        op.stop()
        print("\n".join(op.log_path.read_text(errors="replace").splitlines()[-40:]))
        devcluster.kubectl("delete", "namespace", lone, "--wait=false", check=False)


def alias_body(name: str, service: str) -> dict[str, Any]:
    return {
        "apiVersion": "warmgate.dev/v1alpha1",
        "kind": "EmbeddingAlias",
        "metadata": {"name": name},
        "spec": {"service": service},
    }


def alias_ready(cluster: Any, namespace: str, name: str, reason: str) -> dict[str, Any]:
    """The alias once its Ready condition has `reason` (for its current generation)."""

    def reached() -> dict[str, Any] | None:
        alias = get_json(cluster, "emba", name, "-n", namespace) or {}
        status = alias.get("status") or {}
        ready = {c["type"]: c for c in status.get("conditions") or []}.get("Ready") or {}
        current = status.get("observedGeneration") == alias["metadata"]["generation"]
        return alias if current and ready.get("reason") == reason else None

    return wait_until(reached, timeout=60, what=f"emba/{name} {reason}")


def ready_of(obj: dict[str, Any]) -> dict[str, Any]:
    return {c["type"]: c for c in obj["status"]["conditions"]}["Ready"]


def test_an_alias_status_follows_the_names_of_its_namespace(
    devcluster: Any, namespace: str, operator: Any
) -> None:
    """Resolved; refused while an older EmbeddingService has its name (the message names
    both, a Warning Event says it once); TargetMissing once its service is gone. The
    operator writes nothing while the names stay as they are."""
    apply(devcluster, namespace, example("bge-v1", replicas=0))
    apply(devcluster, namespace, alias_body("search", "bge-v1"))
    alias = alias_ready(devcluster, namespace, "search", "Resolved")
    assert ready_of(alias)["status"] == "True"
    assert alias["status"]["service"] == "bge-v1"
    assert ready_of(alias)["message"] == (
        f"{namespace}/search is served by EmbeddingService {namespace}/bge-v1"
    )
    table = devcluster.kubectl("get", "emba", "-n", namespace).stdout
    assert table.splitlines()[1].split()[:4] == ["search", "bge-v1", "True", "Resolved"]
    # The names stay as they are (resyncs every 2 s, the service's status settling): no write.
    version = alias["metadata"]["resourceVersion"]
    time.sleep(3 * float(RESYNC))
    assert (
        get_json(devcluster, "emba", "search", "-n", namespace)["metadata"]["resourceVersion"]
        == version
    )

    # An EmbeddingService named "search", older than the alias "search" made again after it.
    devcluster.kubectl("delete", "emba", "search", "-n", namespace)
    apply(devcluster, namespace, example("search", replicas=0))
    time.sleep(1.1)  # creation times count in seconds; a tie goes to the EmbeddingService anyway
    apply(devcluster, namespace, alias_body("search", "bge-v1"))
    alias = alias_ready(devcluster, namespace, "search", "NameConflict")
    message = ready_of(alias)["message"]
    assert ready_of(alias)["status"] == "False" and "service" not in alias["status"]
    assert f"EmbeddingService {namespace}/search" in message
    assert f"EmbeddingAlias {namespace}/search" in message
    assert "older claim (EmbeddingService" in message
    time.sleep(2 * float(RESYNC))

    def warnings() -> list[dict[str, Any]]:
        events = get_json(devcluster, "events", "-n", namespace)["items"]
        return [
            e
            for e in events
            if e["reason"] == "NameConflict" and e["involvedObject"]["kind"] == "EmbeddingAlias"
        ]

    (warning,) = wait_until(warnings, timeout=30, what="a NameConflict event on the alias")
    assert warning["type"] == "Warning" and warning.get("count", 1) == 1

    # The older claim goes: the alias takes its name. Then its own target goes.
    devcluster.kubectl("delete", "emb", "search", "-n", namespace)
    alias_ready(devcluster, namespace, "search", "Resolved")
    devcluster.kubectl("delete", "emb", "bge-v1", "-n", namespace)
    alias = alias_ready(devcluster, namespace, "search", "TargetMissing")
    assert "service" not in alias["status"]
    assert (
        f"EmbeddingService {namespace}/bge-v1, which does not exist" in ready_of(alias)["message"]
    )


def test_an_idle_service_is_scaled_to_zero(devcluster: Any, namespace: str, operator: Any) -> None:
    """No request for idleSeconds (no router, no annotation; its pods cannot pull their image,
    so it is Degraded and the clock runs from its creation, not from a first serving pod):
    spec.replicas 0 through the scale subresource, no pod, Ready False with reason
    ScaledToZero, while the HPA keeps 1..max and stops acting at 0. No server ever runs."""
    body = example(
        "sleepy",
        replicas=1,
        standbyReplicas=1,
        autoscaling={
            "enabled": True,
            "minReplicas": 0,
            "maxReplicas": 3,
            "scaleToZero": {"idleSeconds": 10},
        },
    )
    started = time.time()
    apply(devcluster, namespace, body)
    created = get_json(devcluster, "emb", "sleepy", "-n", namespace)["metadata"]
    hpa = wait_child(devcluster, "hpa", namespace, "sleepy")
    assert hpa["spec"]["minReplicas"] == 1
    deployment = wait_child(devcluster, "deployment", namespace, "sleepy")
    assert deployment["spec"]["replicas"] == 2  # one serving, one standby

    def asleep() -> dict[str, Any] | None:
        es = get_json(devcluster, "emb", "sleepy", "-n", namespace)
        return es if es["spec"]["replicas"] == 0 else None

    es = wait_until(asleep, timeout=40, what="spec.replicas 0")
    # Not before idleSeconds since its creation.
    events = get_json(devcluster, "events", "-n", namespace)["items"]
    (scaled,) = [e for e in events if e["reason"] == "ScaledToZero"]
    assert scaled["type"] == "Normal" and scaled["involvedObject"]["name"] == "sleepy"
    idle = re.match(r"no request for (\d+) s", scaled["message"])
    assert idle is not None and 10 <= int(idle.group(1)) < 60, scaled["message"]
    # Written through the scale subresource, as the HPA and kubectl scale write it: the
    # apiserver's own record.
    scale_writes = [
        event
        for event in audit_writes(
            devcluster.config.audit_log,
            started,
            time.time(),
            namespace,
            user_agents=(OPERATOR_USER_AGENT,),
        )
        if (event.get("objectRef") or {}).get("resource") == "embeddingservices"
        and (event.get("objectRef") or {}).get("subresource") == "scale"
    ]
    assert [(e["verb"], e["objectRef"]["name"]) for e in scale_writes] == [("patch", "sleepy")]
    decided = event_time(scaled.get("eventTime") or scaled["firstTimestamp"])
    assert decided - event_time(created["creationTimestamp"]) >= 10
    wait_until(
        lambda: child(devcluster, "deployment", namespace, "sleepy")["spec"]["replicas"] == 0,
        what="the Deployment at 0, standby pool included",
    )

    def reported() -> dict[str, Any] | None:
        es = get_json(devcluster, "emb", "sleepy", "-n", namespace)
        ready = ready_of(es) if (es.get("status") or {}).get("conditions") else {}
        return es if ready.get("reason") == "ScaledToZero" else None

    es = wait_until(reported, timeout=30, what="Ready reason ScaledToZero")
    ready = ready_of(es)
    assert ready["status"] == "False"
    assert "a request through warmgate-router scales it back to 1" in ready["message"]
    assert es["status"]["scaledToZeroAt"]
    conditions = {c["type"]: c for c in es["status"]["conditions"]}
    assert conditions["Degraded"]["status"] == "False"  # its pods could not pull: no matter
    assert "ScaledToZero" in devcluster.kubectl("get", "emb", "sleepy", "-n", namespace).stdout
    assert child(devcluster, "hpa", namespace, "sleepy")["spec"]["minReplicas"] == 1

    def hpa_disabled() -> bool:
        hpa = child(devcluster, "hpa", namespace, "sleepy") or {}
        active = {c["type"]: c for c in (hpa.get("status") or {}).get("conditions") or []}
        return active.get("ScalingActive", {}).get("reason") == "ScalingDisabled"

    wait_until(hpa_disabled, timeout=60, what="the HPA to stop acting at 0 (ScalingDisabled)")
    assert asleep() is not None  # and it did not scale it back up
