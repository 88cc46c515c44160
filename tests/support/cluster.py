"""Helpers for the operator's integration tests against the devcluster: the CRD, an operator
process stopped by pid, and kubectl with JSON output (polling: testkit.wait_until)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from warmgate_devcluster import testkit
from warmgate_devcluster.testkit import UNMAPPED_IMAGE, install_crd  # noqa: F401 - re-exported

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
