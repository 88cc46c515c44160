"""Helpers for installing the chart into the devcluster and running the operator the way the
installed Deployment would: its image's entrypoint, the manifest's arguments and environment,
and the chart ServiceAccount's identity (a token, not the admin certificate)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from warmgate_devcluster.procs import free_ports
from warmgate_devcluster.testkit import (  # noqa: F401 - re-exported
    UNMAPPED_IMAGE,
    condition,
    get_json,
    tiny_minilm,
    wait_until,
)

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "warmgate"
OPERATOR_DOCKERFILE = ROOT / "operator" / "Dockerfile"


def free_port() -> int:
    return free_ports(1)[0]


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


def image_entrypoint(dockerfile: Path = OPERATOR_DOCKERFILE) -> list[str]:
    """The final stage's exec-form ENTRYPOINT, with `python` meaning this interpreter."""
    entrypoint: list[str] | None = None
    for line in dockerfile.read_text().splitlines():
        if line.startswith("ENTRYPOINT "):
            entrypoint = json.loads(line.removeprefix("ENTRYPOINT "))
    assert entrypoint, f"{dockerfile} has no exec-form ENTRYPOINT"
    return [sys.executable if word == "python" else word for word in entrypoint]


def service_account_kubeconfig(cluster: Any, namespace: str, account: str, path: Path) -> Path:
    """A kubeconfig for the devcluster's apiserver (URL and CA from the admin one) that
    authenticates with a token of `account`, so every request is authorised by its RBAC."""
    token = cluster.kubectl(
        "create", "token", account, "-n", namespace, "--duration=1h"
    ).stdout.strip()
    admin = yaml.safe_load(Path(cluster.kubeconfig).read_text())
    server = admin["clusters"][0]
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [server],
                "users": [{"name": account, "user": {"token": token}}],
                "contexts": [
                    {"name": account, "context": {"cluster": server["name"], "user": account}}
                ],
                "current-context": account,
            }
        )
    )
    return path


class InstalledOperator:
    """The operator container of an installed release, run as a local process (stopped by pid):
    entrypoint from operator/Dockerfile, args and env from the live Deployment, credentials
    from the pod's ServiceAccount."""

    def __init__(self, deployment: dict[str, Any], kubeconfig: Path, log_path: Path) -> None:
        pod = deployment["spec"]["template"]["spec"]
        (self.container,) = pod["containers"]
        self.service_account = pod["serviceAccountName"]
        self.kubeconfig = kubeconfig
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def argv(self) -> list[str]:
        command = self.container.get("command") or image_entrypoint()
        return [*command, *self.container.get("args", [])]

    def start(self) -> InstalledOperator:
        env = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith(("KUBERNETES_", "WARMGATE_", "KUBECONFIG"))
        }
        for item in self.container.get("env", []):
            assert "value" in item, f"only literal env is supported here: {item}"
            env[item["name"]] = item["value"]
        paths = [str(ROOT / "operator"), *filter(None, env.get("PYTHONPATH", "").split(":"))]
        env.update(
            KUBECONFIG=str(self.kubeconfig), PYTHONPATH=":".join(paths), PYTHONUNBUFFERED="1"
        )
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd="/tmp"
            )
        return self

    def stop(self, timeout: float = 15.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def messages(self, since: int = 0) -> list[str]:
        """The `message` of every JSON log line (the chart sets `--log-format=json`), from
        character offset `since` of the log on."""
        found = []
        for line in self.log()[since:].splitlines():
            with contextlib.suppress(ValueError, AttributeError):
                found.append(str(json.loads(line).get("message", "")))
        return found
