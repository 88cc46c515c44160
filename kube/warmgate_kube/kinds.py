"""The resources warmgate reads and writes, named once: their API group and version, kind and
plural, and the path of an object, a collection or a subresource of each."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote

from warmgate_contract.names import ALIAS_KIND, ALIAS_PLURAL, API_VERSION, KIND, PLURAL


@dataclass(frozen=True)
class ResourceKind:
    api_version: str
    kind: str
    plural: str

    def path(
        self, namespace: str | None, name: str | None = None, subresource: str | None = None
    ) -> str:
        """The object's path; a collection's without `name`, every namespace's with
        `namespace` None."""
        return resource_path(self.api_version, self.plural, namespace, name, subresource)


def resource_path(
    api_version: str,
    plural: str,
    namespace: str | None = None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    """`/api/v1/namespaces/NS/pods/NAME`, `/apis/GROUP/VERSION/PLURAL`, ..."""
    path = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    if namespace is not None:
        path += f"/namespaces/{quote(namespace, safe='')}"
    path += f"/{plural}"
    if name is not None:
        path += "/" + quote(name, safe="")
    if subresource is not None:
        path += "/" + subresource
    return path


CONFIGMAP = ResourceKind("v1", "ConfigMap", "configmaps")
SERVICE = ResourceKind("v1", "Service", "services")
POD = ResourceKind("v1", "Pod", "pods")
EVENT = ResourceKind("v1", "Event", "events")
DEPLOYMENT = ResourceKind("apps/v1", "Deployment", "deployments")
HPA = ResourceKind("autoscaling/v2", "HorizontalPodAutoscaler", "horizontalpodautoscalers")
PDB = ResourceKind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets")
EMBEDDING_SERVICE = ResourceKind(API_VERSION, KIND, PLURAL)
EMBEDDING_ALIAS = ResourceKind(API_VERSION, ALIAS_KIND, ALIAS_PLURAL)
ENDPOINT_SLICE = ResourceKind("discovery.k8s.io/v1", "EndpointSlice", "endpointslices")
