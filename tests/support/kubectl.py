"""Helpers for the kubectl-experience tests: the operator as a local process (admin
credentials, one namespace), JSON reads and polling."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from warmgate_devcluster import testkit
from warmgate_devcluster.testkit import (  # noqa: F401 - re-exported
    UNMAPPED_IMAGE,
    get_json,
    install_crd,
    tiny_minilm,
    wait_until,
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


class Operator(testkit.OperatorProcess):
    """`python -m warmgate_operator` watching one namespace, started at once, stopped by pid."""

    def __init__(self, cluster: Any, namespace: str, log_path: Path) -> None:
        super().__init__(
            cluster, log_path, f"--namespace={namespace}", "--log-format=text", "--resync-seconds=5"
        )
        self.start()
