"""Standby pods end to end on the real node (spec.standbyReplicas): warm, verified pods kept
outside the Service; `kubectl scale` promotes one within a second or two (the Service's
EndpointSlice has the new endpoint), a new standby pod warms behind it; a scale-in turns a
serving pod into a standby one whose pooled keep-alive clients are told to reconnect; a model
reload replaces the pool too. Clients: the OpenAI SDK at its defaults with retries off, through
the Service's node port."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

import pytest
from support.load import pooled_load, through_service

from warmgate_contract.names import (
    GATE_STATE_ANNOTATION,
    ROLE_LABEL,
    SERVER_PORT,
    SPEC_HASH_ANNOTATION,
    WARMED_CONDITION,
)
from warmgate_devcluster.testkit import (
    condition,
    embedding_service,
    p_revision,
    wait_ready,
    wait_until,
)
from warmgate_operator.roles import Member, assign

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# Serving, standby and a surge or refill pod side by side on the 2-core node: small requests.
SMALL = {"requests": {"cpu": "100m", "memory": "512Mi"}}


def live_pods(kube, name: str) -> list[dict]:
    return [p for p in kube.pods(name) if not p["metadata"].get("deletionTimestamp")]


def role(pod: dict) -> str | None:
    return (pod["metadata"].get("labels") or {}).get(ROLE_LABEL)


def ready_endpoints(kube, name: str) -> set[str]:
    """The pod names the Service's EndpointSlices route to (ready endpoints only)."""
    slices = kube.get("endpointslices", selector=f"kubernetes.io/service-name={name}")
    return {
        endpoint["targetRef"]["name"]
        for item in (slices or {}).get("items", [])
        for endpoint in item.get("endpoints") or []
        if (endpoint.get("conditions") or {}).get("ready") and endpoint.get("targetRef")
    }


def wait_pool(kube, name: str, serving: int, standby: int, timeout: float = 300) -> dict:
    """Until the status counts `serving` and `standby` pods, and the labels agree."""

    def settled() -> dict | None:
        emb = kube.get("embeddingservice", name) or {}
        status = emb.get("status") or {}
        if (status.get("servingReplicas"), status.get("standbyReplicas")) != (serving, standby):
            return None
        roles = sorted(str(role(p)) for p in live_pods(kube, name))
        return emb if roles == sorted(["serving"] * serving + ["standby"] * standby) else None

    return wait_until(settled, timeout, f"{serving} serving and {standby} standby pods of {name}")


def test_kubectl_scale_promotes_the_standby_pod_at_once_and_a_scale_in_sends_clients_away(
    kube, operator, report
) -> None:
    kube.apply(embedding_service("pool", "v1", standbyReplicas=1, resources=SMALL))
    wait_ready(kube, "pool", "v1", replicas=3, timeout=420)
    emb = wait_pool(kube, "pool", serving=2, standby=1)
    assert emb["spec"]["standbyReplicas"] == 1
    (spare,) = [p for p in live_pods(kube, "pool") if role(p) == "standby"]
    spare_name = spare["metadata"]["name"]
    # The standby pod passed the warm gate (it is Ready) but the Service does not route to it.
    assert ready_endpoints(kube, "pool") == {
        p["metadata"]["name"] for p in live_pods(kube, "pool") if role(p) == "serving"
    }
    assert emb["status"]["selector"].endswith(f"{ROLE_LABEL}=serving")

    with pooled_load(through_service(kube, "pool")) as load:
        wait_until(lambda: len(load.answers) >= 20, 60, "20 answers")
        assert spare_name not in {a.pod for a in load.answers}
        commanded = time.monotonic()
        kube.run("scale", "embeddingservice/pool", "--replicas=3")
        wait_until(
            lambda: spare_name in ready_endpoints(kube, "pool"),
            30,
            "the standby pod in the Service's endpoints",
            every=0.05,
        )
        promoted_after = time.monotonic() - commanded
        # A new standby pod starts, warms and passes the gate behind it.
        emb = wait_pool(kube, "pool", serving=3, standby=1, timeout=300)
        last = emb["status"]["lastScaleOut"]
        report(
            f"standby: kubectl scale 2->3 to the standby pod in the endpoints: "
            f"{promoted_after:.2f}s; status.lastScaleOut {last['seconds']}s "
            f"(standbyPromoted={last['standbyPromoted']})"
        )
        assert promoted_after <= 2.0
        assert last["standbyPromoted"] is True and (last["fromReplicas"], last["toReplicas"]) == (
            2,
            3,
        )

        # Scale in: one serving pod becomes standby, its pooled connections are told to go.
        # Which one, by the operator's own ranking: a second pooled client keeps a connection
        # open to it (its address, directly), as a client routed there by kube-proxy would.
        pods = live_pods(kube, "pool")
        template = kube.get("deployment", "pool")["spec"]["template"]["metadata"]["annotations"]
        members = [Member.of(p, template[SPEC_HASH_ANNOTATION]) for p in pods]
        after_scale_in = assign(members, 2)
        (demoted,) = [
            m.name for m in members if m.role == "serving" and after_scale_in[m.name] == "standby"
        ]
        (demoted_ip,) = [p["status"]["podIP"] for p in pods if p["metadata"]["name"] == demoted]
        with pooled_load(f"http://{demoted_ip}:{SERVER_PORT}/v1", threads=1) as pinned:
            wait_until(lambda: len(pinned.answers) >= 5, 30, "answers on the pinned connection")
            demanded = time.monotonic()
            kube.run("scale", "embeddingservice/pool", "--replicas=2")
            wait_pool(kube, "pool", serving=2, standby=1, timeout=120)
            wait_until(lambda: len(ready_endpoints(kube, "pool")) == 2, 30, "two endpoints")
            # kube-proxy's rules follow the EndpointSlice within a second or two.
            settled = time.monotonic() + 3.0
            wait_until(
                lambda: sum(1 for a in load.answers if a.at >= settled) >= 20,
                60,
                "20 answers after the scale-in settled",
            )
    assert demoted not in ready_endpoints(kube, "pool")
    assert not pinned.errors, pinned.errors[:5]
    told = [a for a in pinned.answers if a.at >= demanded and a.connection == "close"]
    assert told, "the demoted pod never told its keep-alive client to reconnect"
    assert {a.pod for a in pinned.answers} == {demoted}  # and served it all the same
    assert not load.errors, load.errors[:5]
    assert not [a for a in load.answers if a.cold != "0"]
    serving_now = ready_endpoints(kube, "pool")
    # Every answer since is from a serving pod: the demoted one's clients reconnected.
    recent = load.pods_since(settled)
    assert recent and recent <= serving_now, (recent, serving_now)
    assert len(live_pods(kube, "pool")) == 3  # the pool kept, nothing else deleted
    report(
        f"standby: scale-in 3->2: {demoted} demoted; its pinned keep-alive client was told to "
        f"reconnect {len(told)} times, 0 failed; the Service's clients: {len(load.answers)} "
        f"answers, 0 failed, every one since from the 2 serving pods"
    )


def test_a_reload_replaces_the_standby_pool_with_no_failed_or_cold_request(kube, operator) -> None:
    kube.apply(embedding_service("poolreload", "v1", standbyReplicas=1, resources=SMALL))
    wait_ready(kube, "poolreload", "v1", replicas=3, timeout=420)
    wait_pool(kube, "poolreload", serving=2, standby=1)
    with pooled_load(through_service(kube, "poolreload")) as load:
        wait_until(lambda: len(load.answers) >= 20, 60, "20 answers")
        kube.patch("embeddingservice", "poolreload", {"spec": {"model": {"revision": "v2"}}})
        wait_ready(kube, "poolreload", "v2", replicas=3, timeout=600)
        wait_until(
            lambda: {p_revision(pod) for pod in kube.pods("poolreload")} == {"v2"},
            120,
            "the old pods gone",
        )
        wait_pool(kube, "poolreload", serving=2, standby=1)
        done = time.monotonic()
        count = len(load.answers)
        wait_until(lambda: len(load.answers) >= count + 20, 60, "20 answers after the rollout")
    assert not load.errors, load.errors[:5]
    assert not [a for a in load.answers if a.cold != "0"]
    revisions = [a.revision for a in load.answers]
    assert revisions[0] == "v1"
    assert {a.revision for a in load.answers if a.at >= done} == {"v2"}
    pods = live_pods(kube, "poolreload")
    assert len(pods) == 3 and {p_revision(p) for p in pods} == {"v2"}
    assert sorted(str(role(p)) for p in pods) == ["serving", "serving", "standby"]


def test_a_restarted_standby_pod_is_verified_again_before_it_is_promoted(
    kube, operator, devcluster
) -> None:
    """The standby server dies (as an OOM kill would): kubelet restarts it, the gate closes
    until the new process is verified, and a scale-out asked for meanwhile promotes it only
    then, into a server that was told its role again."""
    kube.apply(embedding_service("spare", "v1", replicas=1, standbyReplicas=1, resources=SMALL))
    wait_ready(kube, "spare", "v1", replicas=2, timeout=420)
    wait_pool(kube, "spare", serving=1, standby=1)
    (standby,) = [p for p in live_pods(kube, "spare") if role(p) == "standby"]
    name = standby["metadata"]["name"]
    for pid in devcluster.container_pids(standby, "server"):
        os.kill(pid, signal.SIGKILL)

    def restarted() -> dict | None:
        pod = kube.get("pod", name) or {}
        statuses = (pod.get("status") or {}).get("containerStatuses") or [{}]
        return pod if statuses[0].get("restartCount", 0) >= 1 else None

    wait_until(restarted, 60, "kubelet to restart the standby server", every=0.2)
    kube.run("scale", "embeddingservice/spare", "--replicas=2")
    # Until the pool is whole again (2 serving, 1 standby): whenever the restarted pod is in
    # the Service's endpoints, the gate has verified its new process.
    unverified_in_service: list[dict] = []

    def settled() -> dict | None:
        pod = kube.get("pod", name) or {}
        if name in ready_endpoints(kube, "spare"):
            raw = (pod.get("metadata", {}).get("annotations") or {}).get(GATE_STATE_ANNOTATION)
            if not raw or json.loads(raw)["restarts"] != 1:
                unverified_in_service.append(pod)
        emb = kube.get("embeddingservice", "spare") or {}
        status = emb.get("status") or {}
        whole = (status.get("servingReplicas"), status.get("standbyReplicas")) == (2, 1)
        return pod if whole and condition(pod, "Ready").get("status") == "True" else None

    pod = wait_until(settled, 300, "the pool whole again", every=0.2)
    assert not unverified_in_service
    warmed = condition(pod, WARMED_CONDITION)
    state = json.loads(pod["metadata"]["annotations"][GATE_STATE_ANNOTATION])
    assert state["restarts"] == 1 and warmed["status"] == "True"
    assert warmed["lastTransitionTime"] <= condition(pod, "Ready")["lastTransitionTime"]
    # The restarted process was told the role its label says (a fresh server starts serving).
    url = f"http://{pod['status']['podIP']}:{SERVER_PORT}/role"

    def server_role() -> str:
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.load(response)["role"]

    wait_until(lambda: server_role() == role(pod), 30, "the restarted server told its role")
