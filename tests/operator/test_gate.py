"""The warm gate's judgement (pure): what opens the gate and what keeps it shut."""

from __future__ import annotations

import copy
import json

import pytest

from warmgate_contract import names
from warmgate_operator import gate

ARGS = [
    "--model",
    "sentence-transformers/all-MiniLM-L6-v2",
    "--model-revision",
    "v2",
    "--warmup-batch-sizes",
    "1,8,32",
    "--sequence-buckets",
    "32,64,128,256",
    "--max-batch-tokens=4096",
    "--max-batch-size",
    "32",
    "--warmup",
]


def make_pod(
    args=None, env=None, conditions=None, ready=True, restarts=0, started="2026-11-29T10:00:00Z"
):
    return {
        "metadata": {"name": "minilm-abc", "namespace": "ns", "uid": "u1", "resourceVersion": "7"},
        "spec": {
            "readinessGates": [{"conditionType": names.WARMED_CONDITION}],
            "containers": [
                {
                    "name": "server",
                    "args": list(ARGS if args is None else args),
                    "env": env or [],
                    "ports": [{"name": "http", "containerPort": 8080}],
                }
            ],
        },
        "status": {
            "podIP": "127.0.1.5",
            "conditions": conditions or [],
            "containerStatuses": [
                {
                    "name": "server",
                    "ready": ready,
                    "restartCount": restarts,
                    "state": {"running": {"startedAt": started}},
                }
            ],
        },
    }


def shapes(pairs, steady=2.0):
    return [{"batch_size": b, "seq_len": s, "steady_ms": steady, "runs": 3} for b, s in pairs]


EXPECTED_GRID = {(b, s) for b in (1, 8, 32) for s in (32, 64, 128, 256) if b * s <= 4096}


def make_report(**overrides):
    report = {
        "phase": "ready",
        "ready": True,
        "model": {"id": "sentence-transformers/all-MiniLM-L6-v2", "revision": "v2"},
        "device": "cpu",
        "dtype": "float32",
        "planned_shapes": [{"batch_size": b, "seq_len": s} for b, s in sorted(EXPECTED_GRID)],
        "warmed_shapes": shapes(sorted(EXPECTED_GRID)),
        "progress": {"done": len(EXPECTED_GRID), "total": len(EXPECTED_GRID)},
        "warmup_seconds": 4.2,
        "error": None,
    }
    report.update(overrides)
    return report


def test_expectation_is_read_from_the_pods_own_flags():
    expected = gate.expectation_for(make_pod())
    assert expected.model_id == "sentence-transformers/all-MiniLM-L6-v2"
    assert expected.revision == "v2"
    assert expected.port == 8080
    # 32 x 256 = 8192 tokens is over the 4096 budget, so the server never runs it.
    assert (32, 256) not in expected.required_shapes
    assert expected.required_shapes == EXPECTED_GRID


def test_flags_win_over_environment_twins():
    env = [
        {"name": "WARMGATE_MODEL_REVISION", "value": "from-env"},
        {"name": "WARMGATE_PORT", "value": "9000"},
    ]
    expected = gate.expectation_for(make_pod(env=env))
    assert expected.revision == "v2"
    assert expected.port == 9000


def test_a_complete_report_opens_the_gate():
    verdict = gate.evaluate_report(make_report(), gate.expectation_for(make_pod()))
    assert verdict.passed
    assert verdict.reason == names.REASON_VERIFIED
    assert "4.2s" in verdict.message
    assert verdict.probe_shape == (1, 32)


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"phase": "warming", "progress": {"done": 3, "total": 11}}, names.REASON_NOT_READY),
        ({"phase": "failed", "error": "CUDA out of memory"}, names.REASON_FAILED),
        ({"model": {"id": "other/model", "revision": "v2"}}, names.REASON_MODEL_MISMATCH),
        (
            {"model": {"id": "sentence-transformers/all-MiniLM-L6-v2", "revision": "v1"}},
            names.REASON_REVISION_MISMATCH,
        ),
        ({"warmed_shapes": shapes([(1, 32)])}, names.REASON_SHAPES_MISSING),
        ({"planned_shapes": "lots"}, names.REASON_BAD_REPORT),
    ],
)
def test_reports_that_keep_the_gate_shut(overrides, reason):
    verdict = gate.evaluate_report(make_report(**overrides), gate.expectation_for(make_pod()))
    assert not verdict.passed
    assert verdict.reason == reason
    assert verdict.message


def test_the_report_cannot_shrink_the_plan_the_pod_asked_for():
    # A server that plans (and warms) fewer shapes than its flags require is not let through.
    few = [(1, 32), (8, 32)]
    report = make_report(
        planned_shapes=[{"batch_size": b, "seq_len": s} for b, s in few],
        warmed_shapes=shapes(few),
    )
    verdict = gate.evaluate_report(report, gate.expectation_for(make_pod()))
    assert verdict.reason == names.REASON_SHAPES_MISSING
    assert "not warmed" in verdict.message


def test_observed_profile_shapes_must_be_warm_too():
    report = make_report()
    report["planned_shapes"].append({"batch_size": 4, "seq_len": 64})
    verdict = gate.evaluate_report(report, gate.expectation_for(make_pod()))
    assert verdict.reason == names.REASON_SHAPES_MISSING
    assert "4x64" in verdict.message


def test_not_json_object_is_an_invalid_report():
    verdict = gate.evaluate_report(["ready"], gate.expectation_for(make_pod()))
    assert verdict.reason == names.REASON_BAD_REPORT


def judged(pod, verdict, condition_type=names.WARMED_CONDITION, now="2026-11-29T10:00:05Z"):
    """The pod as the API has it once the gatekeeper wrote `verdict` (its condition and the
    state it judged), conditions merged by type as a strategic merge patch does."""
    existing = gate.condition(pod, condition_type)
    body = gate.status_patch(
        gate.desired_condition(verdict, existing, now, condition_type),
        gate.desired_state(pod, verdict),
        pod["metadata"].get("resourceVersion"),
    )
    return patched(pod, body)


def patched(pod, body):
    merged = copy.deepcopy(pod)
    annotations = merged["metadata"].setdefault("annotations", {})
    annotations.update(body.get("metadata", {}).get("annotations", {}))
    by_type = {c["type"]: c for c in merged["status"]["conditions"]}
    by_type.update({c["type"]: c for c in body["status"]["conditions"]})
    merged["status"]["conditions"] = list(by_type.values())
    return merged


def test_condition_keeps_transition_time_when_status_stays():
    pod = make_pod()
    verdict = gate.evaluate_report(make_report(), gate.expectation_for(pod))
    first = gate.desired_condition(verdict, None, "2026-11-29T10:00:05Z")
    verified = judged(pod, verdict)
    again = gate.desired_condition(verdict, first, "2026-11-29T10:09:00Z")
    assert again["lastTransitionTime"] == "2026-11-29T10:00:05Z"
    state = gate.desired_state(verified, verdict)
    assert not gate.needs_write(verified, first, again, state)
    shut = gate.desired_condition(
        gate.Verdict(False, names.REASON_RESTARTED, "restarted"), first, "2026-11-29T10:10:00Z"
    )
    assert shut["lastTransitionTime"] == "2026-11-29T10:10:00Z"
    assert gate.needs_write(verified, first, shut, state)
    # The same verdict for another process (a restart) is written: the state is not the same.
    restarted = copy.deepcopy(verified)
    restarted["status"]["containerStatuses"][0]["restartCount"] = 1
    assert gate.needs_write(restarted, first, again, gate.desired_state(restarted, verdict))


def test_status_patch_touches_only_our_condition_and_state_and_guards_the_version():
    verdict = gate.Verdict(True, names.REASON_VERIFIED, "ok", identity=("c0ffee", "sha256:ab"))
    desired = gate.desired_condition(verdict, None, "2026-11-29T10:00:05Z")
    body = gate.status_patch(desired, gate.desired_state(make_pod(restarts=2), verdict), "42")
    assert body["metadata"]["resourceVersion"] == "42"
    (annotation,) = body["metadata"]["annotations"].items()
    assert annotation[0] == names.GATE_STATE_ANNOTATION
    assert json.loads(annotation[1]) == {
        "uid": "u1",
        "restarts": 2,
        "commit": "c0ffee",
        "weightsDigest": "sha256:ab",
        "memoryPeakBytes": None,
        "memoryLimitBytes": None,
        "task": "embed",
    }
    assert [c["type"] for c in body["status"]["conditions"]] == [names.WARMED_CONDITION]
    assert desired["message"] == "ok"  # for people: no machine state in it


def verified_pod(restarts_then, restarts_now, started):
    pod = make_pod(restarts=restarts_then)
    verified = judged(pod, gate.Verdict(True, names.REASON_VERIFIED, "ok"))
    verified["status"]["containerStatuses"][0]["restartCount"] = restarts_now
    verified["status"]["containerStatuses"][0]["state"]["running"]["startedAt"] = started
    return verified


def test_a_container_restart_after_verification_resets_the_gate():
    assert not gate.restarted_since_verified(verified_pod(0, 0, "2026-11-29T10:00:00Z"))
    assert gate.restarted_since_verified(verified_pod(0, 1, "2026-11-29T10:00:00Z"))
    assert gate.restarted_since_verified(verified_pod(0, 0, "2026-11-29T10:05:00Z"))
    assert gate.restarted_since_verified(verified_pod(1, 11, "2026-11-29T10:00:00Z"))


def test_a_state_written_for_another_pod_or_unreadable_is_no_state():
    pod = verified_pod(0, 0, "2026-11-29T10:00:00Z")
    assert gate.GateState.of(pod) == gate.GateState("u1", 0)
    copied = copy.deepcopy(pod)
    copied["metadata"]["uid"] = "u2"
    assert gate.GateState.of(copied) is None
    for garbage in ("not json", "[]", '{"uid": "u1"}', '{"uid": "u1", "restarts": "x"}'):
        pod["metadata"]["annotations"][names.GATE_STATE_ANNOTATION] = garbage
        assert gate.GateState.of(pod) is None
    # A pod verified before the state existed is not taken for restarted: its report decides.
    assert not gate.restarted_since_verified(pod)


def test_pods_without_the_gate_or_without_a_server_are_ignored():
    pod = make_pod()
    pod["spec"]["readinessGates"] = []
    assert not gate.has_gate(pod)
    assert gate.expectation_for(make_pod(args=["--port", "8080"])) is None


def test_verification_allows_round_trip_slack_but_not_a_cold_request():
    assert gate.verification_passes(measured_ms=25.0, steady_ms=5.0, factor=3.0, slack_ms=20.0)
    assert not gate.verification_passes(measured_ms=900.0, steady_ms=5.0, factor=3.0, slack_ms=20.0)


def test_evaluate_does_not_mutate_the_report():
    report = make_report()
    before = copy.deepcopy(report)
    gate.evaluate_report(report, gate.expectation_for(make_pod()))
    assert report == before


COMMIT_A, COMMIT_B = "a" * 40, "b" * 40
DIGEST_A, DIGEST_B = "sha256:" + "1" * 64, "sha256:" + "2" * 64


def loaded(commit, digest):
    model = {"id": "sentence-transformers/all-MiniLM-L6-v2", "revision": "v2"}
    return make_report(model={**model, "commit": commit, "weights_digest": digest})


def test_the_files_a_pod_loaded_are_recorded_in_its_state_and_read_back():
    expected = gate.expectation_for(make_pod())
    for commit in (COMMIT_A, None):  # a hub commit, or a plain folder
        verdict = gate.evaluate_report(loaded(commit, DIGEST_A), expected)
        assert verdict.passed and verdict.identity == (commit, DIGEST_A)
        # What the gatekeeper writes after a timed verification request.
        verdict = gate.Verdict(
            True,
            verdict.reason,
            verdict.message + "; verification 3.0 ms",
            identity=(commit, DIGEST_A),
        )
        assert gate.loaded_identity(judged(make_pod(restarts=2), verdict)) == (commit, DIGEST_A)
    # A pod not verified has recorded nothing.
    shut = gate.Verdict(False, names.REASON_NOT_READY, "loaded commit=x weights=sha256:1")
    assert gate.loaded_identity(judged(make_pod(), shut)) is None


def test_what_a_pod_s_server_does_is_recorded_with_its_files_and_read_back():
    """The task `kubectl get emb` shows: the report's model_settings.task, an embedder's other
    outputs joined on (bge-m3's sparse and colbert); recorded only with the files loaded."""
    expected = gate.expectation_for(make_pod())
    model = {"id": "sentence-transformers/all-MiniLM-L6-v2", "revision": "v2"}
    cases = (
        ({"task": "embed", "outputs": ["dense"]}, "embed"),
        ({"task": "embed", "outputs": ["dense", "sparse", "colbert"]}, "embed+sparse+colbert"),
        ({"task": "rerank", "outputs": ["dense"]}, "rerank"),
        ({"task": "embed", "outputs": ["sparse"]}, "sparse"),  # SPLADE
        (None, "embed"),  # a server from before the report said
    )
    for settings, shown in cases:
        report = make_report(
            model={**model, "commit": COMMIT_A, "weights_digest": DIGEST_A},
            model_settings=settings,
        )
        verdict = gate.evaluate_report(report, expected)
        assert verdict.passed and verdict.serves == shown
        state = gate.loaded_state(judged(make_pod(), verdict))
        assert state is not None and state.task == shown
    unloaded = gate.evaluate_report(make_report(), expected)  # no files named: nothing kept
    state = gate.loaded_state(judged(make_pod(), unloaded))
    assert state is not None and state.task is None


def test_a_pod_that_loaded_other_files_than_its_template_siblings_stays_out():
    expected = gate.expectation_for(make_pod())
    same = gate.evaluate_report(loaded(COMMIT_A, DIGEST_A), expected)
    assert gate.check_same_files(same, (COMMIT_A, DIGEST_A), "minilm-1").passed
    # The same revision name, other weights (a moved branch): refused for good, and told why.
    for commit, digest in ((COMMIT_B, DIGEST_B), (COMMIT_A, DIGEST_B)):
        other = gate.evaluate_report(loaded(commit, digest), expected)
        verdict = gate.check_same_files(other, (COMMIT_A, DIGEST_A), "minilm-1")
        assert not verdict.passed and not verdict.retryable
        assert verdict.reason == names.REASON_MODEL_MISMATCH
        assert "minilm-1" in verdict.message and COMMIT_A in verdict.message
        assert "pin spec.model.revision to a commit" in verdict.message
    # The first pod of a template has nothing to agree with.
    assert gate.check_same_files(same, None, "").passed


def test_pods_of_one_template_are_those_of_one_replicaset():
    pod = make_pod()
    pod["metadata"]["labels"] = {"pod-template-hash": "7f9c"}
    assert gate.template_key(pod) == ("ns", "7f9c")
    assert gate.template_key(make_pod()) is None


# ------------------------------------------------------------------------------ memory
def memory_section(cut=None, peak=900 << 20, limit=1 << 30):
    return {
        "device": "cpu",
        "measure": "process resident memory",
        "limit_bytes": limit,
        "limit_source": "cgroup v1 memory.limit_in_bytes",
        "policy": "fit",
        "loaded_bytes": 600 << 20,
        "peak_bytes": peak,
        "shapes": [],
        "cut": cut,
    }


def test_a_plan_cut_to_fit_in_memory_passes_only_when_the_pod_asked_for_fit():
    """With fit, the server leaves out what does not fit in its memory and its batcher never
    forms it: the gate lets the pod in without those shapes, and says so. A pod that did not
    ask for fit must still warm its whole plan."""
    big = [(b, s) for b, s in EXPECTED_GRID if b * s > 1024]
    kept = sorted(EXPECTED_GRID - set(big))
    cut = {
        "max_batch_tokens": 1024,
        "shapes": [{"batch_size": b, "seq_len": s} for b, s in big],
        "reason": "shape 8x256 would need about 1.4 GiB...",
    }
    report = make_report(
        planned_shapes=[{"batch_size": b, "seq_len": s} for b, s in kept],
        warmed_shapes=shapes(kept),
        memory=memory_section(cut),
    )
    fitting = make_pod(args=[*ARGS, "--memory-policy=fit"])
    verdict = gate.evaluate_report(report, gate.expectation_for(fitting))
    assert verdict.passed and f"{len(big)} shapes cut to fit in memory" in verdict.message
    assert verdict.memory == (900 << 20, 1 << 30)
    refusing = gate.evaluate_report(report, gate.expectation_for(make_pod()))
    assert refusing.reason == names.REASON_SHAPES_MISSING


def test_a_warmup_refused_for_memory_is_told_apart_from_other_failures():
    failed = make_report(
        phase="failed",
        ready=False,
        error="shape 32x256 would need about 1.40 GiB ... raise resources.limits.memory",
        failure_reason=names.REASON_MEMORY_EXCEEDED,
    )
    verdict = gate.evaluate_report(failed, gate.expectation_for(make_pod()))
    assert verdict.reason == names.REASON_MEMORY_EXCEEDED and not verdict.retryable
    assert "resources.limits.memory" in verdict.message
    expected = gate.expectation_for(make_pod())
    other = gate.evaluate_report({**failed, "failure_reason": None}, expected)
    assert other.reason == names.REASON_FAILED


def test_the_measured_peak_and_limit_are_recorded_for_the_process_judged():
    verdict = gate.evaluate_report(
        make_report(memory=memory_section()), gate.expectation_for(make_pod())
    )
    pod = judged(make_pod(), verdict)
    assert gate.measured_memory(pod) == (900 << 20, 1 << 30)
    restarted = copy.deepcopy(pod)
    restarted["status"]["containerStatuses"][0]["restartCount"] = 1
    assert gate.measured_memory(restarted) is None  # another process: not measured yet


def test_the_verification_request_follows_the_server_s_task():
    """A re-ranker's or classifier's pod is timed on its own route (podclient._TIMED): its
    report's model_settings.task, an embedder's when the report names none."""
    expected = gate.expectation_for(make_pod())
    assert gate.evaluate_report(make_report(), expected).task == "embed"
    for task in ("rerank", "classify"):
        report = make_report(model_settings={"task": task, "pooling": "mean"})
        verdict = gate.evaluate_report(report, expected)
        assert verdict.passed and verdict.task == task
