"""The devcluster's way to the Kubernetes API, for its own checks, the tests and the
benchmarks: warmgate's one client (`warmgate_kube`: the official client's configuration and
authentication, one request function, one path builder, one error type) called synchronously,
with plain JSON dicts in and out, as `kubectl get -o json` shows them.

kubectl itself (`DevCluster.kubectl`) is kept for what a user does with it: applying manifest
files and showing objects, and for the tests of that experience.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kubernetes import client as k8s_client
from kubernetes import config as k8s_config

from warmgate_kube.client import (
    APPLY_PATCH,
    MERGE_PATCH,
    UNANSWERED,
    ApiError,
    api_error,
    send,
)
from warmgate_kube.kinds import resource_path
from warmgate_kube.objects import condition as find_condition

__all__ = ["APPLY_PATCH", "MERGE_PATCH", "UNANSWERED", "ApiError", "resource_path"]


def load_client(kubeconfig: Path | str, *, retries: bool = True) -> k8s_client.ApiClient:
    """A client for the kubeconfig's user, at the library's defaults. `retries=False` for
    checks polled several times a second while a component starts: urllib3's retries (and the
    warning each one logs) would only delay the next poll."""
    configuration = k8s_client.Configuration()
    k8s_config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    if not retries:
        configuration.retries = False
    return k8s_client.ApiClient(configuration)


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
    status, data = send(api, method, path, body, list((query or {}).items()), content_type, timeout)
    return status, data.decode(errors="replace")


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
        raise api_error(status, text)
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
    """The status condition of type `kind` ({} when absent, for `.get` chains in tests)."""
    return find_condition(obj, kind) or {}
