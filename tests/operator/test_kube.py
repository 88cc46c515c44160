"""The raw-dict client's pure parts: paths, request accounting keys, error messages."""

from __future__ import annotations

import json

import pytest

from warmgate_operator.kube import (
    CONFIGMAP,
    DEPLOYMENT,
    EMBEDDING_SERVICE,
    HPA,
    POD,
    _request_key,
    api_error,
)


def test_paths() -> None:
    assert CONFIGMAP.path("ns", "p") == "/api/v1/namespaces/ns/configmaps/p"
    assert DEPLOYMENT.path("ns") == "/apis/apps/v1/namespaces/ns/deployments"
    assert HPA.path("ns", "x") == "/apis/autoscaling/v2/namespaces/ns/horizontalpodautoscalers/x"
    assert EMBEDDING_SERVICE.path("ns", "x", "status") == (
        "/apis/warmgate.dev/v1alpha1/namespaces/ns/embeddingservices/x/status"
    )


def test_requests_are_counted_by_verb_and_resource() -> None:
    assert _request_key("GET", DEPLOYMENT.path("ns", "x")) == "GET deployments"
    assert _request_key("PATCH", EMBEDDING_SERVICE.path("ns", "x", "status")) == (
        "PATCH embeddingservices/status"
    )
    # A GET of a collection is a LIST, in one namespace or in all.
    assert _request_key("GET", CONFIGMAP.path("ns")) == "LIST configmaps"
    assert _request_key("GET", POD.path(None)) == "LIST pods"
    assert _request_key("GET", HPA.path(None)) == "LIST horizontalpodautoscalers"
    assert POD.path(None) == "/api/v1/pods"


def test_api_errors_carry_the_apiserver_message() -> None:
    body = json.dumps({"reason": "Invalid", "message": "spec.replicas: Invalid value"}).encode()
    error = api_error(422, body)
    assert (error.status, error.reason) == (422, "Invalid")
    assert "spec.replicas" in str(error)
    assert api_error(502, b"<html>bad gateway</html>").message == "<html>bad gateway</html>"


async def test_a_fenced_client_refuses_writes_and_says_so_but_still_reads() -> None:
    """The leader's fence: once it may no longer hold the Lease, no write leaves the process
    (the call never reaches the API) and `on_fence` is told; reads still go."""
    from kubernetes import client as k8s_client

    from warmgate_operator.kube import KubeClient, NotLeader

    kube = KubeClient(k8s_client.ApiClient(k8s_client.Configuration()))
    sent: list[str] = []
    kube._call = lambda method, path, body, query, content_type: sent.append(method) or {}
    fenced: list[bool] = []
    leading = [True]
    kube.write_fence = lambda: leading[0]
    kube.on_fence = lambda: fenced.append(True)
    try:
        await kube.request("PATCH", DEPLOYMENT.path("ns", "x"), body={})
        leading[0] = False
        with pytest.raises(NotLeader):
            await kube.request("PATCH", DEPLOYMENT.path("ns", "x"), body={})
        await kube.request("GET", DEPLOYMENT.path("ns", "x"))
    finally:
        kube.close()
    assert sent == ["PATCH", "GET"] and fenced == [True]
