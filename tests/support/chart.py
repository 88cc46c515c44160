"""Helpers for installing the chart into the devcluster, where its Deployments run the operator
and router images in-cluster under the chart's ServiceAccounts."""

from __future__ import annotations

import contextlib
import json
import subprocess
from pathlib import Path
from typing import Any

from warmgate_contract.names import INSTANCE_LABEL, NAME_LABEL, OPERATOR_NAME
from warmgate_devcluster.images import OPERATOR, ROUTER, SERVER
from warmgate_devcluster.testkit import (  # noqa: F401 - re-exported
    UNMAPPED_IMAGE,
    condition,
    get_json,
    tiny_minilm,
    wait_until,
)

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "warmgate"


def devcluster_values(cluster: Any) -> tuple[str, ...]:
    """The devcluster's node holds the images the chart names, imported, never pulled (the
    operator's, the router's and the server pods'); its server pods download their model from
    the devcluster's hub."""
    return (
        "--set", f"image.repository={OPERATOR.name.rpartition(':')[0]}",
        "--set", "image.pullPolicy=Never",
        "--set", f"router.image.repository={ROUTER.name.rpartition(':')[0]}",
        "--set", "router.image.pullPolicy=Never",
        "--set", f"serverImage={SERVER.name}",
        "--set", "serverImagePullPolicy=Never",
        "--set", f"hubEndpoint={cluster.hub_endpoint}",
    )  # fmt: skip


def helm(cluster: Any, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """The devcluster's helm, against its apiserver, with a throwaway helm home."""
    result = subprocess.run(
        [str(cluster.bin_dir / "helm"), *args],
        env={**cluster.env, "HOME": "/tmp", "HELM_CACHE_HOME": "/tmp/.helm-cache"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{result.stdout}{result.stderr}")
    return result


def operator_selector(release: str) -> str:
    """The label selector of a release's operator pods (its router pods share the instance)."""
    return f"{NAME_LABEL}={OPERATOR_NAME},{INSTANCE_LABEL}={release}"


def operator_log(cluster: Any, namespace: str, release: str) -> str:
    """The in-cluster operator's log (`kubectl logs`, through kubelet)."""
    result = cluster.kubectl(
        "logs", "-n", namespace, "-l", operator_selector(release), "--tail=-1", check=False
    )
    return result.stdout


def log_messages(log: str) -> list[str]:
    """The `message` of every JSON log line (the chart sets `--log-format=json`)."""
    found = []
    for line in log.splitlines():
        with contextlib.suppress(ValueError, AttributeError):
            found.append(str(json.loads(line).get("message", "")))
    return found
