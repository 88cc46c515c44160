"""The apply layer: skip what is already there, apply what differs, never take others' objects."""

from __future__ import annotations

import copy
from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.fakes import FakeClient

from warmgate_kube.kinds import CONFIGMAP, DEPLOYMENT, HPA, SERVICE, ResourceKind
from warmgate_operator import apply
from warmgate_operator.builders import Owner, build_children
from warmgate_operator.spec import parse_spec

OWNER = Owner("minilm", "default", "uid-owner")


def desired(**spec):
    return build_children(parse_spec({"model": {"id": "m"}, **spec}), OWNER, "img")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("1", Decimal(1)),
        ("500m", Decimal("0.5")),
        ("1Gi", Decimal(2**30)),
        ("2k", Decimal(2000)),
        ("1e3", Decimal(1000)),
        (3, Decimal(3)),
        ("http", None),
        (True, None),
    ],
)
def test_parse_quantity(value, expected) -> None:
    assert apply.parse_quantity(value) == expected


def test_subset_ignores_fields_the_apiserver_adds() -> None:
    want = {"spec": {"containers": [{"name": "server", "image": "a"}], "replicas": 2}}
    have = {
        "spec": {
            "containers": [
                {"name": "istio-proxy", "image": "x"},
                {"name": "server", "image": "a", "terminationMessagePath": "/dev/termination-log"},
            ],
            "replicas": 2,
            "revisionHistoryLimit": 10,
        }
    }
    assert apply.is_subset(want, have)
    assert not apply.is_subset({"spec": {"replicas": 3}}, have)
    assert not apply.is_subset({"spec": {"containers": [{"name": "server", "image": "b"}]}}, have)


def test_subset_compares_quantities_by_value_and_lists_exactly() -> None:
    assert apply.is_subset({"cpu": "1000m"}, {"cpu": "1"})
    assert not apply.is_subset({"cpu": "100m"}, {"cpu": "1"})
    assert apply.is_subset({"args": ["--a", "--b"]}, {"args": ["--a", "--b"]})
    assert not apply.is_subset({"args": ["--a"]}, {"args": ["--a", "--b"]})
    assert not apply.is_subset({"x": 1}, {"x": True})
    assert not apply.is_subset({"port": "http"}, {"port": 8080})


def cached(client: FakeClient, kind: ResourceKind) -> dict | None:
    """The child as the operator's watch cache holds it."""
    name = "minilm-warmup-profile" if kind is CONFIGMAP else "minilm"
    return client.cache.child(kind, "default", name)


def drifted(client: FakeClient, kind: ResourceKind, change) -> None:
    """Someone changes the child (the watch brings the change into the cache)."""
    obj = copy.deepcopy(client.find(kind, "default", "minilm"))
    change(obj)
    client.put(kind, obj)


async def test_ensure_creates_then_skips() -> None:
    client = FakeClient()
    children = desired()
    first = await apply.ensure(client, DEPLOYMENT, children.deployment, cached(client, DEPLOYMENT))
    assert first.action == "created"
    stored = client.find(DEPLOYMENT, "default", "minilm")
    assert stored["metadata"]["annotations"][apply.APPLIED_HASH_ANNOTATION]
    writes = client.writes
    second = await apply.ensure(
        client, DEPLOYMENT, desired().deployment, cached(client, DEPLOYMENT)
    )
    assert second.action == "unchanged"
    assert client.writes == writes


async def test_ensure_repairs_drift() -> None:
    client = FakeClient()
    await apply.ensure(client, SERVICE, desired().service, cached(client, SERVICE))
    drifted(client, SERVICE, lambda service: service["spec"].update(type="LoadBalancer"))
    outcome = await apply.ensure(client, SERVICE, desired().service, cached(client, SERVICE))
    assert outcome.action == "updated"
    assert client.find(SERVICE, "default", "minilm")["spec"]["type"] == "ClusterIP"


async def test_every_child_write_is_logged_with_its_reason(caplog) -> None:
    """An operator that writes while nothing changed shows why in its log (the idle test
    prints these lines when it fails); a child found unchanged logs nothing."""
    client = FakeClient()
    caplog.set_level("INFO", logger="warmgate.apply")
    autoscaled = desired(autoscaling={"enabled": True})
    await apply.ensure(client, HPA, autoscaled.hpa, cached(client, HPA))
    await apply.ensure(client, HPA, desired(autoscaling={"enabled": True}).hpa, cached(client, HPA))
    drifted(client, HPA, lambda hpa: hpa["spec"].update(maxReplicas=9))
    await apply.ensure(client, HPA, autoscaled.hpa, cached(client, HPA))
    await apply.ensure_absent(client, HPA, "default", "minilm", "uid-owner", cached(client, HPA))
    maximum = autoscaled.hpa["spec"]["maxReplicas"]
    assert [record.getMessage() for record in caplog.records] == [
        "creating HorizontalPodAutoscaler default/minilm: absent",
        f"updating HorizontalPodAutoscaler default/minilm: spec.maxReplicas: 9 should be {maximum}",
        "deleting HorizontalPodAutoscaler default/minilm: no longer wanted",
    ]


def test_difference_names_the_field_that_drifted() -> None:
    desired = {"spec": {"type": "ClusterIP", "ports": [{"name": "http", "port": 80}]}}
    assert apply.difference(desired, copy.deepcopy(desired)) is None
    live = {"spec": {"type": "ClusterIP", "ports": [{"name": "http", "port": 8080}]}}
    assert apply.difference(desired, live) == "spec.ports[http].port: 8080 should be 80"
    assert apply.difference(desired, {"spec": {}}) == "spec.type: missing"
    assert apply.difference({"cpu": "1000m"}, {"cpu": "1"}) is None  # canonical quantities


async def test_ensure_refuses_objects_controlled_by_someone_else() -> None:
    client = FakeClient()
    foreign = desired().service
    foreign["metadata"]["ownerReferences"][0]["uid"] = "someone-else"
    client.put(SERVICE, foreign)
    with pytest.raises(apply.ChildConflict, match="controlled by another owner"):
        await apply.ensure(client, SERVICE, desired().service, cached(client, SERVICE))


async def test_ensure_never_takes_over_an_object_made_by_hand() -> None:
    client = FakeClient()
    handmade = desired().service
    del handmade["metadata"]["ownerReferences"]
    handmade["spec"]["type"] = "LoadBalancer"
    client.put(SERVICE, handmade)
    writes = client.writes
    with pytest.raises(apply.ChildConflict, match="no controller owner"):
        await apply.ensure(client, SERVICE, desired().service, cached(client, SERVICE))
    assert client.writes == writes
    assert client.find(SERVICE, "default", "minilm")["spec"]["type"] == "LoadBalancer"


async def test_ensure_absent_deletes_only_own_children() -> None:
    client = FakeClient()
    await apply.ensure(client, HPA, desired(autoscaling={"enabled": True}).hpa, cached(client, HPA))
    outcome = await apply.ensure_absent(
        client, HPA, "default", "minilm", "uid-owner", cached(client, HPA)
    )
    assert outcome.action == "deleted"
    assert client.find(HPA, "default", "minilm") is None
    again = await apply.ensure_absent(
        client, HPA, "default", "minilm", "uid-owner", cached(client, HPA)
    )
    assert again.action == "absent"
    foreign = desired(autoscaling={"enabled": True}).hpa
    foreign["metadata"]["ownerReferences"][0]["uid"] = "someone-else"
    client.put(HPA, foreign)
    assert (
        await apply.ensure_absent(
            client, HPA, "default", "minilm", "uid-owner", cached(client, HPA)
        )
    ).action == "absent"
    assert client.find(HPA, "default", "minilm") is not None


async def test_turning_autoscaling_on_keeps_the_pods_spec_replicas_asked_for() -> None:
    """The HPA scales the EmbeddingService (its scale subresource), never the Deployment: the
    operator keeps applying the Deployment's replicas, within the HPA's bounds."""
    client = FakeClient()
    await apply.ensure(
        client, DEPLOYMENT, desired(replicas=3).deployment, cached(client, DEPLOYMENT)
    )
    outcome = await apply.ensure(
        client,
        DEPLOYMENT,
        desired(replicas=3, autoscaling={"enabled": True}).deployment,
        cached(client, DEPLOYMENT),
    )
    assert outcome.action == "unchanged"
    assert client.find(DEPLOYMENT, "default", "minilm")["spec"]["replicas"] == 3
    bounded = desired(replicas=9, autoscaling={"enabled": True, "maxReplicas": 4})
    assert bounded.deployment["spec"]["replicas"] == 4
    pool = desired(replicas=2, standbyReplicas=1)
    assert pool.deployment["spec"]["replicas"] == 3


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=12,
)


@given(json_values)
def test_every_object_is_a_subset_of_itself(value) -> None:
    assert apply.is_subset(value, value)


@given(st.dictionaries(st.text(max_size=5), json_values, max_size=4), st.text(max_size=5))
def test_extra_fields_in_the_live_object_do_not_count(desired, extra_key) -> None:
    current = {**desired}
    current.setdefault(extra_key, "added by the apiserver")
    assert apply.is_subset(desired, current)
