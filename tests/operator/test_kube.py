"""The raw-dict client's pure parts: paths, request accounting keys, error messages."""

from __future__ import annotations

import json

from warmgate_operator.kube import (
    CONFIGMAP,
    DEPLOYMENT,
    EMBEDDING_SERVICE,
    HPA,
    _api_error,
    _resource_of,
)


def test_paths() -> None:
    assert CONFIGMAP.path("ns", "p") == "/api/v1/namespaces/ns/configmaps/p"
    assert DEPLOYMENT.path("ns") == "/apis/apps/v1/namespaces/ns/deployments"
    assert HPA.path("ns", "x") == "/apis/autoscaling/v2/namespaces/ns/horizontalpodautoscalers/x"
    assert EMBEDDING_SERVICE.path("ns", "x", "status") == (
        "/apis/warmgate.dev/v1alpha1/namespaces/ns/embeddingservices/x/status"
    )


def test_requests_are_counted_by_resource() -> None:
    assert _resource_of(DEPLOYMENT.path("ns", "x")) == "deployments"
    assert _resource_of(EMBEDDING_SERVICE.path("ns", "x", "status")) == "embeddingservices/status"
    assert _resource_of(CONFIGMAP.path("ns")) == "configmaps"


def test_api_errors_carry_the_apiserver_message() -> None:
    body = json.dumps({"reason": "Invalid", "message": "spec.replicas: Invalid value"}).encode()
    error = _api_error(422, body)
    assert (error.status, error.reason) == (422, "Invalid")
    assert "spec.replicas" in str(error)
    assert _api_error(502, b"<html>bad gateway</html>").message == "<html>bad gateway</html>"
