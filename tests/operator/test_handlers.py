"""kopf's settings as the operator sets them: what the apiserver filters for it."""

from __future__ import annotations

import kopf
from kopf._cogs.structs import references

from warmgate_operator.handlers import MANAGED_SELECTOR, configure_settings


def selectors(group: str, version: str, plural: str, kind: str) -> list[str]:
    settings = kopf.OperatorSettings()
    configure_settings(settings)
    resource = references.Resource(
        group=group, version=version, plural=plural, kind=kind, namespaced=True
    )
    return list(settings.watching.label_selectors.collect(resource))


def test_pod_and_deployment_watches_are_filtered_by_the_apiserver() -> None:
    # kopf puts these in the list and watch requests' labelSelector: other workloads' pods
    # and Deployments are never sent to the operator.
    assert selectors("", "v1", "pods", "Pod") == [MANAGED_SELECTOR]
    assert selectors("apps", "v1", "deployments", "Deployment") == [MANAGED_SELECTOR]
    assert MANAGED_SELECTOR == "app.kubernetes.io/managed-by=warmgate"
    # Not the EmbeddingServices (all of them are the operator's), nor other groups' pods.
    assert selectors("warmgate.dev", "v1alpha1", "embeddingservices", "EmbeddingService") == []
    assert selectors("metrics.k8s.io", "v1beta1", "pods", "PodMetrics") == []


def test_a_listing_after_a_quiet_gap_is_a_relist() -> None:
    from warmgate_operator.handlers import Listings

    now = [100.0]
    listings = Listings(gap_seconds=5.0, clock=lambda: now[0])
    # The first listing, in a burst: not a relist.
    assert [listings.starts_relist("pods", "ns") for _ in range(3)] == [False] * 3
    now[0] += 0.5
    assert not listings.starts_relist("pods", "ns")
    assert not listings.starts_relist("pods", "other")  # another namespace's first listing
    now[0] += 300  # the watch ran for a while, then listed again (a 410)
    assert listings.starts_relist("pods", "ns")
    assert not listings.starts_relist("pods", "ns")  # the rest of that burst
