"""Reconcile against an in-memory API: children, status, events, and no writes when idle."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.fakes import FakeClient

from warmgate_operator.config import OperatorConfig
from warmgate_operator.events import EventRecorder
from warmgate_operator.kube import CONFIGMAP, DEPLOYMENT, EMBEDDING_SERVICE, HPA, PDB, SERVICE
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
