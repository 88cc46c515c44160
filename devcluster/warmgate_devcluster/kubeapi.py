"""The devcluster's one way to the Kubernetes API: the official Python client (what the operator
uses), with plain JSON dicts in and out, as `kubectl get -o json` shows them, on any path.

kubectl itself (`DevCluster.kubectl`) is kept for what a user does with it: applying manifest
files and showing objects, and for the tests of that experience.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

import urllib3
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

MERGE_PATCH = "application/merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"
# What a request that got no answer raises (refused, reset, timed out), besides ApiError.
UNANSWERED = (urllib3.exceptions.HTTPError, OSError)


class ApiError(RuntimeError):
    """A request answered with a status outside 2xx (0: the client gave up before one came)."""

    def __init__(self, method: str, path: str, status: int, body: str) -> None:
        super().__init__(f"{method} {path}: {status} {body[:500]}")
        self.status = status
        self.body = body


def load_client(kubeconfig: Path | str, *, retries: bool = True) -> k8s_client.ApiClient:
    """A client for the kubeconfig's user, at the library's defaults. `retries=False` for
    checks polled several times a second while a component starts: urllib3's retries (and the
    warning each one logs) would only delay the next poll."""
    configuration = k8s_client.Configuration()
    k8s_config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    if not retries:
        configuration.retries = False
    return k8s_client.ApiClient(configuration)


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
        path += f"/{subresource}"
    return path


def request(
    api: k8s_client.ApiClient,
    method: str,
    path: str,
    body: Any = None,
    *,
    query: Mapping[str, str] | None = None,
    content_type: str | None = None,
    timeout: float = 30.0,
) -> tuple[int, str]:
    """(status, body text) of one request; raises one of UNANSWERED when nothing answered."""
    headers = {"Accept": "application/json"}
    if content_type:
        headers["Content-Type"] = content_type
    serialized = api.param_serialize(
        method=method,
        resource_path=path,
        query_params=list((query or {}).items()),
        header_params=headers,
        body=body,
        auth_settings=["BearerToken"],
    )
    try:
        response = api.call_api(*serialized, _request_timeout=timeout)
        return response.status, response.read().decode(errors="replace")
    except ApiException as error:
        return error.status or 0, error.body or error.reason or ""


def call(
    api: k8s_client.ApiClient,
    method: str,
    path: str,
    body: Any = None,
    *,
    query: Mapping[str, str] | None = None,
    content_type: str | None = None,
    timeout: float = 30.0,
) -> Any:
    """The JSON answer of a request (None for an empty one); ApiError outside 2xx."""
    status, text = request(
        api, method, path, body, query=query, content_type=content_type, timeout=timeout
    )
    if not 200 <= status <= 299:
        raise ApiError(method, path, status, text)
    return json.loads(text) if text else None


def read(
    api: k8s_client.ApiClient,
    path: str,
    *,
    query: Mapping[str, str] | None = None,
    timeout: float = 30.0,
) -> Any:
    """GET `path` as JSON; None when it is not found."""
    try:
        return call(api, "GET", path, query=query, timeout=timeout)
    except ApiError as error:
        if error.status == 404:
            return None
        raise


def apply(api: k8s_client.ApiClient, path: str, obj: Mapping[str, Any], manager: str) -> Any:
    """Server-side apply of `obj` at its `path`, taking over the fields it sets."""
    return call(
        api,
        "PATCH",
        path,
        dict(obj),
        query={"fieldManager": manager, "force": "true"},
        content_type=APPLY_PATCH,
    )


def condition(obj: Mapping[str, Any] | None, kind: str) -> dict[str, Any]:
    """The status condition of type `kind` ({} when absent)."""
    for item in ((obj or {}).get("status") or {}).get("conditions") or []:
        if item.get("type") == kind:
            return item
    return {}
