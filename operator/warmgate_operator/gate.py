"""The warm gate's judgement: is this pod's warmup report good enough to let traffic in?

Pure functions only (no I/O, no clock): the pod object and the server's `/ready` report go in,
a verdict and the pod condition to write come out. `gatekeeper` does the fetching and patching.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

WARMED_CONDITION = "warmgate.dev/warmed"
_UNBOUNDED = 1 << 62
SERVER_CONTAINER = "server"

# Condition reasons (CamelCase, as Kubernetes API conventions ask).
REASON_VERIFIED = "WarmupVerified"
REASON_NOT_READY = "ReportNotReady"
REASON_MODEL_MISMATCH = "ModelMismatch"
REASON_REVISION_MISMATCH = "RevisionMismatch"
REASON_SHAPES_MISSING = "ShapesNotWarmed"
REASON_UNREACHABLE = "ReportUnreachable"
REASON_BAD_REPORT = "ReportInvalid"
REASON_TOO_SLOW = "VerificationTooSlow"
REASON_RESTARTED = "ContainerRestarted"
REASON_FAILED = "WarmupFailed"


@dataclass(frozen=True)
class Expectation:
    """What the pod's own template asks its server to be (read from the pod, not the CR, so a pod
    of an old ReplicaSet is judged against the model it was built for)."""

    model_id: str
    revision: str
    required_shapes: frozenset[tuple[int, int]]
    port: int


@dataclass(frozen=True)
class Verdict:
    passed: bool
    reason: str
    message: str
    warmup_seconds: float | None = None
    # A shape whose steady latency the gatekeeper may time a verification request against.
    probe_shape: tuple[int, int] | None = None
    steady_ms: float | None = None
    # Whether retrying can help (a model mismatch will not fix itself; a warming pod will).
    retryable: bool = True
    details: Mapping[str, Any] = field(default_factory=dict)


def _csv_ints(value: str) -> list[int]:
    return [int(part) for part in value.split(",") if part.strip()]


def _container(pod: Mapping[str, Any], name: str = SERVER_CONTAINER) -> Mapping[str, Any] | None:
    containers = pod.get("spec", {}).get("containers", []) or []
    for container in containers:
        if container.get("name") == name:
            return container
    return containers[0] if containers else None


def server_settings(container: Mapping[str, Any]) -> dict[str, str]:
    """The server's settings as the container sets them: `--flag value` / `--flag=value` args
    win over their `WARMGATE_*` environment twins (the server's own precedence)."""
    settings: dict[str, str] = {}
    for env in container.get("env", []) or []:
        name = env.get("name", "")
        if name.startswith("WARMGATE_") and "value" in env:
            flag = name.removeprefix("WARMGATE_").lower().replace("_", "-")
            settings[flag] = str(env["value"])
    args = [str(arg) for arg in (container.get("command", []) or [])[1:]]
    args += [str(arg) for arg in container.get("args", []) or []]
    index = 0
    while index < len(args):
        arg = args[index]
        if arg.startswith("--"):
            name, eq, value = arg[2:].partition("=")
            if eq:
                settings[name] = value
            elif index + 1 < len(args) and not args[index + 1].startswith("--"):
                settings[name] = args[index + 1]
                index += 1
            else:
                settings[name] = "true"
        index += 1
    return settings


def planned_grid(
    batch_sizes: Iterable[int], buckets: Iterable[int], max_batch_tokens: int, max_batch_size: int
) -> frozenset[tuple[int, int]]:
    """The configured shapes the server must warm: batch sizes x buckets within the token budget.
    Mirrors the server's plan so the operator does not take the report's word for what is due."""
    return frozenset(
        (batch, bucket)
        for batch in batch_sizes
        for bucket in buckets
        if batch <= max_batch_size and batch * bucket <= max_batch_tokens
    )


def expectation_for(pod: Mapping[str, Any], default_port: int = 8080) -> Expectation | None:
    """Read the expectation from the pod's server container; None when the pod is not a server."""
    container = _container(pod)
    if container is None:
        return None
    settings = server_settings(container)
    if "model" not in settings:
        return None
    port = default_port
    for declared in container.get("ports", []) or []:
        if declared.get("name") == "http" and declared.get("containerPort"):
            port = int(declared["containerPort"])
    if "port" in settings:
        port = int(settings["port"])
    shapes: frozenset[tuple[int, int]] = frozenset()
    if "warmup-batch-sizes" in settings and "sequence-buckets" in settings:
        batch_sizes = _csv_ints(settings["warmup-batch-sizes"])
        buckets = _csv_ints(settings["sequence-buckets"])
        shapes = planned_grid(
            batch_sizes,
            buckets,
            int(settings.get("max-batch-tokens", str(_UNBOUNDED))),
            int(settings.get("max-batch-size", str(max(batch_sizes, default=1)))),
        )
    return Expectation(
        model_id=settings["model"],
        revision=settings.get("model-revision", "main"),
        required_shapes=shapes,
        port=port,
    )


def _shape_set(items: Sequence[Mapping[str, Any]]) -> frozenset[tuple[int, int]]:
    return frozenset((int(item["batch_size"]), int(item["seq_len"])) for item in items)


def _format_shapes(shapes: Iterable[tuple[int, int]], limit: int = 6) -> str:
    ordered = sorted(shapes)
    text = ", ".join(f"{batch}x{seq}" for batch, seq in ordered[:limit])
    return text + (f" (+{len(ordered) - limit} more)" if len(ordered) > limit else "")


def evaluate_report(report: Any, expected: Expectation) -> Verdict:
    """Judge a `/ready` report (docs/contract.md) against what the pod was built to serve."""
    if not isinstance(report, Mapping):
        return Verdict(False, REASON_BAD_REPORT, "the /ready body is not a JSON object")
    try:
        phase = report["phase"]
        model = report["model"]
        planned = _shape_set(report["planned_shapes"])
        warmed_items = report["warmed_shapes"]
        warmed = _shape_set(warmed_items)
    except (KeyError, TypeError, ValueError) as error:
        return Verdict(False, REASON_BAD_REPORT, f"the /ready report lacks or mangles {error}")
    if phase == "failed":
        return Verdict(
            False,
            REASON_FAILED,
            f"the server's warmup failed: {report.get('error') or 'no reason given'}",
            retryable=False,
        )
    if phase != "ready":
        progress = report.get("progress") or {}
        return Verdict(
            False,
            REASON_NOT_READY,
            f"the server reports phase {phase!r} "
            f"({progress.get('done', '?')} of {progress.get('total', '?')} shapes warmed)",
        )
    if model.get("id") != expected.model_id:
        return Verdict(
            False,
            REASON_MODEL_MISMATCH,
            f"the server serves model {model.get('id')!r}, the pod asks for {expected.model_id!r}",
            retryable=False,
        )
    if str(model.get("revision")) != expected.revision:
        return Verdict(
            False,
            REASON_REVISION_MISMATCH,
            f"the server serves revision {model.get('revision')!r}, "
            f"the pod asks for {expected.revision!r}",
            retryable=False,
        )
    missing = (expected.required_shapes | planned) - warmed
    if missing:
        return Verdict(
            False,
            REASON_SHAPES_MISSING,
            f"{len(missing)} required shape(s) not warmed: {_format_shapes(missing)}",
        )
    steady = {
        (int(item["batch_size"]), int(item["seq_len"])): float(item.get("steady_ms") or 0.0)
        for item in warmed_items
    }
    probe_shape = min(steady) if steady else None
    seconds = report.get("warmup_seconds")
    return Verdict(
        True,
        REASON_VERIFIED,
        f"{len(warmed)} shapes warm in {float(seconds or 0.0):.1f}s; model {expected.model_id} "
        f"revision {expected.revision}",
        warmup_seconds=float(seconds) if seconds is not None else None,
        probe_shape=probe_shape,
        steady_ms=steady.get(probe_shape) if probe_shape else None,
    )


def verification_passes(
    measured_ms: float, steady_ms: float, factor: float, slack_ms: float
) -> bool:
    """A timed request is warm when it is within `factor` of the steady latency the server
    reported, plus a fixed slack for the HTTP round trip the steady figure does not include."""
    return measured_ms <= steady_ms * factor + slack_ms


def condition(pod: Mapping[str, Any], condition_type: str = WARMED_CONDITION) -> dict | None:
    for item in pod.get("status", {}).get("conditions", []) or []:
        if item.get("type") == condition_type:
            return dict(item)
    return None


def has_gate(pod: Mapping[str, Any]) -> bool:
    gates = pod.get("spec", {}).get("readinessGates", []) or []
    return any(gate.get("conditionType") == WARMED_CONDITION for gate in gates)


def containers_ready(pod: Mapping[str, Any]) -> bool:
    statuses = pod.get("status", {}).get("containerStatuses", []) or []
    expected = len(pod.get("spec", {}).get("containers", []) or [])
    return bool(statuses) and len(statuses) == expected and all(s.get("ready") for s in statuses)


def container_running(pod: Mapping[str, Any]) -> bool:
    statuses = pod.get("status", {}).get("containerStatuses", []) or []
    return bool(statuses) and all((s.get("state") or {}).get("running") for s in statuses)


def restart_count(pod: Mapping[str, Any]) -> int:
    statuses = pod.get("status", {}).get("containerStatuses", []) or []
    return sum(int(s.get("restartCount", 0)) for s in statuses)


def restarted_since_verified(pod: Mapping[str, Any]) -> bool:
    """True when the gate says warm but a container has restarted since: the restart count in
    the verified message is behind the pod's, or a container started after the condition's
    transition. Either way the new process has not been verified."""
    current = condition(pod)
    if not current or current.get("status") != "True":
        return False
    verified_at = current.get("lastTransitionTime") or ""
    marker = f"(restarts={restart_count(pod)})"
    if marker not in (current.get("message") or ""):
        return True
    for status in pod.get("status", {}).get("containerStatuses", []) or []:
        started = (status.get("state", {}).get("running") or {}).get("startedAt") or ""
        if started and verified_at and started > verified_at:
            return True
    return False


def desired_condition(
    verdict: Verdict, restarts: int, existing: Mapping[str, Any] | None, now: str
) -> dict[str, Any]:
    """The `warmgate.dev/warmed` condition to write; keeps `lastTransitionTime` when the status
    does not change (API conventions)."""
    status = "True" if verdict.passed else "False"
    transition = now
    if existing and existing.get("status") == status and existing.get("lastTransitionTime"):
        transition = existing["lastTransitionTime"]
    return {
        "type": WARMED_CONDITION,
        "status": status,
        "reason": verdict.reason,
        "message": f"{verdict.message} (restarts={restarts})",
        "lastProbeTime": None,
        "lastTransitionTime": transition,
    }


def condition_changed(existing: Mapping[str, Any] | None, desired: Mapping[str, Any]) -> bool:
    if existing is None:
        return True
    return any(existing.get(key) != desired.get(key) for key in ("status", "reason", "message"))


def status_patch(desired: Mapping[str, Any], resource_version: str | None) -> dict[str, Any]:
    """A strategic-merge patch for `pods/<name>/status`: conditions merge by type, so kubelet's
    own conditions are left alone; the resourceVersion makes a stale write fail with 409."""
    body: dict[str, Any] = {"status": {"conditions": [dict(desired)]}}
    if resource_version:
        body["metadata"] = {"resourceVersion": resource_version}
    return body
