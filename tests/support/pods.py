"""Small object builders for the devcluster tests: pods that run `testserver.py` (this folder)
in the base image, the script mounted from a ConfigMap (polling: testkit.wait_until)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

from warmgate_devcluster.images import BASE

TESTSERVER_SCRIPT = Path(__file__).with_name("testserver.py")
TESTSERVER_CONFIGMAP = "testserver"


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


def script_configmap() -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": TESTSERVER_CONFIGMAP},
        "data": {"testserver.py": TESTSERVER_SCRIPT.read_text()},
    }


def server_container(
    *args: str,
    name: str = "web",
    period: int = 1,
    readiness: bool = True,
    liveness: bool = False,
    env: list[dict] | None = None,
    resources: dict | None = None,
) -> dict:
    container = {
        "name": name,
        "image": BASE.name,
        "imagePullPolicy": "Never",
        "command": ["python3", "-u", "/opt/testserver/testserver.py"],
        "args": list(args),
        "ports": [{"name": "http", "containerPort": 8080}],
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            *(env or []),
        ],
        "volumeMounts": [{"name": "testserver", "mountPath": "/opt/testserver"}],
    }
    if resources:
        container["resources"] = resources
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


def _pod_spec(container: dict, **spec) -> dict:
    return {
        "terminationGracePeriodSeconds": 5,
        "containers": [container],
        "volumes": [{"name": "testserver", "configMap": {"name": TESTSERVER_CONFIGMAP}}],
        **spec,
    }


def pod_manifest(name: str, container: dict, **spec) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": _pod_spec(container, **spec),
    }


def deployment_manifest(name: str, container: dict, replicas: int = 1, **spec) -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": _pod_spec(container)},
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


def cgroup_of(pid: int, controller: str = "cpu") -> str | None:
    """A process's cgroup path in one v1 hierarchy."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _hierarchy, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return path
    return None
