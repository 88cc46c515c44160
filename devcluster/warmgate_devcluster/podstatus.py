"""Pod status as kubelet computes it, from the agent's view of its containers. Pure: no I/O,
the clock comes in as an argument.

The agent owns only the conditions listed in OWNED_CONDITIONS. Others (PodScheduled from the
scheduler, readiness-gate conditions such as `warmgate.dev/warmed` from an operator) are read,
never written: the strategic merge patch of pods/status merges `conditions` by type, so a patch
that carries only ours leaves theirs alone.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

OWNED_CONDITIONS = ("PodReadyToStartContainers", "Initialized", "ContainersReady", "Ready")


def timestamp(moment: dt.datetime) -> str:
    return moment.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class ContainerView:
    """What the agent knows of one container, in kubelet's vocabulary."""

    name: str
    image: str
    image_id: str = ""
    container_id: str | None = None
    state: dict = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: dict = field(default_factory=dict)
    restart_count: int = 0
    started: bool = False
    ready: bool = False
    ever_started: bool = False
    # Terminated and will not be restarted (restartPolicy decided).
    final: bool = False

    def to_status(self) -> dict:
        status = {
            "name": self.name,
            "image": self.image,
            "imageID": self.image_id,
            "started": self.started,
            "ready": self.ready,
            "restartCount": self.restart_count,
            "state": self.state,
            "lastState": self.last_state,
        }
        if self.container_id:
            status["containerID"] = self.container_id
        return status

    @property
    def exit_code(self) -> int | None:
        terminated = self.state.get("terminated")
        return terminated.get("exitCode") if terminated else None


@dataclass(frozen=True)
class PodView:
    pod_ip: str
    host_ip: str
    start_time: str
    network_ready: bool
    initialized: bool
    init_failed: bool
    containers: list[ContainerView]
    init_containers: list[ContainerView]


def pod_phase(view: PodView) -> str:
    if view.init_failed:
        return "Failed"
    if not view.initialized or any(not c.ever_started for c in view.containers):
        return "Pending"
    if view.containers and all(c.final for c in view.containers):
        return "Succeeded" if all(c.exit_code == 0 for c in view.containers) else "Failed"
    return "Running"


def _gate_problems(pod: dict) -> list[str]:
    present = {c["type"]: c for c in (pod.get("status") or {}).get("conditions") or []}
    problems = []
    for gate in pod["spec"].get("readinessGates") or []:
        kind = gate["conditionType"]
        condition = present.get(kind)
        if condition is None:
            problems.append(
                f'corresponding condition of pod readiness gate "{kind}" does not exist.'
            )
        elif condition.get("status") != "True":
            problems.append(
                f'the status of pod readiness gate "{kind}" is not "True", but '
                f"{condition.get('status')}"
            )
    return problems


def owned_conditions(pod: dict, view: PodView, phase: str) -> list[dict]:
    terminal = phase in ("Succeeded", "Failed")
    unready = [c.name for c in view.containers if not c.ready]
    conditions = [
        ("PodReadyToStartContainers", view.network_ready, "", ""),
        (
            "Initialized",
            view.initialized,
            "" if view.initialized else "ContainersNotInitialized",
            ""
            if view.initialized
            else "containers with incomplete status: "
            f"[{' '.join(c.name for c in view.init_containers if not c.final)}]",
        ),
    ]
    if terminal:
        conditions += [
            ("ContainersReady", False, "PodCompleted", ""),
            ("Ready", False, "PodCompleted", ""),
        ]
    elif unready:
        message = f"containers with unready status: [{' '.join(unready)}]"
        conditions += [
            ("ContainersReady", False, "ContainersNotReady", message),
            ("Ready", False, "ContainersNotReady", message),
        ]
    else:
        conditions.append(("ContainersReady", True, "", ""))
        problems = _gate_problems(pod)
        if problems:
            conditions.append(("Ready", False, "ReadinessGatesNotReady", ", ".join(problems)))
        else:
            conditions.append(("Ready", True, "", ""))
    out = []
    for kind, status, reason, message in conditions:
        # None (not absent): the strategic merge patch must clear an old reason and message.
        condition = {
            "type": kind,
            "status": "True" if status else "False",
            "lastProbeTime": None,
            "reason": reason or None,
            "message": message or None,
        }
        out.append(condition)
    return out


def with_transition_times(
    conditions: list[dict], memory: dict[str, tuple[str, str]], now: dt.datetime
) -> list[dict]:
    """Stamp lastTransitionTime, kept from `memory` (type -> (status, time)) while the status
    stays the same; `memory` is updated in place."""
    out = []
    for condition in conditions:
        before = memory.get(condition["type"])
        if before and before[0] == condition["status"]:
            moment = before[1]
        else:
            moment = timestamp(now)
            memory[condition["type"]] = (condition["status"], moment)
        out.append({**condition, "lastTransitionTime": moment})
    return out


def transition_memory(pod: dict) -> dict[str, tuple[str, str]]:
    """The transition times an observed pod carries, to start `with_transition_times` from."""
    return {
        c["type"]: (c.get("status", ""), c["lastTransitionTime"])
        for c in (pod.get("status") or {}).get("conditions") or []
        if c.get("lastTransitionTime")
    }


def status_patch(
    pod: dict, view: PodView, now: dt.datetime, memory: dict[str, tuple[str, str]]
) -> dict:
    """The strategic merge patch for pods/status (guarded by the pod's uid)."""
    phase = pod_phase(view)
    status = {
        "phase": phase,
        "hostIP": view.host_ip,
        "hostIPs": [{"ip": view.host_ip}],
        "startTime": view.start_time,
        "conditions": with_transition_times(owned_conditions(pod, view, phase), memory, now),
        "containerStatuses": [c.to_status() for c in view.containers],
    }
    if view.pod_ip:
        status["podIP"] = view.pod_ip
        status["podIPs"] = [{"ip": view.pod_ip}]
    if view.init_containers:
        status["initContainerStatuses"] = [c.to_status() for c in view.init_containers]
    return {"metadata": {"uid": pod["metadata"]["uid"]}, "status": status}


def is_ready(patch: dict) -> bool:
    return any(
        c["type"] == "Ready" and c["status"] == "True" for c in patch["status"]["conditions"]
    )
