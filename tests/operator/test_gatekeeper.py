"""The gatekeeper's workers (gatekeeper.py) with the pod's answers and the API scripted: which
changes close a verified gate and which do not, and that no error from the pod or the API leaves
a pod unverified without a retry. (The pod and the API are stand-ins here because each case
needs an exact failure at an exact moment; the cluster tests run the same code for real.)"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Mapping
from typing import Any

import aiohttp
import pytest

from warmgate_contract import names
from warmgate_kube.client import ApiError
from warmgate_operator import gate
from warmgate_operator.gatekeeper import GateConfig, Gatekeeper
from warmgate_operator.metrics import Metrics
from warmgate_operator.podclient import read_capped

from .test_gate import judged, make_pod, make_report, patched

FAST = GateConfig(backoff_initial_seconds=0.01, backoff_max_seconds=0.05, recheck_seconds=0.05)


class Reports:
    """Answers GET /ready with a script: each item is a report dict, or an exception."""

    def __init__(self, *answers: Any) -> None:
        self.answers = list(answers)
        self.calls = 0
        self.timed: list[str] = []
        """The task of each verification request (its route: /embed, /rerank, /predict)."""

    async def get_json(self, host: str, port: int, path: str) -> tuple[int, Any]:
        assert path == "/ready"
        self.calls += 1
        answer = self.answers[min(self.calls - 1, len(self.answers) - 1)]
        if isinstance(answer, BaseException):
            raise answer
        return (200 if answer.get("phase") == "ready" else 503), answer

    async def time_request(
        self, host: str, port: int, inputs: list[str], task: str = "embed"
    ) -> float:
        self.timed.append(task)
        return 1.0


class Writer:
    """Records status patches; the first `failures` raise the given API error."""

    def __init__(self, failures: list[Exception] | None = None) -> None:
        self.failures = list(failures or [])
        self.patches: list[dict[str, Any]] = []

    async def patch_status(self, namespace: str, name: str, body: dict[str, Any]) -> None:
        if self.failures:
            raise self.failures.pop(0)
        self.patches.append(body)

    def statuses(self) -> list[tuple[str, str]]:
        return [
            (c["status"], c["reason"])
            for body in self.patches
            for c in body["status"]["conditions"]
        ]


async def no_events(pod: Mapping[str, Any], kind: str, reason: str, message: str) -> None:
    return None


def verified_pod(restarts: int = 0, **kwargs: Any) -> dict:
    """A pod whose gate the operator opened when it had not restarted; `restarts` now."""
    pod = judged(make_pod(**kwargs), gate.Verdict(True, names.REASON_VERIFIED, "12 shapes warm"))
    pod["status"]["containerStatuses"][0]["restartCount"] = restarts
    return pod


async def until(condition, seconds: float = 2.0) -> None:
    deadline = asyncio.get_running_loop().time() + seconds
    while True:
        if condition():
            return
        assert asyncio.get_running_loop().time() < deadline, "not within the time"
        await asyncio.sleep(0.01)


async def run(keeper: Gatekeeper, pod: dict, condition, seconds: float = 2.0) -> None:
    keeper.observe("MODIFIED", pod)
    await until(condition, seconds)
    await keeper.close()


def keeper(reports: Reports, writer: Writer) -> Gatekeeper:
    return Gatekeeper(writer, reports, no_events, Metrics(), FAST)  # type: ignore[arg-type]


async def test_a_readiness_blip_of_a_verified_pod_keeps_its_gate() -> None:
    """The probe failed (a CPU-starved moment, a model fault): no restart, and the server's
    report is still the warm process's. Nothing is written, so kubelet alone puts the pod back
    as soon as its probe passes, operator or not."""
    reports, writer = Reports(make_report(phase="unhealthy")), Writer()
    gatekeeper = keeper(reports, writer)
    await run(gatekeeper, verified_pod(ready=False), lambda: reports.calls >= 3)
    assert writer.patches == []


@pytest.mark.parametrize("phase", ["loading", "warming", "failed"])
async def test_a_regressed_report_closes_the_gate(phase: str) -> None:
    report = make_report(phase=phase, error="boom" if phase == "failed" else None)
    reports, writer = Reports(report), Writer()
    await run(keeper(reports, writer), verified_pod(ready=False), lambda: writer.patches)
    assert writer.statuses()[0][0] == "False"


async def test_a_restart_closes_the_gate_and_the_new_process_is_verified() -> None:
    pod = verified_pod(restarts=1, started="2026-11-29T10:05:00Z")
    reports, writer = Reports(make_report()), Writer()
    gatekeeper = keeper(reports, writer)
    gatekeeper.observe("MODIFIED", pod)
    await until(lambda: writer.patches)
    assert writer.statuses()[0] == ("False", names.REASON_RESTARTED)
    # The pod as the API now has it: the condition False; the next look verifies it again.
    reopened = patched(pod, writer.patches[0])
    gatekeeper.observe("MODIFIED", reopened)
    await until(lambda: len(writer.patches) >= 2)
    await gatekeeper.close()
    assert writer.statuses()[1] == ("True", names.REASON_VERIFIED)
    assert gate.GateState.of(patched(reopened, writer.patches[1])) == gate.GateState("u1", 1)


async def test_a_pod_verified_before_the_state_existed_keeps_its_gate_and_gets_its_state() -> None:
    """An operator upgrade: a pod verified by the last version has no recorded state. Its
    gate is not closed (that would take every serving pod out at once); its report decides,
    and the state is written beside the condition, still True."""
    pod = verified_pod()
    del pod["metadata"]["annotations"][names.GATE_STATE_ANNOTATION]
    reports, writer = Reports(make_report()), Writer()
    await run(keeper(reports, writer), pod, lambda: writer.patches)
    assert writer.statuses() == [("True", names.REASON_VERIFIED)]
    assert gate.GateState.of(patched(pod, writer.patches[0])) == gate.GateState("u1", 0)


@pytest.mark.parametrize(
    "error",
    [
        TimeoutError(),
        aiohttp.ClientConnectionError("connection reset by peer"),
        aiohttp.ClientPayloadError("answer over 1048576 bytes"),
    ],
)
async def test_a_pod_that_does_not_answer_is_retried_until_it_does(error: Exception) -> None:
    reports, writer = Reports(error, error, make_report()), Writer()
    await run(
        keeper(reports, writer),
        make_pod(),
        lambda: any(status == "True" for status, _ in writer.statuses()),
    )
    assert reports.calls >= 3
    assert writer.statuses()[0] == ("False", names.REASON_UNREACHABLE)


@pytest.mark.parametrize(
    "failure",
    [
        ApiError(429, "TooManyRequests", "slow down"),
        ApiError(500, "InternalError", "etcd leader changed"),
        ApiError(0, "", "connection reset"),
        ApiError(409, "Conflict", "the object has been modified"),
    ],
)
async def test_an_api_error_on_the_write_is_retried(failure: ApiError) -> None:
    reports, writer = Reports(make_report()), Writer([failure, failure])
    await run(keeper(reports, writer), make_pod(), lambda: writer.patches)
    assert writer.statuses() == [("True", names.REASON_VERIFIED)]


class Api:
    """The apiserver's side of a status patch: a resourceVersion that is not the pod's current
    one is refused with 409 (optimistic concurrency), and a write answers the pod as written."""

    def __init__(self, pod: dict) -> None:
        self.pod = copy.deepcopy(pod)
        self.patches: list[dict[str, Any]] = []
        self.conflicts = 0

    async def patch_status(self, namespace: str, name: str, body: dict[str, Any]) -> dict:
        version = body["metadata"].get("resourceVersion")
        if version is not None and version != self.pod["metadata"]["resourceVersion"]:
            self.conflicts += 1
            raise ApiError(409, "Conflict", "the object has been modified")
        self.patches.append(body)
        self.pod = patched(self.pod, body)
        self.pod["metadata"]["resourceVersion"] = str(
            int(self.pod["metadata"]["resourceVersion"]) + 1
        )
        return copy.deepcopy(self.pod)


async def test_a_refused_pod_is_written_once_not_retried_with_a_stale_version() -> None:
    """A pod refused for memory stays running and never ready, and nothing else changes it:
    the watch event of the gate's own write is the only news, and the cache (which took the
    write's answer) does not pass it on. The gate writes the refusal once and keeps the pod as
    written; it wrote again every retry with the old resourceVersion, 409 each time, for as long
    as the pod lived."""
    report = make_report(
        phase="failed",
        ready=False,
        error="shape 32x256 would need about 1.37 GiB, above the budget",
        failure_reason=names.REASON_MEMORY_EXCEEDED,
    )
    pod = make_pod(ready=False)
    reports, api = Reports(report), Api(pod)
    gatekeeper = keeper(reports, api)  # type: ignore[arg-type]
    gatekeeper.observe("MODIFIED", pod)
    await until(lambda: reports.calls >= 6)  # five retries after the write
    await gatekeeper.close()
    assert [(c["status"], c["reason"]) for b in api.patches for c in b["status"]["conditions"]] == [
        ("False", names.REASON_MEMORY_EXCEEDED)
    ]
    assert api.conflicts == 0


async def test_a_deleted_pod_stops_its_worker() -> None:
    reports, writer = Reports(TimeoutError()), Writer()
    gatekeeper = keeper(reports, writer)
    pod = make_pod()
    gatekeeper.observe("MODIFIED", pod)
    await until(lambda: reports.calls >= 2)
    gatekeeper.observe("DELETED", pod)
    calls = reports.calls
    await asyncio.sleep(0.2)
    assert gatekeeper.active == 0 and reports.calls <= calls + 1
    await gatekeeper.close()


async def test_a_huge_answer_is_cut_off(aiohttp_server) -> None:
    from aiohttp import web

    async def huge(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for _ in range(64):
            await response.write(b"x" * 65536)
        return response

    app = web.Application()
    app.router.add_get("/ready", huge)
    server = await aiohttp_server(app)
    async with aiohttp.ClientSession() as session:
        async with session.get(server.make_url("/ready")) as response:
            with pytest.raises(aiohttp.ClientPayloadError):
                await read_capped(response, 1 << 20)
        async with session.get(server.make_url("/ready")) as response:
            assert len(await read_capped(response, 8 << 20)) == 64 * 65536


def test_regressed_reads_the_phase() -> None:
    assert not gate.regressed(make_report(phase="ready"))
    assert not gate.regressed(make_report(phase="unhealthy"))
    assert not gate.regressed(make_report(phase="draining"))
    assert gate.regressed(make_report(phase="warming"))
    assert gate.regressed({"not": "a report"})


# ------------------------------------------- pods without the gate: what they loaded, recorded
COMMIT, DIGEST = "c0ffee1234", "sha256:" + "ab" * 32


def ungated_pod(**kwargs: Any) -> dict:
    """An EmbeddingService's pod with spec.rollout.warmGate false: no readiness gate."""
    pod = make_pod(**kwargs)
    del pod["spec"]["readinessGates"]
    pod["metadata"]["labels"] = {names.SERVICE_LABEL: "minilm"}
    return pod


def loaded_report(commit: str = COMMIT, digest: str | None = DIGEST, **overrides: Any) -> dict:
    report = make_report(**overrides)
    report["model"] = {**report["model"], "commit": commit, "weights_digest": digest}
    return report


def with_conditions(pod: dict, *patches: dict) -> dict:
    """The pod as the API has it after the status patches."""
    for body in patches:
        pod = patched(pod, body)
    return pod


async def test_an_ungated_pod_gets_what_it_loaded_recorded_once() -> None:
    reports, writer = Reports(loaded_report()), Writer()
    gatekeeper = keeper(reports, writer)
    pod = ungated_pod()
    gatekeeper.observe("MODIFIED", pod)
    await until(lambda: writer.patches)
    (written,) = writer.patches[0]["status"]["conditions"]
    assert (written["type"], written["status"], written["reason"]) == (
        names.LOADED_CONDITION,
        "True",
        names.REASON_LOADED,
    )
    recorded = with_conditions(pod, *writer.patches)
    assert gate.loaded_identity(recorded) == (COMMIT, DIGEST)
    # Nothing to verify and nothing to refresh: the pod as recorded costs no further call.
    gatekeeper.observe("MODIFIED", recorded)
    await asyncio.sleep(0.2)
    await gatekeeper.close()
    assert reports.calls == 1 and len(writer.patches) == 1
    assert gate.condition(recorded) is None  # no warmed condition: the gate is off


async def test_an_ungated_pod_is_asked_until_its_server_names_the_files() -> None:
    reports = Reports(
        TimeoutError(), make_report(phase="loading"), {"not": "a report"}, loaded_report()
    )
    writer = Writer()
    await run(keeper(reports, writer), ungated_pod(), lambda: writer.patches)
    assert reports.calls == 4
    assert gate.loaded_identity(with_conditions(ungated_pod(), *writer.patches)) == (
        COMMIT,
        DIGEST,
    )


async def test_an_ungated_pod_not_ready_yet_is_not_asked() -> None:
    reports, writer = Reports(loaded_report()), Writer()
    gatekeeper = keeper(reports, writer)
    gatekeeper.observe("MODIFIED", ungated_pod(ready=False))
    await asyncio.sleep(0.1)
    await gatekeeper.close()
    assert reports.calls == 0 and writer.patches == []


async def test_after_a_restart_an_ungated_pods_record_is_renewed() -> None:
    """A restarted server may have loaded other files (a moved branch): the old record no
    longer speaks for it, and the new process's is written."""
    first = judged(ungated_pod(), gate.identity_verdict(loaded_report()), names.LOADED_CONDITION)
    assert gate.loaded_identity(first) == (COMMIT, DIGEST)
    restarted = copy.deepcopy(first)
    restarted["status"]["containerStatuses"][0]["restartCount"] = 1
    assert gate.loaded_identity(restarted) is None
    moved = "sha256:" + "cd" * 32
    reports, writer = Reports(loaded_report(commit="beef5678", digest=moved)), Writer()
    await run(keeper(reports, writer), restarted, lambda: writer.patches)
    assert gate.loaded_identity(with_conditions(restarted, *writer.patches)) == (
        "beef5678",
        moved,
    )


async def test_a_pod_neither_gated_nor_an_embedding_services_is_left_alone() -> None:
    reports, writer = Reports(loaded_report()), Writer()
    gatekeeper = keeper(reports, writer)
    stranger = ungated_pod()
    stranger["metadata"]["labels"] = {}
    gatekeeper.observe("MODIFIED", stranger)
    await asyncio.sleep(0.05)
    assert gatekeeper.active == 0 and reports.calls == 0
    await gatekeeper.close()


@pytest.mark.parametrize("task", ["embed", "rerank", "classify", "sparse"])
async def test_a_timed_verification_goes_to_the_route_of_the_server_s_task(task: str) -> None:
    """With rollout.verifyLatency, the gate times a request on the pod before opening: on the
    route its report's task serves (podclient._TIMED; /embed would be refused by a
    re-ranker's server or a SPLADE model's, and its pod never let in)."""
    settings = {"task": task, "pooling": "mean"} if task in ("rerank", "classify") else None
    if task == "sparse":  # a SPLADE model: an embedder that gives no dense vector
        settings = {"task": "embed", "outputs": ["sparse"]}
    reports, writer = Reports(make_report(model_settings=settings)), Writer()
    gatekeeper = Gatekeeper(
        writer, reports, no_events, Metrics(), FAST, verify_latency=lambda pod: True
    )  # type: ignore[arg-type]
    await run(gatekeeper, make_pod(), lambda: writer.patches)
    assert reports.timed == [task]
    assert writer.statuses()[0] == ("True", names.REASON_VERIFIED)
