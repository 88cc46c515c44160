"""What the cluster tests and benchmarks share: waiting with a deadline (never a bare sleep),
reading objects as JSON (`kubectl get` for the tests of what kubectl shows, the Kubernetes
client otherwise), finding a condition, and warmgate's own pieces on a devcluster (the CRD,
small MiniLM EmbeddingServices, the operator as a process, a namespace's objects as JSON,
waiting for a finished rollout)."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any, Self, TypeVar

import yaml

from warmgate_contract.names import (
    ALIAS_KIND,
    ALIAS_PLURAL,
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    SERVICE_LABEL,
    WARMED_CONDITION,
)
from warmgate_devcluster import images, kubeapi
from warmgate_devcluster.config import repo_root
from warmgate_devcluster.kubeapi import MERGE_PATCH, condition

T = TypeVar("T")


def wait_until(
    probe: Callable[[], T | None], timeout: float = 60.0, what: str = "", every: float = 0.5
) -> T:
    """Call `probe` every `every` seconds until it returns something truthy, and return that;
    fail naming `what` (and the last value seen) once `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(
        f"timed out after {timeout:.0f}s waiting for {what or probe} (last: {last!r})"
    )


def get_json(cluster: Any, *args: str) -> dict[str, Any] | None:
    """`kubectl get ARGS -o json` through `cluster.kubectl`, for the tests of what kubectl
    shows; None when the object is not found."""
    result = cluster.kubectl("get", *args, "-o", "json", check=False)
    if result.returncode != 0:
        if "NotFound" in result.stderr:
            return None
        raise AssertionError(f"kubectl get {' '.join(args)}: {result.stderr}")
    return json.loads(result.stdout)


# ------------------------------------------------------- warmgate on a devcluster, for tests
CRD_FILE = "crds/warmgate.dev_embeddingservices.yaml"
ALIAS_CRD_FILE = "crds/warmgate.dev_embeddingaliases.yaml"
CRD_FILES = (CRD_FILE, ALIAS_CRD_FILE)
"""Every CRD in crds/: the operator watches both kinds."""
CRD_API_VERSION = "apiextensions.k8s.io/v1"
CRD_NAME = f"{PLURAL}.{GROUP}"
ALIAS_CRD_NAME = f"{ALIAS_PLURAL}.{GROUP}"
CRD_PATH = kubeapi.resource_path(CRD_API_VERSION, "customresourcedefinitions", name=CRD_NAME)
UNMAPPED_IMAGE = "registry.invalid/warmgate/not-imported:1"
"""An image the devcluster's node does not hold and cannot pull (its network namespace has no
route out, and the operators the tests start never pull): its pods are created and stay
waiting (ErrImageNeverPull, or ErrImagePull where a pull is tried), running no container
(objects to reconcile without real servers on 2 cores)."""


WRITE_VERBS = ("create", "update", "patch", "delete", "deletecollection")
READ_VERBS = ("get", "list", "watch")


def audit_writes(
    audit_log: Path,
    since: float,
    until: float,
    namespace: str | None = None,
    user_agents: tuple[str, ...] = (),
    verbs: tuple[str, ...] = WRITE_VERBS,
) -> list[dict[str, Any]]:
    """The writes the apiserver recorded in its audit log (`ClusterConfig.audit_log` and its
    rotated backups) received between `since` and `until` (wall clock), optionally only those
    in `namespace` and from clients whose user agent starts with one of `user_agents`. With
    `verbs=READ_VERBS`: the reads it recorded (those of warmgate.dev resources only)."""
    events = []
    for path in sorted(audit_log.parent.glob(f"{audit_log.stem}*{audit_log.suffix}")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                event = json.loads(line)
                received = datetime.fromisoformat(event["requestReceivedTimestamp"]).timestamp()
            except (ValueError, KeyError, TypeError):
                continue  # a line being written
            ref = event.get("objectRef") or {}
            if not since <= received <= until or event.get("verb") not in verbs:
                continue
            if namespace is not None and ref.get("namespace") != namespace:
                continue
            if user_agents and not str(event.get("userAgent", "")).startswith(user_agents):
                continue
            events.append(event)
    return events


def describe_audit(event: dict[str, Any]) -> str:
    """`2026-12-01T14:20:00.1Z patch configmaps ns/name (200) by warmgate-operator`."""
    ref = event.get("objectRef") or {}
    resource = ref.get("resource", "?")
    if ref.get("subresource"):
        resource += f"/{ref['subresource']}"
    code = (event.get("responseStatus") or {}).get("code")
    return (
        f"{event.get('requestReceivedTimestamp')} {event.get('verb')} {resource} "
        f"{ref.get('namespace', '')}/{ref.get('name', '')} ({code}) by {event.get('userAgent')}"
    )


def _checkout_file(relative: str) -> Path:
    root = repo_root()
    if root is None:
        raise RuntimeError(f"{relative} is read from a warmgate checkout; none found")
    return root / relative


def crd_manifest(relative: str = CRD_FILE) -> dict[str, Any]:
    """A CRD (the EmbeddingService's unless told), from the checkout's manifest file."""
    return yaml.safe_load(_checkout_file(relative).read_text())


def crd_path(name: str = CRD_NAME) -> str:
    return kubeapi.resource_path(CRD_API_VERSION, "customresourcedefinitions", name=name)


def wait_established(api: Any, timeout: float = 120.0, name: str = CRD_NAME) -> None:
    """Until the CRD `name` (the EmbeddingService's unless told) is Established (its API
    served)."""

    def established() -> bool:
        try:
            crd = kubeapi.read(api, crd_path(name))
        except (kubeapi.ApiError, *kubeapi.UNANSWERED):
            return False  # a busy apiserver: ask again until the deadline
        return condition(crd, "Established").get("status") == "True"

    wait_until(established, timeout, f"CRD {name} Established")


def install_crd(cluster: Any, timeout: float = 120.0) -> None:
    """Apply every CRD's manifest file (EmbeddingService and EmbeddingAlias: server-side, as a
    user would) and wait until each is Established. `cluster`: a devcluster handle or a
    DevCluster."""
    for relative in CRD_FILES:
        result = cluster.kubectl(
            "apply", "--server-side", "--force-conflicts", "-f", str(_checkout_file(relative)),
            check=False,
        )  # fmt: skip
        assert result.returncode == 0, f"CRD {relative} rejected: {result.stderr}"
    with cluster.api_client() as api:
        for relative in CRD_FILES:
            wait_established(api, timeout, crd_manifest(relative)["metadata"]["name"])


def tiny_minilm(name: str = "minilm", image: str | None = None) -> dict[str, Any]:
    """examples/minilm.yaml, shrunk so one real server pod warms fast on a 2-core machine:
    one replica, batch size 1, buckets 16 and 32 (two shapes), 1 s probes."""
    body = yaml.safe_load(_checkout_file("examples/minilm.yaml").read_text())
    body["metadata"]["name"] = name
    spec = body["spec"]
    spec["replicas"] = 1
    spec["model"]["maxInputLength"] = 32
    spec["batching"].update(maxBatchSize=1, maxBatchTokens=64)
    spec["warmup"].update(batchSizes=[1], sequenceBuckets=[16, 32])
    spec["probes"].update(periodSeconds=1)
    if image:
        spec["image"] = image
    return body


class OperatorProcess:
    """`python -m warmgate_operator ARGS` against a cluster (its `env`: KUBECONFIG), output in
    `log_path`, in a session of its own and stopped by its pid. Server pods default to the
    server image the node holds, never pulled (the node's only images are the imported ones),
    and download their model from the devcluster's hub."""

    def __init__(self, cluster: Any, log_path: Path, *args: str) -> None:
        self.env = dict(cluster.env, PYTHONUNBUFFERED="1")
        self.log_path = log_path
        if not any(arg.startswith("--default-image") for arg in args):
            args = (f"--default-image={images.SERVER.name}", *args)
        if not any(arg.startswith("--server-image-pull-policy") for arg in args):
            args = ("--server-image-pull-policy=Never", *args)
        hub = getattr(cluster, "hub_endpoint", None)
        if hub and not any(arg.startswith("--hub-endpoint") for arg in args):
            args = (f"--hub-endpoint={hub}", *args)
        self.args = args
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Self:
        assert not self.alive(), "already running"
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "warmgate_operator", *self.args],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int | None:
        """Signal it (SIGKILL after `timeout` seconds) and return its exit code."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            os.kill(proc.pid, sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout)
        return proc.returncode

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_lines(self) -> list[dict[str, Any]]:
        """The log's JSON lines (with `--log-format json`)."""
        lines = []
        for line in self.log().splitlines():
            with contextlib.suppress(ValueError):
                lines.append(json.loads(line))
        return lines


# ------------------------------------------------------- end to end: a namespace, a workload
# The kinds the tests read, by the names kubectl takes: (apiVersion, plural).
RESOURCES = {
    "pods": ("v1", "pods"),
    "services": ("v1", "services"),
    "configmaps": ("v1", "configmaps"),
    "events": ("v1", "events"),
    "deployments": ("apps/v1", "deployments"),
    "horizontalpodautoscalers": ("autoscaling/v2", "horizontalpodautoscalers"),
    "endpointslices": ("discovery.k8s.io/v1", "endpointslices"),
    PLURAL: (API_VERSION, PLURAL),
    ALIAS_PLURAL: (API_VERSION, ALIAS_PLURAL),
}
_SHORT_NAMES = {
    "hpa": "horizontalpodautoscalers",
    KIND.lower(): PLURAL,
    ALIAS_KIND.lower(): ALIAS_PLURAL,
}


def resource(kind: str) -> tuple[str, str]:
    """(apiVersion, plural) of a kind as kubectl takes it: `pods`, `pod`, `hpa`, ..."""
    name = _SHORT_NAMES.get(kind, kind)
    found = RESOURCES.get(name) or RESOURCES.get(f"{name}s")
    if found is None:
        raise KeyError(f"{kind}: not one of the kinds the tests read ({', '.join(RESOURCES)})")
    return found


class Kube:
    """One namespace of a devcluster, objects as JSON dicts: read and patched through the
    Kubernetes client; manifests applied, and kubectl's own verbs (`scale`, `delete --wait`)
    run, by kubectl."""

    def __init__(self, devcluster: Any, namespace: str) -> None:
        self.devcluster = devcluster
        self.namespace = namespace
        self.api = devcluster.api

    def run(self, *args: str, check: bool = True, input: str | None = None):
        return self.devcluster.kubectl("-n", self.namespace, *args, check=check, input=input)

    def path(self, kind: str, name: str | None = None) -> str:
        return kubeapi.resource_path(*resource(kind), self.namespace, name)

    def get(self, kind: str, name: str | None = None, selector: str | None = None) -> Any:
        """The object (or the list, without `name`); None when it is missing or the read
        failed (callers poll)."""
        query = {"labelSelector": selector} if selector else None
        try:
            return kubeapi.read(self.api, self.path(kind, name), query=query)
        except (kubeapi.ApiError, *kubeapi.UNANSWERED):
            return None

    def apply(self, manifest: dict) -> None:
        self.run("apply", "-f", "-", input=yaml.safe_dump(manifest))

    def patch(self, kind: str, name: str, patch: dict) -> None:
        """A JSON merge patch (`kubectl patch --type merge`)."""
        kubeapi.call(self.api, "PATCH", self.path(kind, name), patch, content_type=MERGE_PATCH)

    def pods(self, service: str) -> list[dict]:
        found = self.get("pods", selector=f"{SERVICE_LABEL}={service}")
        return found["items"] if found else []

    def events(self) -> list[dict]:
        found = wait_until(lambda: self.get("events"), 30, "the namespace's events")
        return found["items"]


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
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name},
        "spec": spec,
    }


class NamespacedOperator(OperatorProcess):
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
    service = wait_until(lambda: kube.get("service", name), 60, f"Service {name}")
    return int(service["spec"]["ports"][0]["nodePort"])


def service_url(kube: Kube, name: str, path: str = "/v1/embeddings") -> str:
    """The Service through its node port on the node's address: kube-proxy picks the pod."""
    return f"http://{kube.devcluster.node_ip}:{node_port(kube, name)}{path}"


def warmup_seconds(pod: dict) -> float | None:
    """The pod's warmup as the warm gate verified it (its warmgate.dev/warmed condition's
    message: "N shapes warm in X.Xs; ..."), or None before the gate has passed it."""
    message = condition(pod, WARMED_CONDITION).get("message") or ""
    found = re.search(r"warm in ([0-9.]+)s", message)
    return float(found.group(1)) if found else None


def wait_ready(kube: Kube, name: str, revision: str, replicas: int, timeout: float = 300) -> dict:
    """Until the EmbeddingService reports Ready with `replicas` pods of `revision` and no
    others (a finished rollout), and its node port, if it has one, routes to a pod."""
    emb = wait_finished(kube, name, revision, replicas, timeout)
    service = kube.get("service", name)
    if replicas and service and service["spec"].get("type") == "NodePort":
        wait_routed(kube, name)
    return emb


def wait_routed(kube: Kube, name: str, timeout: float = 60) -> None:
    """Until a GET /ready through the Service's node port answers 200. A pod is Ready before
    kube-proxy has written it into the Service's rules: until then the node port refuses
    connections (kube-proxy rejects a Service without endpoints), a second or more on a busy
    machine."""
    url = service_url(kube, name, "/ready")

    def answers() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                return response.status == 200
        except (OSError, http.client.HTTPException):
            return False

    wait_until(answers, timeout, f"the node port of {name} to route to a ready pod")


def wait_finished(
    kube: Kube, name: str, revision: str, replicas: int, timeout: float = 300
) -> dict:
    """Until the EmbeddingService reports Ready with `replicas` pods of `revision` and no
    others."""

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

    return wait_until(done, timeout, f"{name} Ready at {revision} with {replicas} pods", every=1.0)


def p_revision(pod: dict) -> str | None:
    args = pod["spec"]["containers"][0].get("args", [])
    for index, arg in enumerate(args):
        if arg.startswith("--model-revision="):
            return arg.split("=", 1)[1]
        if arg == "--model-revision" and index + 1 < len(args):
            return args[index + 1]
    return None


ROUTER_TEMPLATES = (
    "router-deployment",
    "router-service",
    "router-serviceaccount",
    "router-rbac",
    "router-poddisruptionbudget",
)
ROUTER_SELECTOR = "app.kubernetes.io/name=warmgate-router"


def render_router(kube: Kube, *sets: str, replicas: int = 2, timeout: float = 240) -> str:
    """The chart's router templates (`helm template`, release `wg`) for `kube`'s namespace,
    applied with kubectl: the router image the devcluster built, serving that namespace. Waits
    until `replicas` router pods are Ready and returns the router Service's name."""
    root = repo_root()
    assert root is not None, "the chart is read from a warmgate checkout"
    cluster = kube.devcluster
    result = subprocess.run(
        [
            str(cluster.bin_dir / "helm"), "template", "wg", str(root / "charts" / "warmgate"),
            "--namespace", kube.namespace,
            "--set", f"watchNamespaces={{{kube.namespace}}}",
            "--set", f"router.image.repository={images.ROUTER.name.rpartition(':')[0]}",
            "--set", "router.image.pullPolicy=Never",
            "--set", f"router.replicaCount={replicas}",
            *sets,
            *(a for name in ROUTER_TEMPLATES for a in ("--show-only", f"templates/{name}.yaml")),
        ],
        env={**cluster.env, "HOME": "/tmp", "HELM_CACHE_HOME": "/tmp/.helm-cache"},
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )  # fmt: skip
    documents = [d for d in yaml.safe_load_all(result.stdout) if d]
    kube.run("apply", "-f", "-", input=result.stdout)
    service = next(d["metadata"]["name"] for d in documents if d["kind"] == "Service")

    def ready() -> bool:
        found = kube.get("pods", selector=ROUTER_SELECTOR) or {}
        pods = [p for p in found.get("items", []) if not p["metadata"].get("deletionTimestamp")]
        return len(pods) == replicas and all(
            condition(p, "Ready").get("status") == "True" for p in pods
        )

    wait_until(ready, timeout, f"{replicas} Ready router pods")
    return service
