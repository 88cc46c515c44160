"""A warmup plan too big for the pod's memory, on the real node: the container's memory limit is
kubelet's cgroup, and going past it is the kernel's OOM kill. With `warmup.memoryPolicy: refuse`
the EmbeddingService says WarmupMemoryExceeded, with numbers, and the pod is neither killed nor
restarted; with `fit` it serves the shapes that fit; a reload to a plan that does not fit leaves
the old pods serving, losing no request.

The limit: the devcluster's server image loads MiniLM in about 0.65 GiB (its torch is the CUDA
build from PyPI), and the plan below peaks at about 1.25 GiB (32 x 256 on two workers;
docs/benchmarks.md): 1 GiB holds the model and the smaller half of the plan. (The issue's 300 MiB
is below what this image needs to import torch at all, which the pod then reports too: see
test_a_limit_below_what_loading_takes_is_refused_before_loading.)"""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
from support.load import service_load, summary, wait_for_traffic

from warmgate_devcluster.testkit import condition, embedding_service, wait_ready, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

BIG_PLAN = {
    "warmup": {"batchSizes": [1, 8, 32], "sequenceBuckets": [32, 64, 128, 256]},
    "batching": {"maxBatchSize": 32, "maxBatchTokens": 8192},
}
ONE_GIB = {"resources": {"requests": {"cpu": "100m", "memory": "1Gi"}, "limits": {"memory": "1Gi"}}}


def memory_refused(kube, name: str):
    def degraded() -> dict | None:
        emb = kube.get("embeddingservice", name)
        found = condition(emb, "Degraded")
        return emb if found.get("reason") == "WarmupMemoryExceeded" else None

    return degraded


def assert_never_killed_or_restarted(kube, name: str) -> None:
    for pod in kube.pods(name):
        for status in pod["status"].get("containerStatuses") or []:
            assert status["restartCount"] == 0, status
            terminated = (status.get("lastState") or {}).get("terminated") or {}
            assert terminated.get("reason") != "OOMKilled", status


def test_a_plan_too_big_for_the_pod_is_refused_with_numbers_and_not_restarted(
    kube, operator, report
) -> None:
    kube.apply(embedding_service("toobig", "v1", replicas=1, **BIG_PLAN, **ONE_GIB))
    applied = time.monotonic()
    emb = wait_until(memory_refused(kube, "toobig"), 240, "Degraded WarmupMemoryExceeded")
    took = time.monotonic() - applied
    message = condition(emb, "Degraded")["message"]
    assert "GiB" in message and "resources.limits.memory" in message, message
    assert "batching.maxBatchTokens" in message and "memoryPolicy: fit" in message, message
    (pod,) = kube.pods("toobig")
    started = pod["status"]["containerStatuses"][0]["state"]["running"]["startedAt"]
    report(f"apply to Degraded WarmupMemoryExceeded: {took:.1f}s (container started {started})")
    report(f"the status says: {message}")
    # The pod stays up (its start ended: /started) and out of rotation; nothing restarts it.
    time.sleep(15)
    (pod,) = kube.pods("toobig")
    assert condition(pod, "Ready").get("status") == "False"
    assert condition(pod, "warmgate.dev/warmed")["reason"] == "WarmupMemoryExceeded"
    assert pod["status"]["containerStatuses"][0]["started"] is True
    assert_never_killed_or_restarted(kube, "toobig")
    assert condition(kube.get("embeddingservice", "toobig"), "Ready")["status"] == "False"
    assert any(
        event.get("reason") == "WarmupMemoryExceeded"
        and event.get("involvedObject", {}).get("kind") == "EmbeddingService"
        for event in kube.events()
    )


def test_fit_serves_the_shapes_that_fit(kube, operator) -> None:
    fit = {**BIG_PLAN, "warmup": {**BIG_PLAN["warmup"], "memoryPolicy": "fit"}}
    kube.apply(embedding_service("fit", "v1", replicas=1, **fit, **ONE_GIB))
    emb = wait_ready(kube, "fit", "v1", replicas=1, timeout=300)
    (pod,) = kube.pods("fit")
    with urllib.request.urlopen(f"http://{pod['status']['podIP']}:8080/ready", timeout=30) as r:
        memory = json.loads(r.read())["memory"]
    assert memory["cut"] is not None and memory["cut"]["shapes"], memory
    assert memory["peak_bytes"] <= memory["budget_bytes"]
    verified = condition(pod, "warmgate.dev/warmed")["message"]
    assert "cut to fit in memory" in verified, verified
    # The status shows what the serving pods measured, against their limit.
    assert emb["status"]["memory"]["limitBytes"] == 1 << 30
    assert 0 < emb["status"]["memory"]["peakBytes"] < 1 << 30
    assert condition(emb, "MemoryPressure")["status"] in ("True", "False")
    with service_load(kube, "fit") as load:
        wait_for_traffic(load, 20)
    assert not load.report.failed, summary(load.report.failed)
    assert_never_killed_or_restarted(kube, "fit")


def test_a_reload_to_a_plan_that_does_not_fit_keeps_the_old_pods_serving(kube, operator) -> None:
    small = {
        "warmup": {"batchSizes": [1, 8], "sequenceBuckets": [32, 64, 128]},
        "batching": {"maxBatchSize": 8, "maxBatchTokens": 1024},
    }
    kube.apply(embedding_service("reloadbig", "v1", replicas=2, **small, **ONE_GIB))
    wait_ready(kube, "reloadbig", "v1", replicas=2)
    old = {pod["metadata"]["name"] for pod in kube.pods("reloadbig")}
    with service_load(kube, "reloadbig") as load:
        wait_for_traffic(load, 20)
        kube.patch("embeddingservice", "reloadbig", {"spec": BIG_PLAN})
        wait_until(memory_refused(kube, "reloadbig"), 240, "the new pod refused for memory")
        wait_for_traffic(load, 60)
    assert not load.report.failed, summary(load.report.failed)
    # Every answer came from an old pod; they all still serve.
    assert {sample.pod for sample in load.report.samples} <= old
    ready = {
        pod["metadata"]["name"]
        for pod in kube.pods("reloadbig")
        if condition(pod, "Ready").get("status") == "True"
    }
    assert ready == old
    assert_never_killed_or_restarted(kube, "reloadbig")
    # The refused pod does not sit Not-Ready for ever: a changed spec (the plan that fits, a new
    # revision) replaces it, and the rollout finishes on pods of the new spec only.
    refused = {pod["metadata"]["name"] for pod in kube.pods("reloadbig")} - old
    assert refused, "the refused pod"
    # The warm gate wrote the refusal once: it did not write again, every retry over the 60 s
    # of traffic, with the resourceVersion its own write had left behind (409 Conflict).
    stale = [
        line
        for line in operator.log().splitlines()
        if "409" in line and any(name in line for name in refused)
    ]
    assert not stale, stale[:3]
    kube.patch("embeddingservice", "reloadbig", {"spec": {**small, "model": {"revision": "v2"}}})
    wait_ready(kube, "reloadbig", "v2", replicas=2, timeout=420)
    serving = {
        pod["metadata"]["name"]
        for pod in kube.pods("reloadbig")
        if not pod["metadata"].get("deletionTimestamp")  # a replaced pod may still be draining
    }
    assert len(serving) == 2 and not serving & (old | refused), serving


def test_a_limit_below_what_loading_takes_is_refused_before_loading(kube, operator, report) -> None:
    """The issue's 300 MiB: the image measured what importing its torch takes when it was
    built, so the pod says at once that loading cannot fit, instead of being killed while it
    imports torch, again and again."""
    small = {"resources": {"requests": {"memory": "300Mi"}, "limits": {"memory": "300Mi"}}}
    kube.apply(embedding_service("tiny", "v1", replicas=1, **small))
    applied = time.monotonic()
    emb = wait_until(memory_refused(kube, "tiny"), 120, "Degraded WarmupMemoryExceeded")
    report(f"300Mi: apply to Degraded WarmupMemoryExceeded in {time.monotonic() - applied:.1f}s")
    message = condition(emb, "Degraded")["message"]
    report(f"the status says: {message}")
    assert "loading needs about" in message and "resources.limits.memory" in message, message
    assert_never_killed_or_restarted(kube, "tiny")
