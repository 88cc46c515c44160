"""A sick server leaves the rotation, and a pooled client loses nothing in a rollout: real
server containers on the devcluster's kubelet, behind a real Service (kube-proxy).

The faults are caused for real inside one pod's server (WARMGATE_FAULT_INJECTION=1 through
spec.env, then POST /debug/faults to that pod: its model's forward pass raises, as after a CUDA
fault); everything after that is kubelet, the endpoints controller and the operator reacting to
what the server reports."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from support.load import pooled_load, service_load, summary, through_service

from warmgate_devcluster.testkit import (
    condition,
    embedding_service,
    p_revision,
    wait_ready,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def pod_call(pod: dict, path: str, body: object | None = None) -> tuple[int, dict]:
    url = f"http://{pod['status']['podIP']}:8080{path}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def ready_endpoints(kube, service: str) -> set[str]:
    """The pod names the Service's EndpointSlices list as ready."""
    found = kube.get("endpointslices", selector=f"kubernetes.io/service-name={service}")
    names = set()
    for item in (found or {}).get("items", []):
        for endpoint in item.get("endpoints") or []:
            if endpoint.get("conditions", {}).get("ready"):
                names.add(endpoint.get("targetRef", {}).get("name"))
    return names


def test_a_pod_whose_model_fails_leaves_the_endpoints_and_returns_after_a_restart(
    kube, operator
) -> None:
    kube.apply(
        embedding_service(
            "sick",
            "v1",
            env=[{"name": "WARMGATE_FAULT_INJECTION", "value": "1"}],
            probes={"faultThreshold": 2, "faultRestartSeconds": 3},
        )
    )
    wait_ready(kube, "sick", "v1", replicas=2)
    sick, healthy = sorted(kube.pods("sick"), key=lambda pod: pod["metadata"]["name"])
    name = sick["metadata"]["name"]
    assert ready_endpoints(kube, "sick") == {name, healthy["metadata"]["name"]}

    with service_load(kube, "sick") as load:
        assert pod_call(sick, "/debug/faults", {"mode": "raise"})[0] == 200
        # Its next forward passes fail (the load's and these); the server reports it.
        for _ in range(2):
            status, body = pod_call(sick, "/v1/embeddings", {"input": "hello"})
            assert status == 503 and body["error"]["code"] == "model_fault", body
        wait_until(lambda: name not in ready_endpoints(kube, "sick"), 30, "out of the endpoints")
        left_at = load.elapsed()
        status, report = pod_call(sick, "/ready")
        assert status == 503 and report["phase"] == "unhealthy", report

        def restarted_and_back() -> bool:
            pod = kube.get("pod", name)
            restarts = pod["status"]["containerStatuses"][0]["restartCount"]
            warmed = condition(pod, "warmgate.dev/warmed")
            return (
                restarts >= 1
                and warmed.get("status") == "True"
                and name in ready_endpoints(kube, "sick")
            )

        # /healthz fails after 3 s of faults; kubelet restarts the container after three
        # failed liveness probes; the new process warms and the gate lets it in again.
        wait_until(restarted_and_back, 300, "restarted, verified and back in the endpoints")
        back = kube.get("pod", name)
        status, _ = pod_call(back, "/v1/embeddings", {"input": "hello"})
        assert status == 200  # a fresh process: the fault went with the old one
        wait_until(
            lambda: any(s.pod == name and s.ok for s in load.report.samples[-40:]),
            60,
            "the Service sending to the restarted pod again",
        )
    samples = load.report.samples
    # While the pod was sick and still listed, some requests it got failed (503, from it
    # alone); once it had left the endpoints (and kube-proxy had synced) none did.
    assert all(s.pod == name and s.status == 503 for s in load.report.failed), summary(
        load.report.failed
    )
    late = [s for s in samples if s.started > left_at + 2.0]
    assert late and all(s.ok for s in late), summary([s for s in late if not s.ok])
    # kubelet restarted it because /healthz said so. Its Normal "Killing" event says why; the
    # Warning "Unhealthy" ones cannot be relied on: kubelet's recorder lets 25 Warning events
    # through per pod, then one per 5 minutes (client-go's spam filter), and the startup and
    # readiness probes' failures (one a second here) can spend that budget first.
    its_events = [e for e in kube.events() if e.get("involvedObject", {}).get("name") == name]
    assert any(
        event.get("reason") == "Killing"
        and "failed liveness probe, will be restarted" in event.get("message", "")
        for event in its_events
    ), [(event.get("reason"), event.get("message")) for event in its_events]


def test_a_rollout_loses_no_request_of_a_pooled_openai_client_with_retries_off(
    kube, operator
) -> None:
    """The OpenAI SDK at its defaults (one httpx pool, keep-alive) but max_retries=0, two
    threads sending through the Service's node port while every pod is replaced: each old pod
    tells the client to reconnect (Connection: close) instead of vanishing under it."""
    kube.apply(embedding_service("pooled", "v1"))
    wait_ready(kube, "pooled", "v1", replicas=2)
    with pooled_load(through_service(kube, "pooled")) as load:
        wait_until(lambda: len(load.answers) >= 20, 60, "20 answers")
        kube.patch("embeddingservice", "pooled", {"spec": {"model": {"revision": "v2"}}})
        wait_ready(kube, "pooled", "v2", replicas=2, timeout=400)
        # The old pods keep their pinned connections until their drain tells the client to
        # go: wait for them to be gone, then for answers from the new ones only.
        wait_until(
            lambda: {p_revision(pod) for pod in kube.pods("pooled")} == {"v2"},
            120,
            "the old pods gone",
        )
        count = len(load.answers)
        wait_until(lambda: len(load.answers) >= count + 20, 60, "20 more answers")

    assert not load.errors, load.errors[:5]
    revisions = [answer.revision for answer in load.answers]
    assert revisions[0] == "v1" and set(revisions[-10:]) == {"v2"}
    # The old pods' drains told the pooled connections to go (at least one per old pod).
    assert sum(1 for answer in load.answers if answer.connection == "close") >= 1
