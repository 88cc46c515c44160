"""The resources by name: the path of an object, a collection and a subresource of each."""

from __future__ import annotations

from warmgate_kube.kinds import (
    CONFIGMAP,
    DEPLOYMENT,
    EMBEDDING_SERVICE,
    ENDPOINT_SLICE,
    HPA,
    POD,
    resource_path,
)


def test_paths() -> None:
    assert CONFIGMAP.path("ns", "p") == "/api/v1/namespaces/ns/configmaps/p"
    assert DEPLOYMENT.path("ns") == "/apis/apps/v1/namespaces/ns/deployments"
    assert HPA.path("ns", "x") == "/apis/autoscaling/v2/namespaces/ns/horizontalpodautoscalers/x"
    assert EMBEDDING_SERVICE.path("ns", "x", "status") == (
        "/apis/warmgate.dev/v1alpha1/namespaces/ns/embeddingservices/x/status"
    )
    assert ENDPOINT_SLICE.path(None) == "/apis/discovery.k8s.io/v1/endpointslices"
    # Names are quoted: a path is never built from a name that could escape its segment.
    assert POD.path("ns", "a/b") == "/api/v1/namespaces/ns/pods/a%2Fb"
    assert resource_path("v1", "pods", None, "x", "status") == "/api/v1/pods/x/status"
