"""Polling with deadlines and small object builders for the devcluster tests."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

TESTSERVER = "warmgate.dev/testserver:latest"


def wait_for(check: Callable[[], T], what: str, timeout: float = 60.0, interval: float = 0.1) -> T:
    """Poll `check` until it returns something truthy; fail with `what` at the deadline."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except Exception as exc:  # e.g. the object does not exist yet
            last_error = exc
        time.sleep(interval)
    raise AssertionError(
        f"timed out after {timeout:.0f}s waiting for {what}"
        + (f" (last error: {last_error})" if last_error else "")
    )


def http_json(url: str, timeout: float = 5.0) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def condition(pod, kind: str) -> str | None:
    for item in pod.status.conditions or []:
        if item.type == kind:
            return item.status
    return None


def server_container(
    *args: str,
    name: str = "web",
    period: int = 1,
    readiness: bool = True,
    liveness: bool = False,
    env: list[dict] | None = None,
) -> dict:
    container = {
        "name": name,
        "image": TESTSERVER,
        "args": list(args),
        "ports": [{"name": "http", "containerPort": 8080}],
        "env": env or [],
    }
    if readiness:
        container["readinessProbe"] = {
            "httpGet": {"path": "/ready", "port": "http"},
            "periodSeconds": period,
            "failureThreshold": 1,
        }
    if liveness:
        container["livenessProbe"] = {
            "httpGet": {"path": "/healthz", "port": "http"},
            "periodSeconds": period,
            "failureThreshold": 1,
        }
    return container


def pod_manifest(name: str, container: dict, **spec) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {"terminationGracePeriodSeconds": 5, "containers": [container], **spec},
    }


def deployment_manifest(name: str, container: dict, replicas: int = 1, **spec) -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"terminationGracePeriodSeconds": 5, "containers": [container]},
            },
            **spec,
        },
    }


def nodeport_service(name: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name},
        "spec": {
            "type": "NodePort",
            "selector": {"app": name},
            "ports": [{"name": "http", "port": 80, "targetPort": "http"}],
        },
    }


def container_pid(pod) -> int | None:
    statuses = pod.status.container_statuses or []
    if not statuses or not statuses[0].container_id:
        return None
    return int(statuses[0].container_id.rsplit("/", 1)[1])


CGROUPS_WRITABLE = os.geteuid() == 0 and os.access("/sys/fs/cgroup/cpu", os.W_OK)
NO_CGROUPS = "CPU cgroups need root and a writable cgroup v1 cpu controller"


def cpu_cgroup(pid: int) -> Path | None:
    """The cgroup v1 `cpu` folder a process is in (None: the root of the hierarchy)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _hierarchy, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(",") and path != "/":
            return Path("/sys/fs/cgroup/cpu") / path.lstrip("/")
    return None
