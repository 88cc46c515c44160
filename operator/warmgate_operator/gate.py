"""The warm gate's judgement: is this pod's warmup report good enough to let traffic in?

Pure functions only (no I/O, no clock): the pod object and the server's `/ready` report go in,
a verdict and the pod condition to write come out. `gatekeeper` does the fetching and patching.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from warmgate_contract import flags
from warmgate_contract.names import (
    GATE_STATE_ANNOTATION,
    LOADED_CONDITION,
    REASON_BAD_REPORT,
    REASON_FAILED,
    REASON_LOADED,
    REASON_MEMORY_EXCEEDED,
    REASON_MODEL_MISMATCH,
    REASON_NOT_READY,
    REASON_REVISION_MISMATCH,
    REASON_SHAPES_MISSING,
    REASON_VERIFIED,
    SERVER_CONTAINER,
    SERVER_PORT,
    SERVER_PORT_NAME,
    SERVICE_LABEL,
    SPEC_HASH_ANNOTATION,
    WARMED_CONDITION,
)
from warmgate_contract.report import DRAINING, FAILED, READY, UNHEALTHY, ReadyReport, ReportError
from warmgate_contract.shapes import Shape, plan_warmup
from warmgate_kube.objects import condition as find_condition
from warmgate_kube.objects import parse_time


@dataclass(frozen=True)
class Expectation:
    """What the pod's own template asks its server to be (read from the pod, not the CR, so a pod
    of an old ReplicaSet is judged against the model it was built for)."""

    model_id: str
    revision: str
    required_shapes: frozenset[Shape]
    port: int
    memory_policy: str = "refuse"
    """fit: the server may cut its plan to what fits in memory (the report says what it cut)."""


Identity = tuple[str | None, str]
"""What a server loaded: (hub commit or None for a plain folder, weights digest)."""


@dataclass(frozen=True)
class GateState:
    """What the gate last judged on a pod (its GATE_STATE_ANNOTATION): which pod and process
    (its restart count then), and the files its server had loaded, if it said."""

    uid: str
    restarts: int
    identity: Identity | None = None
    memory: tuple[int, int | None] | None = None
    """(peak, limit) bytes its warmup measured."""
    task: str | None = None
    """What its server does (Verdict.serves), when its report said."""

    def to_json(self) -> str:
        commit, digest = self.identity or (None, None)
        peak, limit = self.memory or (None, None)
        document = {
            "uid": self.uid,
            "restarts": self.restarts,
            "commit": commit,
            "weightsDigest": digest,
            "memoryPeakBytes": peak,
            "memoryLimitBytes": limit,
            "task": self.task,
        }
        return json.dumps(document, sort_keys=True, separators=(",", ":"))

    @classmethod
    def of(cls, pod: Mapping[str, Any]) -> GateState | None:
        """The pod's recorded state; None when there is none, it cannot be read, or it was
        written for another pod (an annotation copied by hand)."""
        meta = pod.get("metadata") or {}
        raw = (meta.get("annotations") or {}).get(GATE_STATE_ANNOTATION)
        try:
            document = json.loads(raw) if raw else None
            if not isinstance(document, dict) or document.get("uid") != meta.get("uid"):
                return None
            digest = document.get("weightsDigest")
            identity = (document.get("commit"), str(digest)) if digest else None
            peak, limit = document.get("memoryPeakBytes"), document.get("memoryLimitBytes")
            memory = (int(peak), None if limit is None else int(limit)) if peak else None
            task = document.get("task")
            return cls(
                str(document["uid"]),
                int(document["restarts"]),
                identity,
                memory,
                str(task) if task else None,
            )
        except (ValueError, TypeError, KeyError):
            return None

    def speaks_for(self, pod: Mapping[str, Any]) -> bool:
        """Whether it was written for the pod's current process (no restart since)."""
        return self.restarts == restart_count(pod)


def describe_identity(identity: Identity) -> str:
    commit, digest = identity
    return f"commit={commit or '-'} weights={digest}"


@dataclass(frozen=True)
class Verdict:
    passed: bool
    reason: str
    message: str
    warmup_seconds: float | None = None
    # A shape whose steady latency the gatekeeper may time a verification request against.
    probe_shape: Shape | None = None
    steady_ms: float | None = None
    # Whether retrying can help (a model mismatch will not fix itself; a warming pod will).
    retryable: bool = True
    details: Mapping[str, Any] = field(default_factory=dict)
    identity: Identity | None = None
    """What the server loaded, when its report says."""
    memory: tuple[int, int | None] | None = None
    """(peak, limit) bytes the server's warmup measured, when its report says."""
    task: str = "embed"
    """What the server does with its model (its report's model_settings.task): which route
    the verification request times."""
    outputs: tuple[str, ...] = ()
    """What an embedder gives (model_settings.outputs: dense, bge-m3's sparse and colbert too,
    a SPLADE model sparse alone), shown with the task; () where the report does not say."""

    @property
    def serves(self) -> str:
        """The task as `kubectl get emb` shows it: embed, rerank or classify, an embedder's
        other outputs joined on ("embed+sparse+colbert"); a sparse encoder's "sparse"."""
        extra = tuple(output for output in self.outputs if output != "dense")
        if self.verification == "sparse":
            return "+".join(extra)
        return "+".join((self.task, *extra))

    @property
    def verification(self) -> str:
        """Which request verifies the pod (podclient's): the task's, or "sparse" for an
        embedder with no dense vector (SPLADE: /embed_sparse, its /embed answers 424)."""
        if self.task == "embed" and self.outputs and "dense" not in self.outputs:
            return "sparse"
        return self.task


def _container(pod: Mapping[str, Any], name: str = SERVER_CONTAINER) -> Mapping[str, Any] | None:
    containers = pod.get("spec", {}).get("containers", []) or []
    for container in containers:
        if container.get("name") == name:
            return container
    return containers[0] if containers else None


def server_settings(container: Mapping[str, Any]) -> dict[str, Any]:
    """The server settings the container gives explicitly ({flag dest: value}): its args win
    over their `WARMGATE_*` environment twins, as in the server itself. ValueError/KeyError
    when it asks for something the server would refuse to parse."""
    environ = {
        item["name"]: str(item["value"])
        for item in container.get("env", []) or []
        if "value" in item and str(item.get("name", "")).startswith(flags.ENV_PREFIX)
    }
    args = [str(arg) for arg in (container.get("command", []) or [])[1:]]
    args += [str(arg) for arg in container.get("args", []) or []]
    return flags.read_args(args, environ)


def expectation_for(pod: Mapping[str, Any], default_port: int = SERVER_PORT) -> Expectation | None:
    """Read the expectation from the pod's server container; None when the pod is not a
    server (or asks for flags no server accepts)."""
    container = _container(pod)
    if container is None:
        return None
    try:
        given = server_settings(container)
    except (KeyError, ValueError):
        return None
    if not given.get("model"):
        return None
    settings = flags.settings(given)
    port = default_port
    for declared in container.get("ports", []) or []:
        if declared.get("name") == SERVER_PORT_NAME and declared.get("containerPort"):
            port = int(declared["containerPort"])
    if "port" in given:
        port = int(given["port"])
    # The configured grid only: the profile's shapes are the server's to add, and the report's
    # own plan must be warm too (evaluate_report).
    plan = plan_warmup(
        settings["warmup_batch_sizes"],
        settings["sequence_buckets"],
        settings["max_batch_tokens"],
        settings["max_batch_size"],
    )
    return Expectation(
        model_id=settings["model"],
        revision=settings["model_revision"],
        required_shapes=frozenset(plan.shapes),
        port=port,
        memory_policy=settings["memory_policy"],
    )


def _format_shapes(shapes: Iterable[Shape], limit: int = 6) -> str:
    ordered = sorted(shapes)
    text = ", ".join(shape.key for shape in ordered[:limit])
    return text + (f" (+{len(ordered) - limit} more)" if len(ordered) > limit else "")


def evaluate_report(document: Any, expected: Expectation) -> Verdict:
    """Judge a `/ready` report (the contract's ReadyReport) against what the pod was built to
    serve."""
    try:
        report = ReadyReport.from_json(document)
    except ReportError as error:
        return Verdict(False, REASON_BAD_REPORT, str(error))
    if report.phase == FAILED:
        memory = report.failure_reason == REASON_MEMORY_EXCEEDED
        return Verdict(
            False,
            REASON_MEMORY_EXCEEDED if memory else REASON_FAILED,
            f"the server's warmup failed: {report.error or 'no reason given'}",
            retryable=False,
        )
    if report.phase != READY:
        return Verdict(
            False,
            REASON_NOT_READY,
            f"the server reports phase {report.phase!r} "
            f"({len(report.warmed)} of {len(report.planned)} shapes warmed)",
        )
    if report.model_id != expected.model_id:
        return Verdict(
            False,
            REASON_MODEL_MISMATCH,
            f"the server serves model {report.model_id!r}, the pod asks for {expected.model_id!r}",
            retryable=False,
        )
    if report.revision != expected.revision:
        return Verdict(
            False,
            REASON_REVISION_MISMATCH,
            f"the server serves revision {report.revision!r}, "
            f"the pod asks for {expected.revision!r}",
            retryable=False,
        )
    required = expected.required_shapes | set(report.planned)
    cut = report.memory.cut if report.memory is not None else None
    if cut is not None and expected.memory_policy == "fit":
        # The pod allows it: what did not fit in its memory was left out, and its batcher
        # forms only the shapes it warmed.
        required -= set(cut.shapes)
    missing = required - report.warmed_shapes
    if missing:
        return Verdict(
            False,
            REASON_SHAPES_MISSING,
            f"{len(missing)} required shape(s) not warmed: {_format_shapes(missing)}",
        )
    steady = {item.shape: item.steady_ms for item in report.warmed}
    probe_shape = min(steady) if steady else None
    identity = report.loaded_identity
    loaded = f"; loaded {describe_identity(identity)}" if identity else ""
    fitted = (
        f"; {len(cut.shapes)} shapes cut to fit in memory (up to {cut.max_batch_tokens} "
        "tokens a batch)"
        if cut is not None and expected.memory_policy == "fit"
        else ""
    )
    return Verdict(
        True,
        REASON_VERIFIED,
        f"{len(steady)} shapes warm in {report.warmup_seconds or 0.0:.1f}s; model "
        f"{expected.model_id} revision {expected.revision}{loaded}{fitted}",
        warmup_seconds=report.warmup_seconds,
        probe_shape=probe_shape,
        steady_ms=steady.get(probe_shape) if probe_shape else None,
        identity=identity,
        task=str((report.model_settings or {}).get("task") or "embed"),
        outputs=_outputs(report.model_settings),
        memory=None
        if report.memory is None
        else (report.memory.peak_bytes, report.memory.limit_bytes),
    )


def _outputs(settings: Mapping[str, Any] | None) -> tuple[str, ...]:
    outputs = (settings or {}).get("outputs") or ()
    return tuple(str(output) for output in outputs) if isinstance(outputs, list) else ()


WARM_STATE_KEPT = frozenset({READY, UNHEALTHY, DRAINING})
"""Phases in which a verified process is still the warm process it was: a readiness blip, a
model fault or a drain changes what kubelet's probe says, not what the gate verified."""


def regressed(document: Any) -> bool:
    """Whether a verified pod's report says its warm state may have changed: unreadable, or a
    phase the verified process cannot be in (loading, warming, failed...)."""
    try:
        return ReadyReport.from_json(document).phase not in WARM_STATE_KEPT
    except ReportError:
        return True


def check_same_files(verdict: Verdict, reference: Identity | None, holder: str) -> Verdict:
    """A passing verdict stays passed only when the pod loaded what the other pods of its
    template did (`reference`, first loaded by pod `holder`): the same revision can name other
    files later (a branch moved on the hub, a claim or an image tag rewritten), and one
    Service must not answer with two models."""
    if not verdict.passed or reference is None or verdict.identity is None:
        return verdict
    if verdict.identity == reference:
        return verdict
    return Verdict(
        False,
        REASON_MODEL_MISMATCH,
        f"this pod loaded {describe_identity(verdict.identity)}, but pod {holder} of the same "
        f"template serves {describe_identity(reference)}: the revision now names other files "
        "(a moved branch, a rewritten claim or image tag); pin spec.model.revision to a commit "
        "and roll out again",
        retryable=False,
        identity=verdict.identity,
    )


def measured_memory(pod: Mapping[str, Any]) -> tuple[int, int | None] | None:
    """(peak, limit) bytes a verified pod's warmup measured, as the gate recorded it for the
    pod's current process."""
    verified = condition(pod)
    if not (verified and verified.get("status") == "True"):
        return None
    state = GateState.of(pod)
    return state.memory if state is not None and state.speaks_for(pod) else None


def loaded_state(pod: Mapping[str, Any]) -> GateState | None:
    """The gate's record of a pod's current process, when it says what the server loaded:
    recorded when the gate verified the pod (warmgate.dev/warmed True), or, for an ungated pod,
    with its warmgate.dev/loaded condition. The annotation is read once."""
    state = GateState.of(pod)
    if state is None or not state.speaks_for(pod):
        return None
    verified = condition(pod)
    recorded = condition(pod, LOADED_CONDITION)
    if any(found and found.get("status") == "True" for found in (verified, recorded)):
        return state
    return None


def loaded_identity(pod: Mapping[str, Any]) -> Identity | None:
    """What a pod's server loaded (loaded_state's identity)."""
    state = loaded_state(pod)
    return state.identity if state is not None else None


def records_identity(pod: Mapping[str, Any]) -> bool:
    """An EmbeddingService's pod without the warm gate: the gatekeeper does not verify it, but
    records what its server loaded (`identity_verdict`)."""
    labels = pod.get("metadata", {}).get("labels") or {}
    return SERVICE_LABEL in labels and not has_gate(pod)


def identity_recorded(pod: Mapping[str, Any]) -> bool:
    """Whether the pod's warmgate.dev/loaded condition speaks for its current process: written
    at its present restart count (a restarted server may have loaded other files)."""
    current = condition(pod, LOADED_CONDITION)
    if not current or current.get("status") != "True":
        return False
    state = GateState.of(pod)
    return state is not None and state.speaks_for(pod)


def identity_verdict(document: Any) -> Verdict | None:
    """The warmgate.dev/loaded condition's verdict for an ungated pod's `/ready` report: what
    its server loaded. None while the report names no files yet (or is not a report)."""
    try:
        report = ReadyReport.from_json(document)
    except ReportError:
        return None
    identity = report.loaded_identity
    if identity is None:
        return None
    return Verdict(
        True,
        REASON_LOADED,
        f"loaded {describe_identity(identity)}",
        identity=identity,
        task=str((report.model_settings or {}).get("task") or "embed"),
        outputs=_outputs(report.model_settings),
    )


def template_key(pod: Mapping[str, Any]) -> tuple[str, str] | None:
    """(namespace, template): pods that must serve the same files. The ReplicaSet's
    pod-template-hash, else the operator's spec hash."""
    meta = pod.get("metadata", {})
    key = (meta.get("labels") or {}).get("pod-template-hash") or (
        meta.get("annotations") or {}
    ).get(SPEC_HASH_ANNOTATION)
    return (str(meta.get("namespace")), str(key)) if key else None


def verification_passes(
    measured_ms: float, steady_ms: float, factor: float, slack_ms: float
) -> bool:
    """A timed request is warm when it is within `factor` of the steady latency the server
    reported, plus a fixed slack for the HTTP round trip the steady figure does not include."""
    return measured_ms <= steady_ms * factor + slack_ms


def condition(pod: Mapping[str, Any], condition_type: str = WARMED_CONDITION) -> dict | None:
    return find_condition(pod, condition_type)


def has_gate(pod: Mapping[str, Any]) -> bool:
    gates = pod.get("spec", {}).get("readinessGates", []) or []
    return any(gate.get("conditionType") == WARMED_CONDITION for gate in gates)


def containers_ready(pod: Mapping[str, Any]) -> bool:
    statuses = pod.get("status", {}).get("containerStatuses", []) or []
    expected = len(pod.get("spec", {}).get("containers", []) or [])
    return bool(statuses) and len(statuses) == expected and all(s.get("ready") for s in statuses)


def containers_ready_since(pod: Mapping[str, Any]) -> float | None:
    """When the pod's ContainersReady condition last turned True (Unix time), or None."""
    ready = find_condition(pod, "ContainersReady")
    if ready is None or ready.get("status") != "True":
        return None
    return parse_time(ready.get("lastTransitionTime"))


def container_running(pod: Mapping[str, Any]) -> bool:
    statuses = pod.get("status", {}).get("containerStatuses", []) or []
    return bool(statuses) and all((s.get("state") or {}).get("running") for s in statuses)


def restart_count(pod: Mapping[str, Any]) -> int:
    statuses = pod.get("status", {}).get("containerStatuses", []) or []
    return sum(int(s.get("restartCount", 0)) for s in statuses)


def restarted_since_verified(pod: Mapping[str, Any]) -> bool:
    """True when the gate says warm but a container has restarted since: the restart count the
    gate recorded is behind the pod's, or a container started after the condition's
    transition. Either way the new process has not been verified. A verified pod with no
    recorded state (verified by an operator before this one) is judged by its report instead,
    without closing its gate first."""
    current = condition(pod)
    if not current or current.get("status") != "True":
        return False
    state = GateState.of(pod)
    if state is not None and not state.speaks_for(pod):
        return True
    verified_at = parse_time(current.get("lastTransitionTime"))
    for status in pod.get("status", {}).get("containerStatuses", []) or []:
        started = parse_time((status.get("state", {}).get("running") or {}).get("startedAt"))
        if started is not None and verified_at is not None and started > verified_at:
            return True
    return False


def desired_condition(
    verdict: Verdict,
    existing: Mapping[str, Any] | None,
    now: str,
    condition_type: str = WARMED_CONDITION,
) -> dict[str, Any]:
    """The `warmgate.dev/warmed` (or `condition_type`) condition to write; keeps
    `lastTransitionTime` when the status does not change (API conventions)."""
    status = "True" if verdict.passed else "False"
    transition = now
    if existing and existing.get("status") == status and existing.get("lastTransitionTime"):
        transition = existing["lastTransitionTime"]
    return {
        "type": condition_type,
        "status": status,
        "reason": verdict.reason,
        "message": verdict.message,
        "lastProbeTime": None,
        "lastTransitionTime": transition,
    }


def desired_state(pod: Mapping[str, Any], verdict: Verdict) -> GateState:
    """The state to record beside a verdict: this pod and process, and what its server loaded."""
    uid = str((pod.get("metadata") or {}).get("uid"))
    task = verdict.serves if verdict.identity is not None else None
    return GateState(uid, restart_count(pod), verdict.identity, verdict.memory, task)


def needs_write(
    pod: Mapping[str, Any],
    existing: Mapping[str, Any] | None,
    desired: Mapping[str, Any],
    state: GateState,
) -> bool:
    """Whether writing `desired` and `state` would change the pod's condition or state."""
    if existing is None or GateState.of(pod) != state:
        return True
    return any(existing.get(key) != desired.get(key) for key in ("status", "reason", "message"))


def status_patch(
    desired: Mapping[str, Any], state: GateState, resource_version: str | None
) -> dict[str, Any]:
    """A strategic-merge patch for `pods/<name>/status` (which may change the pod's
    annotations too): conditions merge by type, so kubelet's own conditions are left alone;
    the resourceVersion makes a stale write fail with 409."""
    meta: dict[str, Any] = {"annotations": {GATE_STATE_ANNOTATION: state.to_json()}}
    if resource_version:
        meta["resourceVersion"] = resource_version
    return {"metadata": meta, "status": {"conditions": [dict(desired)]}}
