"""Helpers for the end-to-end tests: kubectl with JSON, manifests, the operator as a process,
and waiting on conditions with deadlines (never a bare sleep)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from warmgate_devcluster import testkit
from warmgate_devcluster.testkit import (
    condition,
    install_crd,  # noqa: F401 - re-exported
)
from warmgate_devcluster.testkit import wait_until as wait_for

ROOT = Path(__file__).resolve().parents[2]


class Kube:
    """kubectl in one namespace, returning parsed JSON."""

    def __init__(self, devcluster: Any, namespace: str) -> None:
        self.devcluster = devcluster
        self.namespace = namespace

    def run(self, *args: str, check: bool = True, input: str | None = None):
        return self.devcluster.kubectl("-n", self.namespace, *args, check=check, input=input)

    def get(self, kind: str, name: str | None = None, selector: str | None = None) -> Any:
        args = ["get", kind] + ([name] if name else []) + ["-o", "json"]
        if selector:
            args += ["-l", selector]
        result = self.run(*args, check=False)
        if result.returncode != 0:
            return None
        return json.loads(result.stdout)

    def apply(self, manifest: dict) -> None:
        self.run("apply", "-f", "-", input=yaml.safe_dump(manifest))

    def patch(self, kind: str, name: str, patch: dict) -> None:
        self.run("patch", kind, name, "--type", "merge", "-p", json.dumps(patch))

    def pods(self, service: str) -> list[dict]:
        found = self.get("pods", selector=f"warmgate.dev/service={service}")
        return found["items"] if found else []

    def events(self) -> list[dict]:
        found = self.get("events")
        return found["items"] if found else []


def embedding_service(name: str, revision: str = "v1", **spec_overrides: Any) -> dict:
    """A small, fast-warming MiniLM EmbeddingService for a 2-core machine."""
    spec: dict[str, Any] = {
        "model": {"id": "sentence-transformers/all-MiniLM-L6-v2", "revision": revision},
        "replicas": 2,
        "runtime": {"device": "cpu", "dtype": "float32"},
        "batching": {"maxBatchSize": 4, "maxBatchTokens": 256, "maxWaitMilliseconds": 2},
        "warmup": {"batchSizes": [1, 4], "sequenceBuckets": [16, 32]},
        "probes": {"startupTimeoutSeconds": 240, "periodSeconds": 1},
        "rollout": {"maxSurge": 1, "maxUnavailable": 0, "warmGate": True, "drainSeconds": 3},
        "service": {"type": "NodePort", "port": 80},
    }
    for key, value in spec_overrides.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    return {
        "apiVersion": "warmgate.dev/v1alpha1",
        "kind": "EmbeddingService",
        "metadata": {"name": name},
        "spec": spec,
    }


class OperatorProcess(testkit.OperatorProcess):
    """`python -m warmgate_operator` watching one namespace of the devcluster, stopped by pid."""

    def __init__(self, devcluster: Any, namespace: str, log_path: Path) -> None:
        super().__init__(
            devcluster,
            log_path,
            f"--namespace={namespace}",
            "--log-format=text",
            "--resync-seconds=30",
        )


def node_port(kube: Kube, name: str) -> int:
    service = wait_for(lambda: kube.get("service", name), 60, f"Service {name}")
    return int(service["spec"]["ports"][0]["nodePort"])


def service_url(kube: Kube, name: str, path: str = "/v1/embeddings") -> str:
    """The Service through its node port on the node's address: kube-proxy picks the pod."""
    return f"http://{kube.devcluster.node_ip}:{node_port(kube, name)}{path}"


def wait_ready(kube: Kube, name: str, revision: str, replicas: int, timeout: float = 300) -> dict:
    """Until the EmbeddingService reports Ready with `replicas` pods of `revision` and no
    others (a finished rollout)."""

    def done() -> dict | None:
        emb = kube.get("embeddingservice", name)
        if not emb or condition(emb, "Ready").get("status") != "True":
            return None
        status = emb.get("status", {})
        if status.get("readyReplicas") != replicas or status.get("updatedReplicas") != replicas:
            return None
        pods = [p for p in kube.pods(name) if not p["metadata"].get("deletionTimestamp")]
        revisions = {p_revision(p) for p in pods}
        if len(pods) != replicas or revisions != {revision}:
            return None
        return emb

    return wait_for(done, timeout, f"{name} Ready at {revision} with {replicas} pods", every=1.0)


def p_revision(pod: dict) -> str | None:
    args = pod["spec"]["containers"][0].get("args", [])
    for index, arg in enumerate(args):
        if arg.startswith("--model-revision="):
            return arg.split("=", 1)[1]
        if arg == "--model-revision" and index + 1 < len(args):
            return args[index + 1]
    return None
