"""warmgate's one Kubernetes client, for the operator, the router and the devcluster: raw JSON
dicts in and out, any kind, awaitable.

It rides on the official client's configuration and authentication (kubeconfig, in-cluster
service account, token refresh) but skips its model classes: callers work with plain dicts.
Calls run in a bounded thread pool so the event loop never blocks; watch streams, which stay
open for minutes, are read with aiohttp on the event loop itself (same server, certificates and
token), one connection each.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import aiohttp
import urllib3
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from .kinds import ResourceKind

logger = logging.getLogger(__name__)

WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
MERGE_PATCH = "application/merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"
UNANSWERED = (urllib3.exceptions.HTTPError, OSError, aiohttp.ClientError, TimeoutError)
"""What a call that got no answer raises (refused, reset, timed out), besides ApiError: urllib3's
and the OS's errors from the request threads, aiohttp's from the watch streams."""


def send(
    api: k8s_client.ApiClient,
    method: str,
    path: str,
    body: Any = None,
    query: Sequence[tuple[str, str]] = (),
    content_type: str | None = None,
    timeout: float = 30.0,
) -> tuple[int, bytes]:
    """One request with the official client's configuration and authentication: (status,
    body), whatever the status. Raises urllib3's errors or OSError when nothing answered.
    What both the operator (KubeClient, in its threads) and the devcluster's tools use."""
    headers = {"Accept": "application/json"}
    if content_type:
        headers["Content-Type"] = content_type
    request = api.param_serialize(
        method=method,
        resource_path=path,
        query_params=list(query),
        header_params=headers,
        body=body,
        auth_settings=["BearerToken"],
    )
    try:
        response = api.call_api(*request, _request_timeout=timeout)
        return response.status, response.read()
    except ApiException as error:
        data = error.body or error.reason or b""
        return error.status or 0, data if isinstance(data, bytes) else str(data).encode()


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

    def __init__(
        self, api_client: k8s_client.ApiClient, user_agent: str, max_threads: int = 8
    ) -> None:
        self._api = api_client
        self._api.user_agent = self.user_agent = user_agent
        self._executor = ThreadPoolExecutor(max_threads, thread_name_prefix="kube")
        self._streams: aiohttp.ClientSession | None = None
        self.requests: Counter[str] = Counter()
        """Requests made, by verb and resource: `GET deployments`, `LIST pods` (a collection),
        `WATCH pods` (one per watch request), `PATCH embeddingservices/status`."""
        self.write_fence: Callable[[], bool] | None = None
        self.on_fence: Callable[[], None] = lambda: None

    @classmethod
    def from_environment(cls, user_agent: str, max_threads: int = 8) -> KubeClient:
        """In-cluster service account when running in a pod, else the kubeconfig."""
        configuration = k8s_client.Configuration()
        try:
            k8s_config.load_incluster_config(client_configuration=configuration)
        except k8s_config.ConfigException:
            k8s_config.load_kube_config(client_configuration=configuration)
        return cls(_pooled(configuration, max_threads), user_agent, max_threads)

    @classmethod
    def from_kubeconfig(
        cls, kubeconfig: Path | str, user_agent: str, max_threads: int = 8
    ) -> KubeClient:
        """The kubeconfig file's user (tests, benchmarks, tools)."""
        configuration = k8s_client.Configuration()
        k8s_config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
        return cls(_pooled(configuration, max_threads), user_agent, max_threads)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._api.close()

    async def aclose(self) -> None:
        """Close the watch streams' connections too (from the event loop that read them)."""
        if self._streams is not None:
            await self._streams.close()
            self._streams = None
        self.close()

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
        status, data = send(self._api, method, path, body, query, content_type)
        if not 200 <= status <= 299:
            raise api_error(status, data)
        return json.loads(data) if data else None

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
        self.requests[_request_key(method, path)] += 1
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
        self,
        kind: ResourceKind,
        namespace: str | None,
        label_selector: str = "",
        page_size: int = 500,
    ) -> tuple[list[dict[str, Any]], str]:
        """Every object of `kind` (in `namespace`, or in every one with None) that the selector
        matches, read `page_size` at a time, and the listing's resourceVersion, from which a
        watch continues."""
        items: list[dict[str, Any]] = []
        token = ""
        while True:
            query = [("limit", str(page_size))]
            if label_selector:
                query.append(("labelSelector", label_selector))
            if token:
                query.append(("continue", token))
            page = await self.request("GET", kind.path(namespace), query=query)
            items.extend(page.get("items") or [])
            meta = page.get("metadata") or {}
            token = meta.get("continue") or ""
            if not token:
                return items, str(meta.get("resourceVersion") or "")

    async def watch(
        self,
        kind: ResourceKind,
        namespace: str | None,
        resource_version: str,
        label_selector: str = "",
        timeout_seconds: int = 300,
    ) -> AsyncIterator[dict[str, Any]]:
        """The events of one watch request from `resource_version` (ADDED, MODIFIED, DELETED,
        BOOKMARK, ERROR), as the apiserver sends them; ends when it closes the stream (after
        `timeout_seconds`). ApiError when the request itself is refused (410: the version is
        too old), aiohttp.ClientError or TimeoutError when the connection fails."""
        query = {
            "watch": "true",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(timeout_seconds),
        }
        if label_selector:
            query["labelSelector"] = label_selector
        path = kind.path(namespace)
        self.requests[f"WATCH {_resource_of(path)}"] += 1
        configuration = self._api.configuration
        headers = {"Accept": "application/json", "User-Agent": self.user_agent}
        for setting in configuration.auth_settings().values():
            if setting["in"] == "header" and setting["value"]:
                headers[setting["key"]] = setting["value"]
        # No read deadline beyond the server's own: a quiet stream is a healthy one.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=timeout_seconds + 30)
        url = f"{configuration.host}{path}?{urlencode(query)}"
        async with self._stream_session().get(url, headers=headers, timeout=timeout) as response:
            if response.status != 200:
                raise api_error(response.status, await response.read())
            buffered = b""
            async for chunk in response.content.iter_any():
                buffered += chunk
                *lines, buffered = buffered.split(b"\n")
                for line in lines:
                    if line.strip():
                        yield json.loads(line)

    def _stream_session(self) -> aiohttp.ClientSession:
        if self._streams is None:
            connector = aiohttp.TCPConnector(ssl=_ssl_context(self._api.configuration))
            self._streams = aiohttp.ClientSession(connector=connector, trust_env=False)
        return self._streams

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

    async def merge_patch(
        self,
        kind: ResourceKind,
        namespace: str,
        name: str,
        patch: Mapping[str, Any],
        subresource: str | None = None,
    ) -> dict[str, Any]:
        """A JSON merge patch (RFC 7386): a key set to None is removed, a list replaced."""
        return await self.request(
            "PATCH",
            kind.path(namespace, name, subresource),
            body=dict(patch),
            content_type=MERGE_PATCH,
        )

    async def create(
        self, kind: ResourceKind, namespace: str, body: Mapping[str, Any]
    ) -> dict[str, Any]:
        return await self.request("POST", kind.path(namespace), body=dict(body))


def _pooled(configuration: k8s_client.Configuration, threads: int) -> k8s_client.ApiClient:
    """An ApiClient whose connection pool holds a connection for each request thread, and
    more: urllib3 would otherwise open and close one per call beyond its default of 4."""
    configuration.connection_pool_maxsize = max(configuration.connection_pool_maxsize, 2 * threads)
    return k8s_client.ApiClient(configuration)


def _ssl_context(configuration: k8s_client.Configuration) -> ssl.SSLContext | bool:
    """The TLS settings the official client uses for requests, for aiohttp's streams."""
    if not configuration.host.startswith("https"):
        return False
    context = ssl.create_default_context(cafile=configuration.ssl_ca_cert)
    if configuration.cert_file:
        context.load_cert_chain(configuration.cert_file, configuration.key_file)
    if not configuration.verify_ssl:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


def _resource_parts(path: str) -> list[str]:
    """`/apis/apps/v1/namespaces/ns/deployments/x` -> [deployments, x]; `/api/v1/pods` ->
    [pods]."""
    parts = path.split("?", 1)[0].strip("/").split("/")
    if "namespaces" in parts and parts.index("namespaces") + 2 < len(parts):
        return parts[parts.index("namespaces") + 2 :]
    return parts[2:] if parts[0] == "api" else parts[3:]


def _resource_of(path: str) -> str:
    """`/apis/apps/v1/namespaces/ns/deployments/x` -> `deployments`; a subresource is kept."""
    parts = _resource_parts(path)
    if not parts:
        return "?"
    return parts[0] + (f"/{parts[2]}" if len(parts) > 2 else "")


def _request_key(method: str, path: str) -> str:
    """How a request is counted: its verb (LIST for a GET of a collection) and resource."""
    verb = "LIST" if method == "GET" and len(_resource_parts(path)) == 1 else method
    return f"{verb} {_resource_of(path)}"


def api_error(status: int, data: bytes | str | None) -> ApiError:
    """The ApiError of an answer outside 2xx: the apiserver's reason and message when it sent
    a Status, else the body as it came."""
    text = data.decode(errors="replace") if isinstance(data, bytes) else str(data or "")
    try:
        payload = json.loads(text) if text else None
    except ValueError:
        payload = None
    if isinstance(payload, dict) and ("reason" in payload or "message" in payload):
        return ApiError(status, str(payload.get("reason", "")), str(payload.get("message", "")))
    return ApiError(status, "", text)
