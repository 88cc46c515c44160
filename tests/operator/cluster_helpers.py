"""Helpers for the operator's integration tests against the devcluster: the CRD, an operator
process stopped by pid, kubectl with JSON output, and polling."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import yaml

from warmgate_devcluster.testkit import wait_until as _wait_until

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "warmgate.dev_embeddingservices.yaml"
EXAMPLE = ROOT / "examples" / "minilm.yaml"
# No entry in the devcluster's image map: pods are created and stay in ErrImagePull, which is
# all these tests need (no model processes on a 2-core machine).
UNMAPPED_IMAGE = "registry.invalid/warmgate/not-mapped:1"
MANAGED = "app.kubernetes.io/managed-by=warmgate"

T = TypeVar("T")


def wait_until(
    probe: Callable[[], T | None], timeout: float = 60.0, interval: float = 0.25, what: str = ""
) -> T:
    """Poll `probe` until it returns something truthy; fail with `what` after `timeout`."""
    return _wait_until(probe, timeout, what, every=interval)


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


def install_crd(cluster: Any) -> None:
    result = cluster.kubectl(
        "apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE), check=False
    )
    assert result.returncode == 0, f"CRD rejected: {result.stderr}"
    cluster.kubectl(
        "wait",
        "--for=condition=Established",
        "--timeout=60s",
        "crd/embeddingservices.warmgate.dev",
    )


class OperatorProcess:
    """`python -m warmgate_operator` as a child process, stopped by its pid."""

    def __init__(self, cluster: Any, log_path: Path, *args: str) -> None:
        self.cluster = cluster
        self.log_path = log_path
        self.args = args
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> OperatorProcess:
        env = dict(self.cluster.env)
        paths = [str(ROOT / "operator")] + [
            p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p
        ]
        env["PYTHONPATH"] = os.pathsep.join(paths)
        env["PYTHONUNBUFFERED"] = "1"
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "warmgate_operator", "--log-format", "json", *self.args],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=str(ROOT),
        )
        log.close()
        return self

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int | None:
        proc = self.proc
        if proc is None:
            return None
        self.proc = None
        if proc.poll() is None:
            os.kill(proc.pid, sig)
            try:
                return proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                return proc.wait(timeout)
        return proc.returncode

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_lines(self) -> list[dict[str, Any]]:
        lines = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                lines.append(json.loads(line))
        return lines


@contextlib.contextmanager
def running_operator(cluster: Any, log_path: Path, *args: str) -> Iterator[OperatorProcess]:
    op = OperatorProcess(cluster, log_path, *args).start()
    try:
        yield op
    finally:
        op.stop()
