"""Helpers for the operator's integration tests against the devcluster: the CRD, an operator
process stopped by pid, and kubectl with JSON output (polling: testkit.wait_until)."""

from __future__ import annotations

import contextlib
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from warmgate_devcluster import testkit
from warmgate_devcluster.testkit import UNMAPPED_IMAGE, install_crd  # noqa: F401 - re-exported
from warmgate_kube.client import WRITE_METHODS

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "minilm.yaml"
MANAGED = "app.kubernetes.io/managed-by=warmgate"


def get_json(cluster: Any, *args: str) -> dict[str, Any] | None:
    result = cluster.kubectl("get", *args, "-o", "json", "--show-managed-fields", check=False)
    if result.returncode != 0:
        if "NotFound" in result.stderr or "not found" in result.stderr:
            return None
        raise AssertionError(f"kubectl get {' '.join(args)}: {result.stderr}")
    return json.loads(result.stdout)


def items(cluster: Any, kind: str, namespace: str, selector: str = MANAGED) -> list[dict]:
    return get_json(cluster, kind, "-n", namespace, "-l", selector)["items"]


def example(name: str = "minilm", **spec_overrides: Any) -> dict[str, Any]:
    body = yaml.safe_load(EXAMPLE.read_text())
    body["metadata"]["name"] = name
    body["spec"]["image"] = UNMAPPED_IMAGE
    for path, value in spec_overrides.items():
        node = body["spec"]
        *parents, last = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return body


def apply(cluster: Any, namespace: str, body: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(body))


class OperatorProcess(testkit.OperatorProcess):
    """`python -m warmgate_operator --log-format json ARGS`, stopped by its pid."""

    def __init__(self, cluster: Any, log_path: Path, *args: str) -> None:
        super().__init__(cluster, log_path, "--log-format", "json", *args)


@contextlib.contextmanager
def running_operator(cluster: Any, log_path: Path, *args: str) -> Iterator[OperatorProcess]:
    op = OperatorProcess(cluster, log_path, *args).start()
    try:
        yield op
    finally:
        op.stop()


def operator_metrics(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
    """The operator's /metrics at this moment (`--http-address 127.0.0.1:PORT`), as
    {(sample name, sorted labels): value}; None while it does not answer. The counters are
    the live ones, read from the endpoint's own thread."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return None
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def operator_requests(port: int, methods: tuple[str, ...] = WRITE_METHODS) -> dict[str, int]:
    """The API requests the operator has made so far with one of `methods` (its writes by
    default), as {"PATCH configmaps": n, ...}."""
    metrics = operator_metrics(port)
    if metrics is None:
        raise AssertionError(f"the operator's /metrics on port {port} does not answer")
    counts = {}
    for (name, labels), value in metrics.items():
        if name == "warmgate_operator_api_requests_total":
            method, resource = dict(labels)["method"], dict(labels)["resource"]
            if method in methods:
                counts[f"{method} {resource}"] = int(value)
    return counts
