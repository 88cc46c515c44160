"""`make up` and `make down` (quickstart.py), the README's first command, run as a user runs it:
the make target itself, which starts the devcluster with its real node, installs the operator
with the Helm chart from its image, applies examples/minilm.yaml and calls its Service. Only the
cluster's addresses, state folder and containerd root are its own (a free slot's), so it runs
beside the session's cluster and a user's `make up`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import urllib.request

import pytest

from warmgate_contract.names import COLD_HEADER, INSTANCE_LABEL, NAME_LABEL, OPERATOR_NAME
from warmgate_devcluster import images, procs
from warmgate_devcluster.cluster import DevCluster
from warmgate_devcluster.config import ClusterConfig, repo_root
from warmgate_devcluster.pytest_plugin import reserve_slot
from warmgate_devcluster.quickstart import OPERATOR_NAMESPACE, RELEASE

pytestmark = pytest.mark.cluster

ROOT = repo_root()


def make(target: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "-C", str(ROOT), target],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_make_up_serves_real_embeddings_through_the_service_and_make_down_stops_it(tmp_path):
    slot = reserve_slot()
    env = {
        **os.environ,
        "WARMGATE_DEVCLUSTER_STATE_DIR": str(tmp_path / "state"),
        "WARMGATE_DEVCLUSTER_NODE_CIDR": slot.node_cidr,
        "WARMGATE_DEVCLUSTER_POD_CIDR": slot.pod_cidr,
        "WARMGATE_DEVCLUSTER_CONTAINERD_ROOT": str(slot.containerd_root),
    }
    cluster = DevCluster(ClusterConfig.from_env(environ=env))
    pids: list[int] = []
    try:
        up = make("up", env, timeout=1800)
        said = up.stdout + up.stderr
        assert up.returncode == 0, said[-4000:]
        pids = cluster.all_pids()
        served = re.search(r"served 2 embeddings of (\d+) dimensions through the Service", said)
        assert served and served.group(1) == "384", said[-4000:]

        # The curl it prints works as printed: the node's address, the Service's node port.
        curl = re.search(r"curl -s (http://[\d.]+:\d+/v1/embeddings)", said)
        assert curl, said[-4000:]
        url = curl.group(1)
        assert url.startswith(f"http://{cluster.node_ip}:")  # the devcluster's own address
        request = urllib.request.Request(
            url,
            data=json.dumps({"input": "hello warm world"}).encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            answer = json.load(response)
            assert response.headers[COLD_HEADER] == "0"  # the pod was warm before Ready
        assert len(answer["data"][0]["embedding"]) == 384

        # The operator runs in-cluster, installed by the chart from its image, under the
        # chart's ServiceAccount.
        pods = json.loads(
            cluster.kubectl(
                "get", "pods", "-n", OPERATOR_NAMESPACE, "-l",
                f"{NAME_LABEL}={OPERATOR_NAME},{INSTANCE_LABEL}={RELEASE}", "-o", "json",
            ).stdout
        )["items"]  # fmt: skip
        running = [p for p in pods if p["status"].get("phase") == "Running"]
        assert running, [p["status"] for p in pods]
        for pod in running:
            assert pod["spec"]["containers"][0]["image"] == images.OPERATOR.name
            assert pod["spec"]["serviceAccountName"] != "default"

        # `up` again keeps the running cluster and serves again.
        again = make("up", env, timeout=900)
        assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
        assert "through the Service" in again.stdout
    finally:
        down = make("down", env, timeout=300)
        slot.release()
    assert down.returncode == 0, down.stdout + down.stderr
    assert pids and not [pid for pid in pids if procs.pid_running(pid)]
