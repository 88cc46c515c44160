"""Observed traffic end to end: shapes production used go into the warmup profile, running pods
are left alone, and a pod added later warms those shapes before it gets traffic."""

from __future__ import annotations

import json
import urllib.request

import pytest

from warmgate_devcluster.testkit import embedding_service, service_url, wait_ready, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# Three short inputs: without batch padding the server runs a 3 x 16 tensor, a shape outside the
# configured plan (batch sizes 1 and 4), which only observed traffic can add.
THREE = {"input": ["one", "two", "three"]}


def post(url: str, body: dict) -> tuple[dict, dict]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response), dict(response.headers)


def shapes_of(items) -> set[tuple[int, int]]:
    return {(int(i["batch_size"]), int(i["seq_len"])) for i in items or []}


def test_observed_shapes_feed_the_profile_and_new_pods_warm_them(kube, operator):
    kube.apply(
        embedding_service(
            "observed",
            "v1",
            replicas=1,
            batching={"padBatch": False},
            warmup={"observedTraffic": {"enabled": True, "maxShapes": 4, "refreshSeconds": 10}},
        )
    )
    wait_ready(kube, "observed", "v1", replicas=1)
    (first_pod,) = kube.pods("observed")
    url = service_url(kube, "observed")
    _, headers = post(url, THREE)
    assert headers["X-Warmgate-Cold"] == "1"  # 3 x 16 was never planned: the first one is cold
    for _ in range(9):
        post(url, THREE)

    def profiled() -> dict | None:
        """The status once it counts all ten 3x16 requests, and the ConfigMap with the shape.
        The observer reads the pods every 10 s, so a read that landed while the requests were
        still being sent (a loaded machine) shows a part of them first."""
        emb = kube.get("embeddingservice", "observed")
        observed = emb.get("status", {}).get("observedShapes") or []
        counts = {(int(s["batch_size"]), int(s["seq_len"])): s["count"] for s in observed}
        configmap = kube.get("configmap", "observed-warmup-profile")
        profile = json.loads((configmap or {}).get("data", {}).get("profile.json") or "{}")
        if counts.get((3, 16), 0) >= 10 and (3, 16) in shapes_of(profile.get("shapes")):
            return emb
        return None

    wait_until(profiled, 90, "all ten 3x16 requests in status.observedShapes, and the ConfigMap")

    # Writing the profile restarted nothing.
    (same_pod,) = kube.pods("observed")
    assert same_pod["metadata"]["name"] == first_pod["metadata"]["name"]
    assert same_pod["status"]["containerStatuses"][0]["restartCount"] == 0

    # A pod added now reads the profile at start and warms 3 x 16 before it is let in.
    kube.run("scale", "embeddingservice/observed", "--replicas=2")
    wait_ready(kube, "observed", "v1", replicas=2)
    new_pod = next(
        p for p in kube.pods("observed") if p["metadata"]["name"] != first_pod["metadata"]["name"]
    )
    ip = new_pod["status"]["podIP"]
    with urllib.request.urlopen(f"http://{ip}:8080/ready", timeout=5) as response:
        report = json.load(response)
    assert (3, 16) in shapes_of(report["planned_shapes"])
    assert (3, 16) in shapes_of(report["warmed_shapes"])
    _, headers = post(f"http://{ip}:8080/v1/embeddings", THREE)
    assert headers["X-Warmgate-Cold"] == "0"
