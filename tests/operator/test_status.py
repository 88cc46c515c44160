"""The status reducer: what `kubectl get emb` and `kubectl wait` see."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from warmgate_contract.report import ReadyReport, WarmedShape
from warmgate_operator import gate
from warmgate_operator.builders import Owner, build_pod_template
from warmgate_operator.gate import expectation_for, identity_verdict
from warmgate_operator.gatekeeper import GateConfig, Gatekeeper
from warmgate_operator.metrics import Metrics
from warmgate_operator.spec import parse_spec
from warmgate_operator.status import Problem, compute_status

from .test_gate import judged, patched

SPEC = parse_spec({"model": {"id": "m", "revision": "r1"}, "replicas": 2})
T0, T1 = "2026-11-29T22:00:00Z", "2026-11-29T22:05:00Z"


def es(generation: int = 1, status: dict | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "metadata": {"name": "minilm", "namespace": "default", "generation": generation}
    }
    if status is not None:
        body["status"] = status
    return body


def deployment(
    replicas: int = 2,
    ready: int = 2,
    updated: int = 2,
    available: int | None = None,
    observed: int = 3,
    generation: int = 3,
    conditions: list[dict] | None = None,
    spec_replicas: int | None = 2,
) -> dict[str, Any]:
    spec = {} if spec_replicas is None else {"replicas": spec_replicas}
    return {
        "metadata": {"generation": generation},
        "spec": spec,
        "status": {
            "observedGeneration": observed,
            "replicas": replicas,
            "readyReplicas": ready,
            "updatedReplicas": updated,
            "availableReplicas": ready if available is None else available,
            "conditions": conditions or [],
        },
    }


def pod(name: str, ready: bool = True, warmed: bool = True, revision: str = "r1", **extra: Any):
    conditions = [
        {"type": "Ready", "status": str(ready)},
        {"type": "warmgate.dev/warmed", "status": str(warmed)},
    ]
    body = {
        "metadata": {
            "name": name,
            "annotations": {"warmgate.dev/model-id": "m", "warmgate.dev/model-revision": revision},
        },
        "status": {"conditions": conditions, **extra},
    }
    return body


def conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


def test_all_ready_and_warmed() -> None:
    status = compute_status(SPEC, es(), deployment(), [pod("a"), pod("b")], T0)
    assert status["observedGeneration"] == 1
    assert status["replicas"] == 2
    assert status["readyReplicas"] == 2
    assert status["warmedReplicas"] == 2
    assert status["readySummary"] == "2/2"
    assert (
        status["selector"]
        == "app.kubernetes.io/instance=minilm,app.kubernetes.io/name=warmgate-server"
    )
    assert status["model"] == {"id": "m", "revision": "r1"}
    c = conditions(status)
    assert (c["Ready"]["status"], c["Ready"]["reason"]) == ("True", "AllReplicasReady")
    assert (c["Progressing"]["status"], c["Progressing"]["reason"]) == ("False", "RolloutComplete")
    assert (c["Warmed"]["status"], c["Warmed"]["reason"]) == ("True", "AllReplicasWarmed")
    assert (c["Degraded"]["status"], c["Degraded"]["reason"]) == ("False", "AsExpected")
    assert all(cond["lastTransitionTime"] == T0 for cond in status["conditions"])
    assert all(cond["observedGeneration"] == 1 for cond in status["conditions"])
    assert [cond["type"] for cond in status["conditions"]] == [
        "Ready",
        "Progressing",
        "Warmed",
        "Degraded",
        "Conflict",
        "MemoryPressure",
    ]


def test_same_observation_gives_an_equal_status_so_nothing_is_written() -> None:
    first = compute_status(SPEC, es(), deployment(), [pod("a"), pod("b")], T0)
    second = compute_status(SPEC, es(status=first), deployment(), [pod("a"), pod("b")], T1)
    assert second == first


def test_transition_time_moves_only_for_the_condition_that_changed() -> None:
    first = compute_status(SPEC, es(), deployment(), [pod("a"), pod("b")], T0)
    second = compute_status(
        SPEC,
        es(status=first),
        deployment(ready=1, available=1),
        [pod("a"), pod("b", ready=False, warmed=False)],
        T1,
    )
    c = conditions(second)
    assert c["Ready"]["status"] == "False"
    assert c["Ready"]["lastTransitionTime"] == T1
    assert c["Warmed"]["lastTransitionTime"] == T1
    assert c["Degraded"]["lastTransitionTime"] == T0  # still False


def test_new_pods_waiting_for_warmup() -> None:
    status = compute_status(
        SPEC,
        es(),
        deployment(replicas=2, ready=0, updated=2),
        [pod("a", ready=False, warmed=False), pod("b", ready=False, warmed=False)],
        T0,
    )
    c = conditions(status)
    assert status["readySummary"] == "0/2"
    assert (c["Ready"]["status"], c["Ready"]["reason"]) == ("False", "WaitingForWarmup")
    assert (c["Warmed"]["status"], c["Warmed"]["reason"]) == ("False", "WaitingForWarmup")
    assert c["Progressing"]["status"] == "True"


def test_rollout_in_progress_keeps_old_pods_serving() -> None:
    status = compute_status(
        SPEC,
        es(generation=2),
        deployment(replicas=3, ready=2, updated=1),
        [pod("old-a"), pod("old-b"), pod("new", ready=False, warmed=False, revision="r2")],
        T0,
    )
    c = conditions(status)
    assert (c["Progressing"]["status"], c["Progressing"]["reason"]) == ("True", "RolloutInProgress")
    assert c["Ready"]["status"] == "False"
    assert status["model"] == {"id": "m", "revision": "r1"}


def test_progress_deadline_is_degraded() -> None:
    stalled = {
        "type": "Progressing",
        "status": "False",
        "reason": "ProgressDeadlineExceeded",
        "message": 'ReplicaSet "minilm-abc" has timed out progressing.',
    }
    status = compute_status(
        SPEC,
        es(),
        deployment(replicas=3, ready=2, updated=1, conditions=[stalled]),
        [pod("a"), pod("b"), pod("c", ready=False, warmed=False)],
        T0,
    )
    c = conditions(status)
    assert (c["Degraded"]["status"], c["Degraded"]["reason"]) == (
        "True",
        "ProgressDeadlineExceeded",
    )
    assert (c["Progressing"]["status"], c["Progressing"]["reason"]) == (
        "False",
        "ProgressDeadlineExceeded",
    )
    assert c["Ready"]["reason"] == "ProgressDeadlineExceeded"


@pytest.mark.parametrize(
    "reason", ["CrashLoopBackOff", "ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull"]
)
def test_a_failing_pod_is_degraded_with_the_pod_named(reason: str) -> None:
    """Waiting reasons that do not fix themselves, ErrImageNeverPull included (pull policy
    Never and the image missing from the node, as in a local cluster)."""
    crashing = pod(
        "c",
        ready=False,
        warmed=False,
        containerStatuses=[
            {
                "name": "server",
                "state": {"waiting": {"reason": reason, "message": "back-off 10s"}},
            }
        ],
    )
    status = compute_status(SPEC, es(), deployment(ready=1), [pod("a"), crashing], T0)
    c = conditions(status)
    assert (c["Degraded"]["status"], c["Degraded"]["reason"]) == ("True", "PodsFailing")
    assert "pod c" in c["Degraded"]["message"]
    assert reason in c["Degraded"]["message"]


def test_terminating_pods_do_not_count_as_warmed() -> None:
    leaving = pod("old")
    leaving["metadata"]["deletionTimestamp"] = T0
    status = compute_status(SPEC, es(), deployment(), [pod("a"), pod("b"), leaving], T0)
    assert status["warmedReplicas"] == 2


def test_no_deployment_yet() -> None:
    status = compute_status(SPEC, es(), None, [], T0)
    c = conditions(status)
    assert (c["Ready"]["status"], c["Ready"]["reason"]) == ("False", "Creating")
    assert status["replicas"] == 0
    assert status["readySummary"] == "0/2"


def test_hpa_choice_is_the_desired_count() -> None:
    spec = parse_spec({"model": {"id": "m"}, "autoscaling": {"enabled": True, "minReplicas": 2}})
    status = compute_status(
        spec, es(), deployment(replicas=3, ready=3, updated=3, spec_replicas=3), [], T0
    )
    assert status["desiredReplicas"] == 3
    assert status["readySummary"] == "3/3"


def test_warm_gate_off_reports_unknown_warmth() -> None:
    spec = parse_spec({"model": {"id": "m"}, "replicas": 2, "rollout": {"warmGate": False}})
    status = compute_status(spec, es(), deployment(), [pod("a", warmed=False)], T0)
    c = conditions(status)
    assert (c["Warmed"]["status"], c["Warmed"]["reason"]) == ("Unknown", "WarmGateDisabled")
    assert c["Ready"]["status"] == "True"


def test_blocking_problem_makes_ready_false() -> None:
    problem = Problem("InvalidSpec", "spec.model.id is required", blocking=True)
    status = compute_status(None, es(), None, [], T0, problem)
    c = conditions(status)
    assert (c["Ready"]["status"], c["Ready"]["reason"]) == ("False", "InvalidSpec")
    assert (c["Degraded"]["status"], c["Degraded"]["reason"]) == ("True", "InvalidSpec")


def test_scaled_to_zero_is_ready() -> None:
    spec = parse_spec({"model": {"id": "m"}, "replicas": 0})
    status = compute_status(
        spec, es(), deployment(replicas=0, ready=0, updated=0, spec_replicas=0), [], T0
    )
    assert conditions(status)["Ready"]["reason"] == "ScaledToZero"


ASLEEP = "scaled to zero after 300 s without requests; a request through warmgate-router ..."


def test_idle_at_zero_is_not_ready_and_claims_no_failure() -> None:
    """A replicas-0 service a person scaled is Ready (above); one that scale to zero put there
    is not (a request must wake it), and what its last pods did no longer matters: a rollout
    that had run out of time, a pod that could not pull its image."""
    spec = parse_spec(
        {
            "model": {"id": "m"},
            "replicas": 0,
            "autoscaling": {"enabled": True, "minReplicas": 0, "scaleToZero": {}},
        }
    )
    stalled = {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded"}
    stopping = pod("a", ready=False, warmed=False)
    stopping["status"]["containerStatuses"] = [
        {"name": "server", "state": {"waiting": {"reason": "ImagePullBackOff"}}}
    ]
    going = deployment(replicas=1, ready=0, updated=1, spec_replicas=0, conditions=[stalled])
    status = compute_status(spec, es(), going, [stopping], T0, asleep=ASLEEP)
    c = conditions(status)
    assert (c["Ready"]["status"], c["Ready"]["reason"], c["Ready"]["message"]) == (
        "False",
        "ScaledToZero",
        ASLEEP,
    )
    assert (c["Degraded"]["status"], c["Degraded"]["reason"]) == ("False", "ScaledToZero")
    assert (c["Progressing"]["status"], c["Progressing"]["reason"]) == ("True", "ScalingToZero")
    gone = deployment(replicas=0, ready=0, updated=0, spec_replicas=0)
    c = conditions(compute_status(spec, es(), gone, [], T0, asleep=ASLEEP))
    assert (c["Progressing"]["status"], c["Progressing"]["reason"]) == ("False", "ScaledToZero")
    assert c["Ready"]["reason"] == "ScaledToZero" and c["Degraded"]["status"] == "False"
    assert (c["Warmed"]["status"], c["Warmed"]["reason"]) == ("True", "ScaledToZero")
    # A problem of the spec itself still shows.
    problem = Problem("InvalidSpec", "bad", blocking=True)
    c = conditions(compute_status(spec, es(), gone, [], T0, problem, asleep=ASLEEP))
    assert c["Ready"]["reason"] == c["Degraded"]["reason"] == "InvalidSpec"


def test_fields_written_by_others_are_carried_over() -> None:
    shapes = [{"batch_size": 8, "seq_len": 64, "count": 10}]
    status = compute_status(SPEC, es(status={"observedShapes": shapes}), deployment(), [], T0)
    assert status["observedShapes"] == shapes


@given(
    desired=st.integers(0, 5),
    replicas=st.integers(0, 6),
    ready=st.integers(0, 6),
    updated=st.integers(0, 6),
    warmed=st.lists(st.booleans(), max_size=6),
    gate=st.booleans(),
)
def test_recomputing_from_its_own_output_is_stable(
    desired: int, replicas: int, ready: int, updated: int, warmed: list[bool], gate: bool
) -> None:
    spec = parse_spec({"model": {"id": "m"}, "replicas": desired, "rollout": {"warmGate": gate}})
    dep = deployment(replicas=replicas, ready=ready, updated=updated, spec_replicas=desired)
    pods = [pod(f"p{i}", ready=w, warmed=w) for i, w in enumerate(warmed)]
    first = compute_status(spec, es(), dep, pods, T0)
    assert compute_status(spec, es(status=first), dep, pods, T1) == first
    assert {c["type"] for c in first["conditions"]} == {
        "Ready",
        "Progressing",
        "Warmed",
        "Degraded",
        "Conflict",
        "MemoryPressure",
    }
    assert first["readySummary"] == f"{ready}/{desired}"


def test_an_event_is_due_only_when_degraded_turns_true_or_changes_reason():
    from warmgate_operator.status import newly_degraded

    def status(state, reason):
        return {"conditions": [{"type": "Degraded", "status": state, "reason": reason}]}

    assert newly_degraded({}, status("True", "PodsFailing"))["reason"] == "PodsFailing"
    assert newly_degraded(status("False", "AsExpected"), status("True", "PodsFailing"))
    assert newly_degraded(status("True", "PodsFailing"), status("True", "PodsFailing")) is None
    changed = newly_degraded(status("True", "PodsFailing"), status("True", "WarmupFailed"))
    assert changed["reason"] == "WarmupFailed"
    assert newly_degraded(status("True", "PodsFailing"), status("False", "AsExpected")) is None


def started_pod(started: str, ready_at: str | None, restarts: int = 0) -> dict[str, Any]:
    conditions = []
    if ready_at is not None:
        conditions.append(
            {"type": "ContainersReady", "status": "True", "lastTransitionTime": ready_at}
        )
    return {
        "metadata": {"name": "p", "labels": {}},
        "status": {
            "conditions": conditions,
            "containerStatuses": [
                {
                    "name": "server",
                    "restartCount": restarts,
                    "state": {"running": {"startedAt": started}},
                }
            ],
        },
    }


def test_startup_seconds_is_the_slowest_current_pods_start_and_kept_meanwhile() -> None:
    pods = [
        started_pod("2026-11-29T22:00:00Z", "2026-11-29T22:00:14Z"),
        started_pod("2026-11-29T22:01:00Z", "2026-11-29T22:01:31Z"),
        started_pod("2026-11-29T22:02:00Z", None),  # still warming: not measured yet
    ]
    status = compute_status(SPEC, es(), deployment(), pods, T0)
    assert status["startupSeconds"] == 31
    # No pod has finished starting (a rollout just replaced them all): the last value stays.
    later = compute_status(SPEC, es(status=status), deployment(), pods[2:], T1)
    assert later["startupSeconds"] == 31


# ------------------------------------------------ status.model: the files that serve, gate or not
COMMIT, DIGEST = "c0ffee1234", "sha256:" + "ab" * 32


def server_pod(spec: Any, name: str, uid: str) -> dict[str, Any]:
    """A running pod of the operator's own template, its server container ready."""
    template = build_pod_template(spec, Owner("minilm", "default", "uid-es"), "img")
    return {
        "metadata": {
            **copy.deepcopy(template["metadata"]),
            "name": name,
            "namespace": "default",
            "uid": uid,
            "resourceVersion": "1",
        },
        "spec": copy.deepcopy(template["spec"]),
        "status": {
            "podIP": "10.0.0.5",
            "conditions": [{"type": "ContainersReady", "status": "True"}],
            "containerStatuses": [
                {
                    "name": "server",
                    "ready": True,
                    "restartCount": 0,
                    "state": {"running": {"startedAt": T0}},
                }
            ],
        },
    }


def served_report(pod: dict[str, Any]) -> dict[str, Any]:
    """`/ready` as the pod's server writes it: warm, with the commit and weights it loaded."""
    expected = expectation_for(pod)
    shapes = tuple(sorted(expected.required_shapes))
    return ReadyReport(
        phase="ready",
        model_id=expected.model_id,
        revision=expected.revision,
        served_name="minilm",
        device="cpu",
        dtype="float32",
        planned=shapes,
        warmed=tuple(WarmedShape(shape, 2.0, 3) for shape in shapes),
        warmup_seconds=3.0,
        commit=COMMIT,
        weights_digest=DIGEST,
    ).to_json()


class PodAnswers:
    """Each pod's `/ready` (all pods here answer alike) and the status patches written."""

    def __init__(self, report: dict[str, Any]) -> None:
        self.report_body, self.patches = report, []

    async def get_json(self, host: str, port: int, path: str) -> tuple[int, Any]:
        return 200, self.report_body

    async def patch_status(self, namespace: str, name: str, body: dict[str, Any]) -> None:
        self.patches.append(body)


async def through_the_gatekeeper(pod: dict[str, Any]) -> dict[str, Any]:
    """The pod after the gatekeeper's writes, Ready as kubelet then makes it."""
    answers = PodAnswers(served_report(pod))

    async def no_events(*_: Any) -> None:
        return None

    keeper = Gatekeeper(
        answers,
        answers,  # type: ignore[arg-type]
        no_events,
        Metrics(),
        GateConfig(backoff_max_seconds=0.05),
    )
    keeper.observe("ADDED", pod)
    for _ in range(200):
        if answers.patches:
            break
        await asyncio.sleep(0.01)
    await keeper.close()
    for body in answers.patches:
        pod = patched(pod, body)
    pod["status"]["conditions"].append({"type": "Ready", "status": "True"})
    return pod


@pytest.mark.parametrize("warm_gate", [True, False])
async def test_status_model_names_the_commit_and_weights_that_serve(warm_gate: bool) -> None:
    """With the gate on, the gatekeeper verifies each pod and its warmed condition records what
    the server loaded; with it off, the pod is not verified but what it loaded is still
    recorded (warmgate.dev/loaded). Either way status.model says which files answer."""
    spec = parse_spec(
        {"model": {"id": "m", "revision": "r1"}, "replicas": 2, "rollout": {"warmGate": warm_gate}}
    )
    pods = [
        await through_the_gatekeeper(server_pod(spec, f"minilm-{i}", f"uid-{i}")) for i in (1, 2)
    ]
    status = compute_status(spec, es(), deployment(), pods, T0)
    assert status["model"] == {
        "id": "m",
        "revision": "r1",
        "commit": COMMIT,
        "weightsDigest": DIGEST,
        "task": "embed",
    }
    assert status["warmedReplicas"] == (2 if warm_gate else 0)


def test_a_record_from_before_a_restart_does_not_speak_for_the_new_process() -> None:
    """Gate off: a pod whose server restarted shows no commit until the new process's files
    are recorded (a moved branch may have brought other files)."""
    spec = parse_spec({"model": {"id": "m", "revision": "r1"}, "rollout": {"warmGate": False}})
    pod = server_pod(spec, "minilm-1", "uid-1")
    verdict = identity_verdict(served_report(pod))
    pod["status"]["conditions"].append({"type": "Ready", "status": "True"})
    pod = judged(pod, verdict, "warmgate.dev/loaded")
    dep = deployment(replicas=1, ready=1, updated=1, spec_replicas=1)
    assert compute_status(spec, es(), dep, [pod], T0)["model"]["commit"] == COMMIT
    pod["status"]["containerStatuses"][0]["restartCount"] = 1
    assert compute_status(spec, es(), dep, [pod], T0)["model"] == {"id": "m", "revision": "r1"}


# ------------------------------------------------------------------------------ memory
def test_a_pod_refused_for_memory_makes_the_service_degraded_with_that_reason() -> None:
    message = "the server's warmup failed: shape 32x256 would need about 1.40 GiB ..."
    failing = pod("p0", ready=False, warmed=False)
    failing["status"]["conditions"][1].update(reason="WarmupMemoryExceeded", message=message)
    dep = deployment(replicas=2, ready=1, updated=1)
    c = conditions(compute_status(SPEC, es(), dep, [pod("p1"), failing], T0))
    assert (c["Degraded"]["status"], c["Degraded"]["reason"]) == ("True", "WarmupMemoryExceeded")
    assert "pod p0" in c["Degraded"]["message"] and "1.40 GiB" in c["Degraded"]["message"]
    assert c["Ready"]["reason"] == "WarmupMemoryExceeded"


@pytest.mark.parametrize(
    ("peak_mib", "limit_mib", "pressure", "reason"),
    [(700, 1024, "False", "EnoughHeadroom"), (950, 1024, "True", "LowHeadroom")],
)
def test_status_memory_is_the_highest_measured_peak_and_low_headroom_is_a_warning(
    peak_mib: int, limit_mib: int, pressure: str, reason: str
) -> None:
    pods = []
    for name, peak in (("a", peak_mib - 50), ("b", peak_mib)):
        verdict = gate.Verdict(True, "WarmupVerified", "ok", memory=(peak << 20, limit_mib << 20))
        verified = judged(server_pod(SPEC, name, f"uid-{name}"), verdict)
        verified["status"]["conditions"].append({"type": "Ready", "status": "True"})
        pods.append(verified)
    status = compute_status(SPEC, es(), deployment(), pods, T0)
    assert status["memory"] == {
        "peakBytes": peak_mib << 20,
        "limitBytes": limit_mib << 20,
        "headroomBytes": (limit_mib - peak_mib) << 20,
        "headroomPercent": round(100 * (limit_mib - peak_mib) / limit_mib, 1),
    }
    memory = conditions(status)["MemoryPressure"]
    assert (memory["status"], memory["reason"]) == (pressure, reason)
    assert f"{peak_mib} MiB of a {limit_mib} MiB limit" in memory["message"]
    # Nothing measured against a limit yet: unknown, not fine.
    unknown = conditions(compute_status(SPEC, es(), deployment(), [pod("x")], T0))
    assert unknown["MemoryPressure"]["status"] == "Unknown"
