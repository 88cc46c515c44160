"""Autoscaling end to end on the real node: load through the Service raises the pods' CPU
(kubelet's cgroups, read by metrics-server), the HPA the operator made scales the Deployment
out, the new pod serves only once it has passed the warm gate (no cold hit, no failed
request), and the load ending scales it back in after the CRD's scale-down stabilization
window. The test reports the timeline (in the run's summary, and in its output when it
fails): scale-out decision, new pod warm, Ready, first request served by it, beside the pod's
own warmup time."""

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


def container_started(pod: dict) -> str:
    (status,) = pod["status"]["containerStatuses"]
    return status["state"]["running"]["startedAt"]


def deployment_replicas(kube: Any, name: str) -> int:
    return int((kube.get("deployment", name) or {}).get("spec", {}).get("replicas") or 0)


def test_load_scales_out_through_the_warm_gate_and_idles_back_in(kube, operator, report):
    kube.apply(
        embedding_service(
            "scaler",
            "v1",
            # A small CPU request, so that 25 requests a second is well above the 50% target.
            resources={"requests": {"cpu": "100m", "memory": "512Mi"}},
            autoscaling={
                "enabled": True,
                "minReplicas": 1,
                "maxReplicas": 2,
                "targetCPUUtilizationPercentage": 50,
                "scaleUp": {"stabilizationWindowSeconds": 0},
                "scaleDown": {"stabilizationWindowSeconds": SCALE_DOWN_WINDOW},
            },
        )
    )
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
