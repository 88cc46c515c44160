"""A small generic Kubernetes client: raw JSON dicts in and out, any kind, awaitable.

It rides on the official client's configuration and authentication (kubeconfig, in-cluster
service account, token refresh) but skips its model classes: the operator works with plain
dicts from the builders. Calls run in a bounded thread pool so the event loop never blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from warmgate_contract.names import API_VERSION, KIND, PLURAL

logger = logging.getLogger(__name__)

USER_AGENT = "warmgate-operator"
WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


@dataclass(frozen=True)
class ResourceKind:
    api_version: str
    kind: str
    plural: str

    def path(self, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
        base = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        path = f"{base}/namespaces/{quote(namespace, safe='')}/{self.plural}"
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


class ApiError(Exception):
    """A Kubernetes API call failed; `status` is the HTTP status (0 when none came back)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


class NotLeader(ApiError):
    """A write refused because this replica may no longer hold the leader Lease."""


class KubeClient:
    """Raw-dict Kubernetes API calls, counted by method and resource (`PATCH deployments`,
    `PATCH embeddingservices/status`) for the benchmark and the tests.

    `write_fence`, when set, is asked before every write: a replica that may have lost its
    leader Lease writes nothing (`on_fence` is called and the write raises NotLeader)."""

    def __init__(self, api_client: k8s_client.ApiClient, max_threads: int = 8) -> None:
        self._api = api_client
        self._api.user_agent = USER_AGENT
        self._executor = ThreadPoolExecutor(max_threads, thread_name_prefix="kube")
        self.requests: Counter[str] = Counter()
        self.write_fence: Callable[[], bool] | None = None
        self.on_fence: Callable[[], None] = lambda: None

    @classmethod
    def from_environment(cls, max_threads: int = 8) -> KubeClient:
        """In-cluster service account when running in a pod, else the kubeconfig."""
        configuration = k8s_client.Configuration()
        try:
            k8s_config.load_incluster_config(client_configuration=configuration)
        except k8s_config.ConfigException:
            k8s_config.load_kube_config(client_configuration=configuration)
        configuration.connection_pool_maxsize = max(configuration.connection_pool_maxsize, 16)
        return cls(k8s_client.ApiClient(configuration), max_threads=max_threads)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._api.close()

    @property
    def writes(self) -> int:
        return sum(n for key, n in self.requests.items() if key.split()[0] in WRITE_METHODS)

    def _call(
        self,
        method: str,
        path: str,
        body: Any,
        query: Sequence[tuple[str, str]],
        content_type: str | None,
    ) -> Any:
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        request = self._api.param_serialize(
            method=method,
            resource_path=path,
            query_params=list(query),
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        try:
            response = self._api.call_api(*request, _request_timeout=30)
            data = response.read()
            status = response.status
        except ApiException as error:
            status, data = error.status or 0, (error.body or "")
        if not 200 <= status <= 299:
            raise _api_error(status, data)
        if not data:
            return None
        return json.loads(data)

    def call_sync(self, method: str, path: str, body: Any = None) -> Any:
        """One call from a thread of the caller's own (leader election); not fenced."""
        return self._call(method, path, body, (), None)

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: Sequence[tuple[str, str]] = (),
        content_type: str | None = None,
    ) -> Any:
        if method in WRITE_METHODS and self.write_fence is not None and not self.write_fence():
            self.on_fence()
            raise NotLeader(0, "NotLeader", f"{method} {path}: this replica is not the leader")
        self.requests[f"{method} {_resource_of(path)}"] += 1
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._executor, self._call, method, path, body, query, content_type
        )

    async def get(self, kind: ResourceKind, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self.request("GET", kind.path(namespace, name))
        except ApiError as error:
            if error.status == 404:
                return None
            raise

    async def list(
        self, kind: ResourceKind, namespace: str, label_selector: str
    ) -> list[dict[str, Any]]:
        result = await self.request(
            "GET", kind.path(namespace), query=[("labelSelector", label_selector)]
        )
        return list(result.get("items") or [])

    async def apply(
        self, kind: ResourceKind, obj: Mapping[str, Any], field_manager: str
    ) -> dict[str, Any]:
        """Server-side apply, forcing ownership of the fields in `obj`."""
        meta = obj["metadata"]
        return await self.request(
            "PATCH",
            kind.path(meta["namespace"], meta["name"]),
            body=dict(obj),
            query=[("fieldManager", field_manager), ("force", "true")],
            content_type="application/apply-patch+yaml",
        )

    async def delete(
        self, kind: ResourceKind, namespace: str, name: str, uid: str | None = None
    ) -> None:
        body: dict[str, Any] = {"propagationPolicy": "Background"}
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            await self.request("DELETE", kind.path(namespace, name), body=body)
        except ApiError as error:
            if error.status not in (404, 409):
                raise

    async def json_patch(
        self,
        kind: ResourceKind,
        namespace: str,
        name: str,
        operations: list[dict[str, Any]],
        subresource: str | None = None,
    ) -> dict[str, Any]:
        return await self.request(
            "PATCH",
            kind.path(namespace, name, subresource),
            body=operations,
            content_type="application/json-patch+json",
        )

    async def create(
        self, kind: ResourceKind, namespace: str, body: Mapping[str, Any]
    ) -> dict[str, Any]:
        return await self.request("POST", kind.path(namespace), body=dict(body))


def _resource_of(path: str) -> str:
    """`/apis/apps/v1/namespaces/ns/deployments/x` -> `deployments`; a subresource is kept."""
    parts = path.split("?", 1)[0].strip("/").split("/")
    if "namespaces" in parts:
        parts = parts[parts.index("namespaces") + 2 :]
    if not parts:
        return "?"
    return parts[0] + (f"/{parts[2]}" if len(parts) > 2 else "")


def _api_error(status: int, data: Any) -> ApiError:
    reason, message = "", ""
    try:
        payload = json.loads(data) if data else {}
        reason = payload.get("reason", "")
        message = payload.get("message", "")
    except (TypeError, ValueError):
        message = data.decode(errors="replace") if isinstance(data, bytes) else str(data)
    return ApiError(status, reason, message)
