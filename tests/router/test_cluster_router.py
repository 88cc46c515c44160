"""The router's watches and writes on a real apiserver (the devcluster's control plane): a
listing, then the changes, into the View the router forwards by (warmgate_kube's Reflectors, as
`python -m warmgate_router` builds them); a kind that is not served (the alias CRD missing after
a `helm upgrade`) counts as none, so the router still becomes ready."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from support.cluster import example, install_crd

from warmgate_devcluster import kubeapi
from warmgate_kube.client import KubeClient
from warmgate_kube.kinds import ResourceKind
from warmgate_kube.watch import Listing, Reflector, Store
from warmgate_router.__main__ import USER_AGENT, WATCH, reflectors
from warmgate_router.view import SERVICES, View

pytestmark = pytest.mark.cluster


def router_kube(devcluster) -> KubeClient:
    return KubeClient.from_kubeconfig(devcluster.kubeconfig, USER_AGENT, max_threads=2)


async def until(check, seconds: float = 30) -> None:
    for _ in range(int(seconds * 10)):
        if check():
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"not within {seconds}s")


async def test_names_and_endpoints_follow_the_cluster(devcluster, namespace) -> None:
    install_crd(devcluster)
    kube = router_kube(devcluster)
    view = View()
    watching = reflectors(kube, view, [namespace])
    tasks = [asyncio.create_task(r.run()) for r in watching]
    try:
        await asyncio.wait_for(asyncio.gather(*(r.synced.wait() for r in watching)), 30)
        assert view.lookup("docs") == "no model named 'docs'"
        body = example("docs")
        kubeapi.call(devcluster.api, "POST", kubeapi.resource_path(
            "warmgate.dev/v1alpha1", "embeddingservices", namespace), body)  # fmt: skip
        alias = {
            "apiVersion": "warmgate.dev/v1alpha1",
            "kind": "EmbeddingAlias",
            "metadata": {"name": "search"},
            "spec": {"service": "docs"},
        }
        kubeapi.call(devcluster.api, "POST", kubeapi.resource_path(
            "warmgate.dev/v1alpha1", "embeddingaliases", namespace), alias)  # fmt: skip
        await until(lambda: not isinstance(view.lookup("search"), str))
        assert view.lookup("search").service == "docs"
        # An EndpointSlice of the service's name, as the EndpointSlice controller writes it.
        endpoint_slice = {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": "docs-abc",
                "labels": {
                    "kubernetes.io/service-name": "docs",
                    "app.kubernetes.io/managed-by": "warmgate",
                },
            },
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": [{"addresses": ["10.244.7.7"], "conditions": {"ready": True}}],
        }
        slices = kubeapi.resource_path("discovery.k8s.io/v1", "endpointslices", namespace)
        kubeapi.call(devcluster.api, "POST", slices, endpoint_slice)
        await until(lambda: [e.address for e in view.ready((namespace, "docs"))] == ["10.244.7.7"])
        kubeapi.call(devcluster.api, "DELETE", f"{slices}/docs-abc")
        await until(lambda: view.ready((namespace, "docs")) == [])
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await kube.aclose()


async def test_a_kind_the_apiserver_does_not_serve_counts_as_none_when_optional(
    devcluster, namespace
) -> None:
    kube = router_kube(devcluster)
    missing = ResourceKind("warmgate.dev/v1alpha1", "NoSuchThing", "nosuchthings")
    seen: list = []
    optional = Reflector(kube, Store(missing), seen.append, namespace, settings=WATCH,
                         optional=True)  # fmt: skip
    required = Reflector(kube, Store(missing), lambda event: None, namespace, settings=WATCH)
    tasks = [asyncio.create_task(optional.run()), asyncio.create_task(required.run())]
    try:
        await asyncio.wait_for(optional.synced.wait(), 30)
        assert [(type(e), e.objects) for e in seen] == [(Listing, ())]
        await asyncio.sleep(2)
        assert not required.synced.is_set()  # a kind the router needs keeps it unready
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await kube.aclose()


async def test_a_request_records_activity_and_wakes_a_service_at_zero(devcluster, namespace):
    """On the real apiserver: the router writes the last-request time (milliseconds, RFC
    3339) on the EmbeddingService, and scales one at zero to 1 through its scale
    subresource, once, counting a cold start; a service someone scaled already is left
    alone. No operator runs here: spec.replicas is what the scale write set."""
    from warmgate_contract.names import LAST_REQUEST_ANNOTATION
    from warmgate_operator.idle import parse_stamp
    from warmgate_router.config import RouterConfig
    from warmgate_router.metrics import Metrics
    from warmgate_router.proxy import Router

    install_crd(devcluster)
    body = example("sleepy", replicas=0)
    body["spec"]["autoscaling"] = {
        "enabled": True, "minReplicas": 0, "maxReplicas": 2, "scaleToZero": {"idleSeconds": 30},
    }  # fmt: skip
    path = kubeapi.resource_path("warmgate.dev/v1alpha1", "embeddingservices", namespace)
    kubeapi.call(devcluster.api, "POST", path, body)
    kube = router_kube(devcluster)
    view = View()
    reflector = Reflector(kube, view.store(SERVICES), view.take, namespace, settings=WATCH)
    task = asyncio.create_task(reflector.run())
    router = Router(RouterConfig(activity_seconds=60.0), view, kube, Metrics())
    key = (namespace, "sleepy")

    def current() -> dict:
        return kubeapi.call(devcluster.api, "GET", f"{path}/sleepy")

    try:
        await asyncio.wait_for(reflector.synced.wait(), 30)
        await until(lambda: view.service(key) is not None)
        before = time.time()
        router.waker.note_activity(key)  # a third of idleSeconds (10 s), not --activity-seconds
        await until(lambda: LAST_REQUEST_ANNOTATION in (current()["metadata"].get(
            "annotations") or {}))  # fmt: skip
        stamp = current()["metadata"]["annotations"][LAST_REQUEST_ANNOTATION]
        assert "." in stamp and stamp.endswith("Z"), stamp
        assert before - 0.01 <= parse_stamp(stamp) <= time.time()

        await router.waker.wake(key)
        assert current()["spec"]["replicas"] == 1
        woken = router.metrics.registry.get_sample_value(
            "warmgate_router_cold_starts_from_zero_total", {"service": f"{namespace}/sleepy"}
        )
        assert woken == 1
        router.waker._woken.clear()  # past the wake's own 10 s guard: the Scale read decides
        kubeapi.call(devcluster.api, "PATCH", f"{path}/sleepy", {"spec": {"replicas": 2}},
                     content_type="application/merge-patch+json")  # fmt: skip
        await router.waker.wake(key)
        assert current()["spec"]["replicas"] == 2  # scaled by someone else: left alone
        assert (
            router.metrics.registry.get_sample_value(
                "warmgate_router_cold_starts_from_zero_total", {"service": f"{namespace}/sleepy"}
            )
            == 1
        )
    finally:
        await router.close()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await kube.aclose()
