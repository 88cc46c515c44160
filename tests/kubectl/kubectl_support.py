"""Helpers for the kubectl-experience tests: the operator as a local process (admin
credentials, one namespace), JSON reads and polling."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from warmgate_devcluster.testkit import get_json, wait_until  # noqa: F401 - re-exported

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
CRD = ROOT / "crds" / "warmgate.dev_embeddingservices.yaml"
# No entry in the devcluster's image map: pods stay in ErrImagePull and run no process.
UNMAPPED_IMAGE = "registry.invalid/warmgate/not-mapped:1"


def tiny_minilm(name: str, image: str | None = None) -> dict[str, Any]:
    """examples/minilm.yaml with one replica and a two-shape warmup plan (fast on 2 cores)."""
    body = yaml.safe_load((EXAMPLES / "minilm.yaml").read_text())
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


class Operator:
    """`python -m warmgate_operator` watching one namespace, stopped by pid."""

    def __init__(self, cluster: Any, namespace: str, log_path: Path) -> None:
        env = dict(cluster.env, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(ROOT / "operator"), env.get("PYTHONPATH", "")])
        )
        self.log_path = log_path
        with log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable, "-m", "warmgate_operator", f"--namespace={namespace}",
                    "--log-format=text", "--resync-seconds=5",
                ],
                env=env, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")
