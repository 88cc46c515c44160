"""The warm gate end to end: devcluster (real apiserver, controllers, scheduler), the operator as
a process, and pods running real warmgate servers with the real MiniLM weights, with a client
sending 20 requests a second through the Service's node port the whole time."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from support.load import service_load, summary, wait_for_traffic, weights_of

from warmgate_devcluster.testkit import (
    condition,
    embedding_service,
    wait_ready,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def pod_condition(pod: dict, kind: str) -> dict:
    return condition(pod, kind)


def test_model_reload_under_load_drops_nothing_and_serves_nothing_cold(
    kube, operator, reference_vectors
):
    """v1 and v2 are two revisions on the devcluster's hub with different weights: after the
    reload every answer comes from v2's weights."""
    kube.apply(embedding_service("reload", "v1"))
    wait_ready(kube, "reload", "v1", replicas=2)

    with service_load(kube, "reload") as load:
        wait_for_traffic(load, 40)
        kube.patch("embeddingservice", "reload", {"spec": {"model": {"revision": "v2"}}})
        emb = wait_ready(kube, "reload", "v2", replicas=2, timeout=400)
        wait_for_traffic(load, 40)
    report = load.report

    assert not report.failed, summary(report.failed)
    assert all(sample.cold is False for sample in report.samples), summary(report.cold)
    assert report.revisions_in_order() == ["v1", "v2"]
    last = sorted(report.samples, key=lambda s: s.started)[-20:]
    assert {sample.revision for sample in last} == {"v2"}
    assert emb["status"]["model"]["revision"] == "v2"
    # The weights changed with the revision: each answer is the vector of the weights its
    # revision names, and the last ones are all v2's.
    for sample in report.samples:
        assert weights_of(sample.vector, reference_vectors) == sample.revision, sample
    assert {weights_of(sample.vector, reference_vectors) for sample in last} == {"v2"}
    assert emb["status"]["model"]["commit"] == kube.devcluster.hub_revisions["v2"]

    # Each new pod was let in by the operator's verification, not by its probe alone.
    live = [p for p in kube.pods("reload") if not p["metadata"].get("deletionTimestamp")]
    assert len(live) == 2
    for pod in live:
        warmed = pod_condition(pod, "warmgate.dev/warmed")
        ready = pod_condition(pod, "Ready")
        assert warmed.get("status") == "True", warmed
        assert warmed["reason"] == "WarmupVerified"
        assert "revision v2" in warmed["message"]
        assert warmed["lastTransitionTime"] <= ready["lastTransitionTime"]


def test_control_without_gate_and_warmup_users_pay_the_cold_start(kube, operator):
    """The control: the same reload with warmgate's protection off (no warm gate, no warmup:
    what a plain Deployment with a process-up readiness probe gives). New pods take traffic
    before they have run the shapes it needs, and users see cold requests."""
    kube.apply(
        embedding_service("plain", "v1", warmup={"enabled": False}, rollout={"warmGate": False})
    )
    wait_ready(kube, "plain", "v1", replicas=2)

    with service_load(kube, "plain") as load:
        wait_for_traffic(load, 40)
        kube.patch("embeddingservice", "plain", {"spec": {"model": {"revision": "v2"}}})
        wait_ready(kube, "plain", "v2", replicas=2, timeout=400)
        wait_for_traffic(load, 40)
    report = load.report

    cold_v2 = [s for s in report.cold if s.revision == "v2"]
    assert cold_v2, "without the gate and warmup, the first requests on new pods should be cold"


def test_a_model_that_cannot_warm_never_gets_traffic_and_a_revert_resumes(kube, operator):
    kube.apply(embedding_service("broken", "v1"))
    wait_ready(kube, "broken", "v1", replicas=2)
    old_pods = {p["metadata"]["name"] for p in kube.pods("broken")}

    with service_load(kube, "broken") as load:
        wait_for_traffic(load, 20)
        kube.patch(
            "embeddingservice",
            "broken",
            {"spec": {"model": {"id": "sentence-transformers/no-such-model", "revision": "v2"}}},
        )

        def degraded() -> dict | None:
            emb = kube.get("embeddingservice", "broken")
            bad = condition(emb, "Degraded")
            return emb if bad.get("status") == "True" else None

        emb = wait_until(degraded, 240, "the EmbeddingService to report Degraded")
        progressing = condition(emb, "Progressing")
        assert condition(emb, "Degraded")["message"], emb["status"]
        assert progressing.get("status") != "True" or progressing.get("reason") != "RolloutComplete"
        # `kubectl describe emb` shows why: a Warning on the EmbeddingService itself, from the
        # operator, with the Degraded condition's reason.
        reason = condition(emb, "Degraded")["reason"]
        warnings = [
            e
            for e in kube.events()
            if e.get("type") == "Warning"
            and e["involvedObject"].get("kind") == "EmbeddingService"
            and e.get("reason") == reason
        ]
        assert warnings, f"no Warning event {reason} on the EmbeddingService"
        assert "broken-" in warnings[0]["message"], warnings[0]["message"]  # names the pod
        wait_for_traffic(load, 40)
        # Revert: the rollout goes back to the old template and settles.
        kube.patch(
            "embeddingservice",
            "broken",
            {"spec": {"model": {"id": "sentence-transformers/all-MiniLM-L6-v2", "revision": "v1"}}},
        )
        wait_ready(kube, "broken", "v1", replicas=2, timeout=300)
        wait_for_traffic(load, 20)
    report = load.report

    assert not report.failed, summary(report.failed)
    assert {s.revision for s in report.samples} == {"v1"}
    assert {s.pod for s in report.samples} <= old_pods | {
        p["metadata"]["name"] for p in kube.pods("broken")
    }
    assert not report.cold


def test_with_the_operator_down_new_pods_wait_instead_of_serving(kube, operator):
    kube.apply(embedding_service("orphan", "v1"))
    wait_ready(kube, "orphan", "v1", replicas=2)

    with service_load(kube, "orphan") as load:
        wait_for_traffic(load, 20)
        kube.patch("embeddingservice", "orphan", {"spec": {"model": {"revision": "v2"}}})

        def template_updated() -> bool:
            deployment = kube.get("deployment", "orphan")
            args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
            return "--model-revision=v2" in args

        wait_until(template_updated, 60, "the operator to roll the Deployment")
        operator.stop()

        def warm_but_held() -> dict | None:
            for pod in kube.pods("orphan"):
                args = pod["spec"]["containers"][0]["args"]
                if "--model-revision=v2" not in args:
                    continue
                if pod_condition(pod, "ContainersReady").get("status") == "True":
                    return pod
            return None

        held = wait_until(warm_but_held, 240, "a new pod whose server is ready")
        # Its server is warm and its probe passes, but nobody verified it: it stays out.
        observed_until = time.monotonic() + 5
        while time.monotonic() < observed_until:
            pod = kube.get("pod", held["metadata"]["name"])
            assert pod_condition(pod, "Ready").get("status") != "True"
            time.sleep(0.5)
        assert all(s.revision == "v1" for s in load.report.samples)

        operator.start()
        wait_ready(kube, "orphan", "v2", replicas=2, timeout=400)
        wait_for_traffic(load, 20)
    report = load.report

    assert not report.failed, summary(report.failed)
    assert not report.cold
    assert report.revisions_in_order() == ["v1", "v2"]


def test_a_restarted_server_is_verified_again(kube, operator, devcluster):
    # verifyLatency: the gate also times one request against the pod's reported steady latency.
    kube.apply(embedding_service("restart", "v1", replicas=1, rollout={"verifyLatency": True}))
    wait_ready(kube, "restart", "v1", replicas=1)
    (pod,) = kube.pods("restart")
    before = pod_condition(pod, "warmgate.dev/warmed")
    assert "verification" in before["message"] and "vs steady" in before["message"], before

    # The server process dies (as an OOM kill would): kubelet restarts the container.
    pids = devcluster.container_pids(pod, "server")
    assert pids
    for pid in pids:
        os.kill(pid, signal.SIGKILL)

    def reverified() -> dict | None:
        current = kube.get("pod", pod["metadata"]["name"])
        warmed = pod_condition(current, "warmgate.dev/warmed")
        restarts = current["status"]["containerStatuses"][0]["restartCount"]
        # The gate's record of what it verified: this pod, at its first restart.
        state = json.loads(current["metadata"]["annotations"]["warmgate.dev/gate-state"])
        verified_restart = state["uid"] == pod["metadata"]["uid"] and state["restarts"] == 1
        if restarts >= 1 and warmed.get("status") == "True" and verified_restart:
            return warmed
        return None

    after = wait_until(reverified, 240, "the restarted server to be verified again")
    # The transition time moves only when the status does: True -> False -> True.
    assert after["lastTransitionTime"] > before["lastTransitionTime"]
