"""Reconcile against an in-memory API: children, status, events, and no writes when idle."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.fakes import FakeClient

from warmgate_contract.names import (
    LAST_REQUEST_ANNOTATION,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    ROLE_LABEL,
    ROLE_SERVING,
    SERVICE_LABEL,
)
from warmgate_kube.kinds import CONFIGMAP, DEPLOYMENT, EMBEDDING_SERVICE, HPA, PDB, POD, SERVICE
from warmgate_operator import idle
from warmgate_operator.config import OperatorConfig
from warmgate_operator.events import EventRecorder
from warmgate_operator.metrics import Metrics
from warmgate_operator.reconcile import Reconciler

ROOT = Path(__file__).resolve().parents[2]


def new_es(client: FakeClient, spec: dict[str, Any] | None = None) -> dict[str, Any]:
    body = yaml.safe_load((ROOT / "examples" / "minilm.yaml").read_text())
    body["metadata"].update(namespace="default", generation=1)
    if spec is not None:
        body["spec"] = spec
    return client.put(EMBEDDING_SERVICE, body)


def reconciler(client: FakeClient, config: OperatorConfig | None = None) -> Reconciler:
    return Reconciler(
        client=client,  # type: ignore[arg-type]
        config=config or OperatorConfig(),
        recorder=EventRecorder(client),
        cache=client.cache,
        clock=lambda: "2026-11-29T22:00:00Z",
    )


async def reconcile_latest(client: FakeClient, rec: Reconciler) -> Any:
    body = client.find(EMBEDDING_SERVICE, "default", "minilm")
    return await rec(copy.deepcopy(body))


async def test_first_reconcile_creates_every_child_and_the_status() -> None:
    client = FakeClient()
    es = new_es(client)
    writes = client.writes
    result = await reconcile_latest(client, reconciler(client))
    for kind in (CONFIGMAP, SERVICE, DEPLOYMENT, PDB):
        name = "minilm-warmup-profile" if kind is CONFIGMAP else "minilm"
        child = client.find(kind, "default", name)
        assert child is not None, kind
        assert child["metadata"]["ownerReferences"][0]["uid"] == es["metadata"]["uid"]
    assert client.find(HPA, "default", "minilm") is None
    assert client.find(DEPLOYMENT, "default", "minilm")["spec"]["template"]["spec"]["containers"][
        0
    ]["image"] == ("ghcr.io/warmgate/warmgate-server:0.1.0")
    status = client.find(EMBEDDING_SERVICE, "default", "minilm")["status"]
    assert status["observedGeneration"] == 1
    assert result.requeue_after is None
    assert client.cache.services.get("default", "minilm")["status"] == status
    reasons = sorted(e["reason"] for e in client.events)
    assert reasons == ["Created"]
    assert client.events[0]["message"] == (
        "created ConfigMap minilm-warmup-profile, Service minilm, Deployment minilm, "
        "PodDisruptionBudget minilm"
    )
    assert client.writes - writes == 4 + 1 + 1  # children, status, one event


async def test_the_operators_pull_policy_reaches_pods_whose_service_sets_none() -> None:
    client = FakeClient()
    new_es(client)
    rec = reconciler(client, OperatorConfig(server_image_pull_policy="Never"))
    await reconcile_latest(client, rec)
    (server,) = client.find(DEPLOYMENT, "default", "minilm")["spec"]["template"]["spec"][
        "containers"
    ]
    assert server["imagePullPolicy"] == "Never"


async def test_the_reconciled_deployment_carries_the_operators_pull_secrets() -> None:
    client = FakeClient()
    new_es(client)
    rec = reconciler(client, OperatorConfig(server_image_pull_secrets=("regcred",)))
    await reconcile_latest(client, rec)
    pod = client.find(DEPLOYMENT, "default", "minilm")["spec"]["template"]["spec"]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]


async def test_a_second_reconcile_makes_no_request() -> None:
    """What is there comes from the watch cache: a reconcile (a child's event, the resync)
    that finds everything as it should be neither reads nor writes."""
    client = FakeClient()
    new_es(client)
    rec = reconciler(client)
    await reconcile_latest(client, rec)
    client.log.clear()
    await reconcile_latest(client, rec)
    assert client.log == []


async def test_spec_change_updates_only_what_changed() -> None:
    client = FakeClient()
    new_es(client)
    rec = reconciler(client)
    await reconcile_latest(client, rec)
    body = client.find(EMBEDDING_SERVICE, "default", "minilm")
    body["spec"]["service"]["port"] = 8081
    body["metadata"]["generation"] = 2
    client.log.clear()
    await reconcile_latest(client, rec)
    patched = [entry[1] for entry in client.log if entry[0] == "PATCH"]
    assert patched == ["Service", "EmbeddingService/status"]


async def test_autoscaling_toggle_creates_and_removes_the_hpa() -> None:
    client = FakeClient()
    new_es(client)
    rec = reconciler(client)
    await reconcile_latest(client, rec)
    body = client.find(EMBEDDING_SERVICE, "default", "minilm")
    body["spec"]["autoscaling"] = {"enabled": True, "minReplicas": 2, "maxReplicas": 5}
    await reconcile_latest(client, rec)
    assert client.find(HPA, "default", "minilm")["spec"]["maxReplicas"] == 5
    assert client.find(DEPLOYMENT, "default", "minilm")["spec"]["replicas"] == 2  # kept
    body["spec"]["autoscaling"] = {"enabled": False}
    await reconcile_latest(client, rec)
    assert client.find(HPA, "default", "minilm") is None
    assert any(e["reason"] == "Deleted" for e in client.events)


async def test_failed_apply_is_degraded_and_retried() -> None:
    client = FakeClient()
    new_es(client)
    client.fail_apply_for.add("Deployment")
    result = await reconcile_latest(client, reconciler(client))
    assert result.requeue_after is not None
    status = client.find(EMBEDDING_SERVICE, "default", "minilm")["status"]
    degraded = {c["type"]: c for c in status["conditions"]}["Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("True", "ApplyFailed")
    assert any(e["type"] == "Warning" and e["reason"] == "ApplyFailed" for e in client.events)


@pytest.mark.parametrize("repeat", [1, 3])
async def test_invalid_spec_is_reported_once(repeat: int) -> None:
    client = FakeClient()
    new_es(client, spec={"model": {"id": "m"}, "warmup": {"sequenceBuckets": [64, 32]}})
    rec = reconciler(client)
    for _ in range(repeat):
        await reconcile_latest(client, rec)
    status = client.find(EMBEDDING_SERVICE, "default", "minilm")["status"]
    ready = {c["type"]: c for c in status["conditions"]}["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert client.find(DEPLOYMENT, "default", "minilm") is None
    assert [e["reason"] for e in client.events] == ["InvalidSpec"]


async def test_deleting_object_is_left_to_garbage_collection() -> None:
    client = FakeClient()
    body = new_es(client)
    body["metadata"]["deletionTimestamp"] = "2026-11-29T22:00:00Z"
    writes = client.writes
    await reconciler(client)(body)
    assert client.writes == writes
    assert client.find(DEPLOYMENT, "default", "minilm") is None


async def test_a_spec_change_writes_the_changed_child_at_once_and_reads_nothing() -> None:
    client = FakeClient()
    new_es(client)
    rec = reconciler(client)
    await reconcile_latest(client, rec)
    body = client.find(EMBEDDING_SERVICE, "default", "minilm")
    body["spec"]["service"]["port"] = 9000
    client.log.clear()
    await reconcile_latest(client, rec)
    assert [(m, k) for m, k, _ in client.log] == [("PATCH", "Service"), ("POST", "Event")]
    assert client.find(SERVICE, "default", "minilm")["spec"]["ports"][0]["port"] == 9000


async def test_an_object_of_a_childs_name_that_is_not_warmgates_is_not_taken_over() -> None:
    """The cache holds only objects labelled as warmgate's: before creating a child, the
    name is read, and a Service someone made by hand stays theirs."""
    client = FakeClient()
    new_es(client)
    client.put(SERVICE, {"metadata": {"name": "minilm", "namespace": "default"}, "spec": {}})
    await reconcile_latest(client, reconciler(client))
    assert client.find(SERVICE, "default", "minilm")["spec"] == {}
    status = client.find(EMBEDDING_SERVICE, "default", "minilm")["status"]
    degraded = {c["type"]: c for c in status["conditions"]}["Degraded"]
    assert degraded["reason"] == "ChildConflict" and "Service default/minilm" in degraded["message"]


async def test_an_older_alias_of_the_services_own_name_is_a_conflict_condition() -> None:
    """An EmbeddingAlias older than the EmbeddingService of its name keeps that name on
    warmgate-router: the EmbeddingService's Conflict condition says so, naming both, and
    turns False again once the alias is gone. The service itself still serves."""
    from warmgate_kube.kinds import EMBEDDING_ALIAS

    client = FakeClient()
    body = new_es(client)
    body["metadata"]["creationTimestamp"] = "2026-11-02T00:00:00Z"
    client.put(EMBEDDING_SERVICE, body)
    alias = {
        "apiVersion": "warmgate.dev/v1alpha1",
        "kind": "EmbeddingAlias",
        "metadata": {"name": "minilm", "namespace": "default",
                     "creationTimestamp": "2026-11-01T00:00:00Z"},
        "spec": {"service": "other"},
    }  # fmt: skip
    client.put(EMBEDDING_ALIAS, alias)
    rec = reconciler(client)
    await reconcile_latest(client, rec)
    conditions = {c["type"]: c for c in client.find(EMBEDDING_SERVICE, "default", "minilm")[
        "status"]["conditions"]}  # fmt: skip
    conflict = conditions["Conflict"]
    assert (conflict["status"], conflict["reason"]) == ("True", "NameConflict")
    assert "EmbeddingAlias default/minilm" in conflict["message"], conflict
    assert "EmbeddingService default/minilm" in conflict["message"], conflict
    assert conditions["Degraded"]["status"] == "False"

    await client.delete(EMBEDDING_ALIAS, "default", "minilm")
    await reconcile_latest(client, rec)
    status = client.find(EMBEDDING_SERVICE, "default", "minilm")["status"]
    conflict = {c["type"]: c for c in status["conditions"]}["Conflict"]
    assert (conflict["status"], conflict["reason"]) == ("False", "NoConflict")


T0 = 1_780_000_000.0  # a creation time; the reconciler's clock is set relative to it


def sleepy_es(client: FakeClient, idle_seconds: int = 60, **spec: Any) -> dict[str, Any]:
    """An EmbeddingService with scale to zero, created at T0."""
    body = yaml.safe_load((ROOT / "examples" / "minilm.yaml").read_text())
    body["metadata"].update(
        namespace="default", generation=1, creationTimestamp=idle.stamp(T0), annotations={}
    )
    body["spec"].update(
        replicas=1,
        autoscaling={
            "enabled": True,
            "minReplicas": 0,
            "maxReplicas": 3,
            "scaleToZero": {"idleSeconds": idle_seconds},
        },
        **spec,
    )
    return client.put(EMBEDDING_SERVICE, body)


def server_pod(
    client: FakeClient,
    name: str = "minilm-a",
    waiting: str | None = None,
    created: float | None = None,
) -> None:
    """A pod of minilm in the watch cache: Ready and serving, or its container waiting for
    `waiting` (an image that will not pull); created at `created` when given."""
    labels = {MANAGED_BY_LABEL: MANAGED_BY, SERVICE_LABEL: "minilm", ROLE_LABEL: ROLE_SERVING}
    status: dict[str, Any] = {"conditions": [{"type": "Ready", "status": str(not waiting)}]}
    if waiting:
        status["containerStatuses"] = [
            {"name": "server", "state": {"waiting": {"reason": waiting}}}
        ]
    meta: dict[str, Any] = {"name": name, "namespace": "default", "labels": labels}
    if created is not None:
        meta["creationTimestamp"] = idle.stamp(created)
    client.put(POD, {"metadata": meta, "status": status})


def clocked(client: FakeClient, now: list[float], metrics: Metrics | None = None) -> Reconciler:
    return Reconciler(
        client=client,  # type: ignore[arg-type]
        config=OperatorConfig(),
        recorder=EventRecorder(client),
        cache=client.cache,
        metrics=metrics,
        clock=lambda: "2026-11-29T22:00:00Z",
        now=lambda: now[0],
    )


async def test_an_idle_service_is_scaled_to_zero_and_then_runs_no_pod() -> None:
    client, metrics, now = FakeClient(), Metrics(), [T0 + 1]
    sleepy_es(client, standbyReplicas=1)
    server_pod(client)
    rec = clocked(client, now, metrics)
    result = await reconcile_latest(client, rec)
    status = client.find(EMBEDDING_SERVICE, "default", "minilm")["status"]
    assert status["scaleToZero"] == {"awakeAt": idle.stamp(T0 + 1)}  # its first pod serves
    assert result.recheck_after == pytest.approx(60)  # when the idle window would end
    assert result.requeue_after is None
    assert client.find(DEPLOYMENT, "default", "minilm")["spec"]["replicas"] == 1 + 1
    assert client.find(HPA, "default", "minilm")["spec"]["minReplicas"] == 1
    now[0] = T0 + 30
    assert (await reconcile_latest(client, rec)).recheck_after == pytest.approx(31)

    now[0] = T0 + 61
    client.log.clear()
    result = await reconcile_latest(client, rec)
    # One write, through the scale subresource (as the HPA and kubectl scale do), and an event.
    assert [(m, k) for m, k, _ in client.log] == [
        ("PATCH", "EmbeddingService/scale"),
        ("POST", "Event"),
    ]
    assert client.find(EMBEDDING_SERVICE, "default", "minilm")["spec"]["replicas"] == 0
    (event,) = [e for e in client.events if e["reason"] == "ScaledToZero"]
    assert event["type"] == "Normal"
    assert event["message"].startswith("no request for 60 s (autoscaling.scaleToZero.idle")
    assert metrics.value("warmgate_operator_scaled_to_zero_total") == 1

    # The scale write's own event reconciles again: no pod at all, the standby pool included.
    now[0] = T0 + 62
    result = await reconcile_latest(client, rec)
    assert result.recheck_after is None
    assert client.find(DEPLOYMENT, "default", "minilm")["spec"]["replicas"] == 0
    assert client.find(HPA, "default", "minilm")["spec"]["minReplicas"] == 1
    status = client.find(EMBEDDING_SERVICE, "default", "minilm")["status"]
    ready = {c["type"]: c for c in status["conditions"]}["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "ScaledToZero")
    assert ready["message"] == (
        "scaled to zero after 61 s without requests; a request through warmgate-router "
        "scales it back to 1"
    )
    assert status["scaledToZeroAt"] == idle.stamp(T0 + 62)
    # Idle at zero: later reconciles (the resync) write nothing.
    now[0] = T0 + 5_000
    client.log.clear()
    await reconcile_latest(client, rec)
    assert client.log == []
    assert metrics.value("warmgate_operator_scaled_to_zero_total") == 1


async def test_a_request_annotation_restarts_the_idle_window_and_writes_nothing() -> None:
    """warmgate-router writes the annotation every few seconds per busy service: each write
    reconciles, and each reconcile must find nothing to write."""
    client, now = FakeClient(), [T0 + 30]
    sleepy_es(client)
    server_pod(client)
    rec = clocked(client, now)
    await reconcile_latest(client, rec)
    for seconds in (40, 50, 100, 150):
        body = client.find(EMBEDDING_SERVICE, "default", "minilm")
        body["metadata"]["annotations"][LAST_REQUEST_ANNOTATION] = idle.stamp(T0 + seconds - 5)
        client.put(EMBEDDING_SERVICE, body)  # a new resourceVersion, as the patch makes
        now[0] = T0 + seconds
        client.log.clear()
        result = await reconcile_latest(client, rec)
        assert client.log == [], seconds  # no read, no child write, no status write
        assert result.recheck_after == pytest.approx(55)
    assert client.find(EMBEDDING_SERVICE, "default", "minilm")["spec"]["replicas"] == 1


async def test_a_request_annotated_after_the_decision_was_read_keeps_the_service_up() -> None:
    """The scale write holds only if the object is still the one the decision read: a
    request annotation written meanwhile refuses it, and its own event reconciles again."""
    client, metrics, now = FakeClient(), Metrics(), [T0 + 30]
    sleepy_es(client)
    server_pod(client)
    rec = clocked(client, now, metrics)
    await reconcile_latest(client, rec)
    stale = copy.deepcopy(client.find(EMBEDDING_SERVICE, "default", "minilm"))
    fresh = client.find(EMBEDDING_SERVICE, "default", "minilm")
    fresh["metadata"]["annotations"][LAST_REQUEST_ANNOTATION] = idle.stamp(T0 + 70)
    client.put(EMBEDDING_SERVICE, fresh)
    now[0] = T0 + 91
    await rec(stale)
    assert client.find(EMBEDDING_SERVICE, "default", "minilm")["spec"]["replicas"] == 1
    assert metrics.value("warmgate_operator_scaled_to_zero_total") == 0
    assert not [e for e in client.events if e["reason"] == "ScaledToZero"]
    result = await reconcile_latest(client, rec)
    assert result.recheck_after == pytest.approx(39)


async def test_a_starting_service_is_kept_up_unless_its_pods_fail() -> None:
    """Until a first pod serves (after the creation, or a wake) the idle clock waits: a model
    may take longer to load than idleSeconds. A pod that cannot pull its image keeps nothing
    up."""
    client, now = FakeClient(), [T0 + 500]
    sleepy_es(client, idle_seconds=10)
    rec = clocked(client, now)
    result = await reconcile_latest(client, rec)
    assert result.recheck_after is None  # the pod's own events reconcile again
    assert client.find(EMBEDDING_SERVICE, "default", "minilm")["spec"]["replicas"] == 1
    server_pod(client, waiting="ErrImagePull")
    now[0] = T0 + 501
    await reconcile_latest(client, rec)
    assert client.find(EMBEDDING_SERVICE, "default", "minilm")["spec"]["replicas"] == 0


async def test_a_wake_is_recorded_and_the_wake_is_never_cut_short() -> None:
    client, now = FakeClient(), [T0 + 100]
    sleepy_es(client, idle_seconds=10)
    body = client.find(EMBEDDING_SERVICE, "default", "minilm")
    body["spec"]["replicas"] = 0
    client.put(EMBEDDING_SERVICE, body)
    rec = clocked(client, now)
    await reconcile_latest(client, rec)
    assert "scaledToZeroAt" in client.find(EMBEDDING_SERVICE, "default", "minilm")["status"]

    # warmgate-router scales it to 1 for a request.
    body = client.find(EMBEDDING_SERVICE, "default", "minilm")
    body["spec"]["replicas"] = 1
    client.put(EMBEDDING_SERVICE, body)
    now[0] = T0 + 200
    result = await reconcile_latest(client, rec)
    status = client.find(EMBEDDING_SERVICE, "default", "minilm")["status"]
    assert "scaledToZeroAt" not in status
    assert status["scaleToZero"] == {"lastWokeAt": idle.stamp(T0 + 200)}
    assert client.find(DEPLOYMENT, "default", "minilm")["spec"]["replicas"] == 1
    assert result.recheck_after is None
    # Its pod is slower to start than idleSeconds: still no scale to zero while none serves.
    now[0] = T0 + 500
    await reconcile_latest(client, rec)
    assert client.find(EMBEDDING_SERVICE, "default", "minilm")["spec"]["replicas"] == 1
    # It serves: the idle clock runs from then.
    server_pod(client)
    now[0] = T0 + 520
    result = await reconcile_latest(client, rec)
    status = client.find(EMBEDDING_SERVICE, "default", "minilm")["status"]
    assert status["scaleToZero"] == {
        "lastWokeAt": idle.stamp(T0 + 200),
        "awakeAt": idle.stamp(T0 + 520),
        "wakeSeconds": 320,  # what warmgate-router holds the next wake's requests by
    }
    assert result.recheck_after == pytest.approx(10)


async def test_a_new_services_first_start_is_timed_from_its_first_pods_creation() -> None:
    """Before any wake, the time to warm a wake will need is the first start's: from the
    first pod's creation to the reconcile that sees it serve, in status.scaleToZero."""
    client, now = FakeClient(), [T0 + 1]
    sleepy_es(client)
    rec = clocked(client, now)
    await reconcile_latest(client, rec)  # no pod yet: nothing serves
    status = client.find(EMBEDDING_SERVICE, "default", "minilm")["status"]
    assert status["servingReplicas"] == 0 and "scaleToZero" not in status
    server_pod(client, created=T0 + 3)
    now[0] = T0 + 150
    await reconcile_latest(client, rec)
    status = client.find(EMBEDDING_SERVICE, "default", "minilm")["status"]
    assert status["scaleToZero"] == {"awakeAt": idle.stamp(T0 + 150), "wakeSeconds": 147}
    # Later reconciles keep it: it changes only with the next wake.
    now[0] = T0 + 160
    client.log.clear()
    await reconcile_latest(client, rec)
    assert client.log == []
