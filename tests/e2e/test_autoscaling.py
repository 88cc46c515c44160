"""Autoscaling end to end on the real node: load through the Service raises the pods' CPU
(kubelet's cgroups, read by metrics-server), the HPA the operator made scales the
EmbeddingService out, the new pod (or, with a standby pool, the promoted standby pod) serves
only once it has passed the warm gate (no cold hit, no failed request), and the load ending
scales it back in after the CRD's scale-down stabilization window. The tests report the
timeline (in the run's summary, and in their output when they fail): scale-out decision, new
pod warm, Ready, first request served by it, beside the pod's own warmup time."""

from __future__ import annotations

import calendar
import json
import time
import urllib.request
from typing import Any

import pytest

from warmgate_contract.names import REASON_VERIFIED, SERVER_PORT, WARMED_CONDITION
from warmgate_devcluster.loadgen import ConstantRateLoad
from warmgate_devcluster.testkit import (
    condition,
    embedding_service,
    service_url,
    wait_ready,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SCALE_DOWN_WINDOW = 20
RATE = 25.0


def epoch(timestamp: str) -> float:
    return float(calendar.timegm(time.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ")))


def parse_micro(timestamp: str) -> float:
    """A MicroTime (`...T10:00:00.123456Z`) as Unix time."""
    whole, _, fraction = timestamp.rstrip("Z").partition(".")
    return epoch(whole + "Z") + float(f"0.{fraction or 0}")


def container_started(pod: dict) -> str:
    (status,) = pod["status"]["containerStatuses"]
    return status["state"]["running"]["startedAt"]


def deployment_replicas(kube: Any, name: str) -> int:
    return int((kube.get("deployment", name) or {}).get("spec", {}).get("replicas") or 0)


def scaler(name: str, scale_down_window: int, **spec: Any) -> dict:
    """An autoscaled MiniLM service from 1 pod (spec.replicas, where the HPA starts from) to 2,
    with a small CPU request, so that RATE requests a second is well above the 50% target."""
    return embedding_service(
        name,
        "v1",
        replicas=1,
        resources={"requests": {"cpu": "100m", "memory": "512Mi"}},
        autoscaling={
            "enabled": True,
            "minReplicas": 1,
            "maxReplicas": 2,
            "targetCPUUtilizationPercentage": 50,
            "scaleUp": {"stabilizationWindowSeconds": 0},
            "scaleDown": {"stabilizationWindowSeconds": scale_down_window},
        },
        **spec,
    )


def test_load_scales_out_through_the_warm_gate_and_idles_back_in(kube, operator, report):
    kube.apply(scaler("scaler", scale_down_window=SCALE_DOWN_WINDOW))
    wait_ready(kube, "scaler", "v1", replicas=1)
    (first,) = kube.pods("scaler")

    with ConstantRateLoad(
        service_url(kube, "scaler"), rate=RATE, networks=kube.devcluster.networks
    ) as load:
        emb = wait_ready(kube, "scaler", "v1", replicas=2, timeout=420)
        new_pod = next(
            p for p in kube.pods("scaler") if p["metadata"]["name"] != first["metadata"]["name"]
        )
        new_name = new_pod["metadata"]["name"]
        wait_until(
            lambda: any(s.pod == new_name for s in load.report.samples),
            60,
            "a request answered by the new pod",
        )
    samples, load_started = load.report, load.started_wall

    assert not samples.failed, samples.failed[:5]
    assert not samples.cold, samples.cold[:5]
    # The new pod took traffic only after the operator verified its warmup.
    warmed = condition(new_pod, WARMED_CONDITION)
    ready = condition(new_pod, "Ready")
    assert warmed["status"] == "True" and warmed["reason"] == REASON_VERIFIED
    assert epoch(warmed["lastTransitionTime"]) <= epoch(ready["lastTransitionTime"])
    first_served = min(s.started for s in samples.samples if s.pod == new_name) + load_started
    assert first_served >= epoch(ready["lastTransitionTime"]) - 1  # timestamps are whole seconds

    hpa = kube.get("hpa", "scaler")
    scaled_out = epoch(hpa["status"]["lastScaleTime"])
    created = epoch(new_pod["metadata"]["creationTimestamp"])
    containers_ready = epoch(condition(new_pod, "ContainersReady")["lastTransitionTime"])
    timeline = {
        "scale-out decision (HPA lastScaleTime)": scaled_out - load_started,
        "new pod created": created - load_started,
        "new pod's server warm (ContainersReady)": containers_ready - load_started,
        f"warm gate opened ({WARMED_CONDITION})": epoch(warmed["lastTransitionTime"])
        - load_started,
        "new pod Ready": epoch(ready["lastTransitionTime"]) - load_started,
        "first request served by it": first_served - load_started,
    }
    report("autoscaling timeline, seconds after the load began:")
    for what, seconds in timeline.items():
        report(f"  {seconds:6.1f}  {what}")
    ready_url = f"http://{new_pod['status']['podIP']}:{SERVER_PORT}/ready"
    with urllib.request.urlopen(ready_url) as response:
        warmup = json.load(response)["warmup_seconds"]
    report(
        f"  decision to first request served: {first_served - scaled_out:.1f}s; the new pod "
        f"started in {containers_ready - epoch(container_started(new_pod)):.0f}s, of which "
        f"warmup {warmup:.1f}s; status.startupSeconds {emb['status'].get('startupSeconds')}"
    )

    # The load is over: CPU falls, and after the stabilization window the HPA scales back in.
    ended = time.monotonic()
    wait_until(
        lambda: deployment_replicas(kube, "scaler") == 1,
        SCALE_DOWN_WINDOW + 180,
        "the HPA to scale back in",
        every=2.0,
    )
    scaled_in_after = time.monotonic() - ended
    assert scaled_in_after >= SCALE_DOWN_WINDOW
    report(f"  scaled back in {scaled_in_after:.0f}s after the load ended")


def test_load_scales_out_onto_the_standby_pod_and_a_new_one_warms_behind_it(kube, operator, report):
    """spec.standbyReplicas 1: the HPA (which sees the serving pod only) scales the
    EmbeddingService out, the operator promotes the standby pod, which serves at once, and a
    new standby pod starts, warms and passes the gate behind it."""
    kube.apply(scaler("standby-scaler", scale_down_window=600, standbyReplicas=1))
    wait_ready(kube, "standby-scaler", "v1", replicas=2)

    def roles() -> dict[str, str | None]:
        return {
            p["metadata"]["name"]: (p["metadata"].get("labels") or {}).get("warmgate.dev/role")
            for p in kube.pods("standby-scaler")
            if not p["metadata"].get("deletionTimestamp")
        }

    def pool() -> dict[str, str | None] | None:
        found = roles()
        return found if sorted(map(str, found.values())) == ["serving", "standby"] else None

    found = wait_until(pool, 60, "the pool")
    (spare,) = [name for name, role in found.items() if role != "serving"]
    hpa = wait_until(lambda: kube.get("hpa", "standby-scaler"), 30, "the HPA")
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "EmbeddingService"
    selector = kube.get("embeddingservice", "standby-scaler")["status"]["selector"]
    assert selector.endswith("warmgate.dev/role=serving")  # what the HPA averages CPU over

    with ConstantRateLoad(
        service_url(kube, "standby-scaler"), rate=RATE, networks=kube.devcluster.networks
    ) as load:
        wait_until(
            lambda: any(s.pod == spare for s in load.report.samples),
            420,
            "a request answered by the promoted standby pod",
        )
        promoted_served = min(s.started for s in load.report.samples if s.pod == spare)
        # A new standby pod warms behind it.

        def refilled() -> dict | None:
            emb = kube.get("embeddingservice", "standby-scaler") or {}
            status = emb.get("status") or {}
            counts = (status.get("servingReplicas"), status.get("standbyReplicas"))
            return emb if counts == (2, 1) and status.get("lastScaleOut") else None

        emb = wait_until(refilled, 300, "two serving pods and a new standby pod")
    samples, load_started = load.report, load.started_wall
    assert not samples.failed, samples.failed[:5]
    assert not samples.cold, samples.cold[:5]

    hpa = kube.get("hpa", "standby-scaler")
    scaled_out = epoch(hpa["status"]["lastScaleTime"])
    last = emb["status"]["lastScaleOut"]
    assert last["standbyPromoted"] is True
    timeline = {
        "scale-out decision (HPA lastScaleTime)": scaled_out - load_started,
        "standby pod serving (status.lastScaleOut.capacityAt)": parse_micro(last["capacityAt"])
        - load_started,
        "first request served by it": promoted_served,
    }
    report("autoscaling with a standby pod, seconds after the load began:")
    for what, seconds in timeline.items():
        report(f"  {seconds:6.1f}  {what}")
    report(
        f"  decision to first request served: {promoted_served + load_started - scaled_out:.1f}s"
        f" (operator: {last['seconds']}s from seeing the decision to the pod serving)"
    )
    # Whole-second HPA timestamp: the promoted pod served within 2 s of the decision.
    assert promoted_served + load_started - scaled_out <= 3.0
