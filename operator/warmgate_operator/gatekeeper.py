"""The warm gate in motion: one worker per gated pod fetches its `/ready` report, judges it
(`gate`), optionally times a verification request, and patches the pod's `warmgate.dev/warmed`
condition. Kubelet makes the pod Ready only once that condition is True, so no pod receives
traffic before the operator has seen it warm.

A pod without the gate (`spec.rollout.warmGate: false`) is not verified, but its worker still
reads what the server loaded once the pod is ready and records it in the pod's
`warmgate.dev/loaded` condition, so that `status.model` names the commit and weights that serve.

Workers live in memory, keyed by pod uid: kopf timers and daemons would put finalizers on pods,
and the gate must never block a pod's deletion. Pod watch events (`observe`) start, feed and
stop them: a listing starts them after a restart of the operator, and a relist stops those of
pods deleted while the watch was away (watch.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

from warmgate_contract import names
from warmgate_kube.objects import rfc3339
from warmgate_kube.watch import resource_version

from . import gate
from .metrics import Metrics
from .podclient import ERRORS, PodClient

log = logging.getLogger("warmgate.gate")


@dataclass(frozen=True)
class GateConfig:
    """How the gatekeeper probes pods (operator-wide settings)."""

    # Retry backoff for a pod whose report does not pass yet: first, factor, cap.
    backoff_initial_seconds: float = 1.0
    backoff_factor: float = 2.0
    backoff_max_seconds: float = 30.0
    # How often a verified pod's report is fetched again to catch a regression.
    recheck_seconds: float = 30.0
    # A timed verification request passes within factor x steady latency + slack.
    verify_factor: float = 3.0
    verify_slack_ms: float = 100.0
    verify_text: str = "warmgate verification request"


class PodStatusWriter(Protocol):
    async def patch_status(
        self, namespace: str, name: str, body: dict[str, Any]
    ) -> Mapping[str, Any] | None:
        """The pod as written (None: not known)."""
        ...


EventSink = Callable[[Mapping[str, Any], str, str, str], Awaitable[None]]
"""async (pod, type 'Normal'|'Warning', reason, message) -> None"""


@dataclass(frozen=True)
class PodWarning:
    """A Warning Event to record about a pod (once, not at every retry)."""

    reason: str
    message: str


def pod_address(pod: Mapping[str, Any]) -> str | None:
    return pod.get("status", {}).get("podIP")


@dataclass
class _Worker:
    pod: Mapping[str, Any]
    task: asyncio.Task | None = None
    wake: asyncio.Event | None = None


class Gatekeeper:
    """Owns the per-pod workers. `observe` is called with every pod watch event."""

    def __init__(
        self,
        writer: PodStatusWriter,
        pods: PodClient,
        events: EventSink,
        metrics: Metrics,
        config: GateConfig = GateConfig(),
        verify_latency: Callable[[Mapping[str, Any]], bool] = lambda pod: False,
    ) -> None:
        self._writer = writer
        self._pods = pods
        self._events = events
        self._metrics = metrics
        self._config = config
        self._verify_latency = verify_latency
        self._workers: dict[str, _Worker] = {}
        # What the first verified pod of each template loaded (and its name): later pods of
        # the template must load the same files. Rebuilt after a restart from the verified
        # pods' conditions (gate.loaded_identity).
        self._loaded: dict[tuple[str, str], tuple[gate.Identity, str]] = {}

    @property
    def active(self) -> int:
        return sum(1 for worker in self._workers.values() if worker.task and not worker.task.done())

    def observe(self, event_type: str | None, pod: Mapping[str, Any]) -> None:
        uid = pod.get("metadata", {}).get("uid")
        if not uid or not (gate.has_gate(pod) or gate.records_identity(pod)):
            return
        if event_type == "DELETED" or pod.get("metadata", {}).get("deletionTimestamp"):
            self._stop(uid)
            return
        worker = self._workers.get(uid)
        if worker is None:
            worker = self._workers[uid] = _Worker(pod=pod, wake=asyncio.Event())
        worker.pod = pod
        if worker.task is None or worker.task.done():
            worker.task = asyncio.create_task(self._run(uid), name=f"warm-gate/{uid}")
        assert worker.wake is not None
        worker.wake.set()

    def _stop(self, uid: str) -> None:
        worker = self._workers.pop(uid, None)
        if worker and worker.task and not worker.task.done():
            worker.task.cancel()
        if worker is not None:
            key = gate.template_key(worker.pod)
            if key and not any(gate.template_key(w.pod) == key for w in self._workers.values()):
                self._loaded.pop(key, None)

    def _reference(self, pod: Mapping[str, Any]) -> tuple[gate.Identity, str] | None:
        """What the pod's template siblings loaded: remembered, or read from a verified
        sibling's condition (after an operator restart)."""
        key = gate.template_key(pod)
        if key is None:
            return None
        if key in self._loaded:
            return self._loaded[key]
        uid = pod.get("metadata", {}).get("uid")
        for other_uid, worker in self._workers.items():
            if other_uid == uid or gate.template_key(worker.pod) != key:
                continue
            identity = gate.loaded_identity(worker.pod)
            if identity is not None:
                self._loaded[key] = (identity, _name(worker.pod))
                return self._loaded[key]
        return None

    def _judge_files(self, pod: Mapping[str, Any], verdict: gate.Verdict) -> gate.Verdict:
        """Compare with the template's siblings, and claim the template for this pod's files
        when it is the first. No await in here: two pods judged at once cannot both claim."""
        reference = self._reference(pod)
        if reference is None:
            key = gate.template_key(pod)
            if verdict.passed and verdict.identity is not None and key is not None:
                self._loaded[key] = (verdict.identity, _name(pod))
            return verdict
        return gate.check_same_files(verdict, reference[0], reference[1])

    async def close(self) -> None:
        tasks = [w.task for w in self._workers.values() if w.task and not w.task.done()]
        self._workers.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _run(self, uid: str) -> None:
        backoff = self._config.backoff_initial_seconds
        last_warning: PodWarning | None = None
        while uid in self._workers:
            worker = self._workers[uid]
            assert worker.wake is not None
            worker.wake.clear()
            pod = worker.pod
            step = self._step if gate.has_gate(pod) else self._record_identity
            try:
                delay, warning = await step(pod, backoff)
            except asyncio.CancelledError:
                raise
            except Exception as error:  # an apiserver hiccup must not kill the worker
                log.warning("warm gate step failed for %s: %s", _name(pod), error)
                delay, warning = backoff, None
            if warning and warning != last_warning:
                await self._events(pod, "Warning", warning.reason, warning.message)
            last_warning = warning
            if delay is None:
                backoff = self._config.backoff_initial_seconds
                delay = self._config.recheck_seconds
            else:
                backoff = min(
                    backoff * self._config.backoff_factor, self._config.backoff_max_seconds
                )
            # Sleep until the retry is due or the pod changes, whichever comes first.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(worker.wake.wait(), timeout=delay)

    async def _step(
        self, pod: Mapping[str, Any], backoff: float
    ) -> tuple[float | None, PodWarning | None]:
        """One look at the pod. Returns (retry delay or None when settled, warning to emit)."""
        existing = gate.condition(pod)
        verified = bool(existing and existing.get("status") == "True")
        if verified and gate.restarted_since_verified(pod):
            verdict = gate.Verdict(
                False,
                names.REASON_RESTARTED,
                "a container restarted after the warmup was verified; verifying the new process",
            )
            await self._write(pod, verdict, existing)
            return backoff, None
        expected = gate.expectation_for(pod)
        host = pod_address(pod)
        if not gate.containers_ready(pod):
            if verified:
                # A readiness blip (a CPU-starved probe, a model fault, a drain) is not a
                # change of warm state: kubelet's probe takes the pod out and puts it back on
                # its own, without waiting for this operator. Only a restart (above) or a
                # regressed report closes the gate.
                return await self._check_regression(pod, existing, backoff)
            if expected is None or host is None or not gate.container_running(pod):
                # Not started yet; the next pod event wakes us.
                return self._config.backoff_max_seconds, None
            # Running but not ready: loading, warming, or failed. Only a failure is news: say
            # why on the pod and in an Event, so a stalled rollout explains itself.
            try:
                _, report = await self._pods.get_json(host, expected.port, "/ready")
            except ERRORS:
                return backoff, None
            verdict = gate.evaluate_report(report, expected)
            if verdict.reason not in (names.REASON_FAILED, names.REASON_MEMORY_EXCEEDED):
                return backoff, None
            await self._write(pod, verdict, existing)
            return backoff, PodWarning(verdict.reason, f"{_name(pod)}: {verdict.message}")
        if expected is None or host is None:
            return None, None
        try:
            _, report = await self._pods.get_json(host, expected.port, "/ready")
        except ERRORS as error:
            if verified:  # a transient blip on a serving pod; kubelet's probes own liveness
                return backoff, None
            verdict = gate.Verdict(False, names.REASON_UNREACHABLE, f"GET /ready failed: {error}")
            await self._write(pod, verdict, existing)
            return backoff, None
        recorded = gate.GateState.of(pod) is not None
        if verified and recorded and not gate.regressed(report):
            return None, None  # still the verified process, in a warm state
        verdict = gate.evaluate_report(report, expected)
        if verdict.passed and self._verify_latency(pod) and verdict.probe_shape:
            verdict = await self._verify(host, expected.port, verdict)
        verdict = self._judge_files(pod, verdict)
        if verified and recorded and verdict.passed:
            return None, None
        await self._write(pod, verdict, existing)
        if verdict.passed:
            log.info("pod %s warm gate open: %s", _name(pod), verdict.message)
            return None, None
        if verdict.reason == names.REASON_NOT_READY:
            return backoff, None
        return backoff, PodWarning(verdict.reason, f"{_name(pod)}: {verdict.message}")

    async def _record_identity(
        self, pod: Mapping[str, Any], backoff: float
    ) -> tuple[float | None, PodWarning | None]:
        """An ungated pod: once ready, record what its server loaded (again after a restart).
        Settled, it costs no call: the condition says whether it speaks for this process."""
        if gate.identity_recorded(pod):
            return None, None
        expected, host = gate.expectation_for(pod), pod_address(pod)
        if expected is None or host is None or not gate.containers_ready(pod):
            return self._config.backoff_max_seconds, None  # the next pod event wakes us
        try:
            _, report = await self._pods.get_json(host, expected.port, "/ready")
        except ERRORS:
            return backoff, None
        verdict = gate.identity_verdict(report)
        if verdict is None:  # not a report, or no files named yet: ask again
            return backoff, None
        existing = gate.condition(pod, names.LOADED_CONDITION)
        await self._patch(pod, verdict, existing, names.LOADED_CONDITION)
        return None, None

    async def _check_regression(
        self, pod: Mapping[str, Any], existing: Mapping[str, Any] | None, backoff: float
    ) -> tuple[float | None, PodWarning | None]:
        """A verified pod whose containers are not ready: close the gate only if its report
        says the warm state changed; an unreachable pod is kubelet's business."""
        expected, host = gate.expectation_for(pod), pod_address(pod)
        if expected is None or host is None:
            return backoff, None
        try:
            _, report = await self._pods.get_json(host, expected.port, "/ready")
        except ERRORS:
            return backoff, None
        if not gate.regressed(report):
            return backoff, None
        await self._write(pod, gate.evaluate_report(report, expected), existing)
        return backoff, None

    async def _verify(self, host: str, port: int, verdict: gate.Verdict) -> gate.Verdict:
        assert verdict.probe_shape is not None
        batch_size = verdict.probe_shape[0]
        try:
            inputs = [self._config.verify_text] * batch_size
            measured = await self._pods.time_request(host, port, inputs, verdict.verification)
        except ERRORS as error:
            return gate.Verdict(False, names.REASON_UNREACHABLE, f"verification request: {error}")
        steady = verdict.steady_ms or 0.0
        if gate.verification_passes(
            measured, steady, self._config.verify_factor, self._config.verify_slack_ms
        ):
            return replace(
                verdict,
                message=f"{verdict.message}; verification {measured:.1f} ms vs steady "
                f"{steady:.1f} ms",
            )
        return gate.Verdict(
            False,
            names.REASON_TOO_SLOW,
            f"verification request took {measured:.1f} ms, steady is {steady:.1f} ms",
        )

    async def _write(
        self, pod: Mapping[str, Any], verdict: gate.Verdict, existing: Mapping[str, Any] | None
    ) -> None:
        if not await self._patch(pod, verdict, existing, names.WARMED_CONDITION):
            return
        self._metrics.gate_verifications.labels(reason=verdict.reason).inc()
        if verdict.passed:
            ready_since = gate.containers_ready_since(pod)
            if ready_since is not None:
                self._metrics.gate_latency.observe(max(0.0, time.time() - ready_since))
            await self._events(pod, "Normal", verdict.reason, verdict.message)

    async def _patch(
        self,
        pod: Mapping[str, Any],
        verdict: gate.Verdict,
        existing: Mapping[str, Any] | None,
        condition_type: str,
    ) -> bool:
        """Write the verdict's condition and the state it was judged in, unless the pod has
        them already; whether it wrote."""
        desired = gate.desired_condition(verdict, existing, rfc3339(), condition_type)
        state = gate.desired_state(pod, verdict)
        if not gate.needs_write(pod, existing, desired, state):
            return False
        meta = pod["metadata"]
        body = gate.status_patch(desired, state, meta.get("resourceVersion"))
        written = await self._writer.patch_status(meta["namespace"], meta["name"], body)
        self._adopt(written)
        return True

    def _adopt(self, written: Mapping[str, Any] | None) -> None:
        """The pod as this write left it becomes the worker's copy. Its watch event changes
        nothing in the cache (which took the write's answer first), so no event brings it: a
        worker that kept the copy it wrote over judged it again by the old condition, wrote
        again with the old resourceVersion, and got 409 Conflict every retry for as long as
        nothing else changed the pod (a pod refused for memory: for ever)."""
        if not written:
            return
        worker = self._workers.get(written.get("metadata", {}).get("uid", ""))
        if worker is None:
            return
        held, new = resource_version(worker.pod), resource_version(written)
        if held is None or (new is not None and new > held):
            worker.pod = written


def _name(pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata", {})
    return f"{meta.get('namespace')}/{meta.get('name')}"
