"""Pure builders: an EmbeddingService spec in, the desired child objects out.

No I/O and no clock: the same spec always gives the same objects, so the apply layer can skip
writes that would change nothing and the pod template changes only when the spec really does.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kubernetes.utils import parse_quantity

from warmgate_contract.flags import BY_DEST, render_args
from warmgate_contract.names import (
    API_VERSION,
    APP_NAME,
    INSTANCE_LABEL,
    KIND,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    MODEL_ID_ANNOTATION,
    MODEL_REVISION_ANNOTATION,
    NAME_LABEL,
    PROFILE_DIR,
    PROFILE_KEY,
    PROFILE_PATH,
    ROLE_LABEL,
    ROLE_SERVING,
    SERVER_CONTAINER,
    SERVER_PORT,
    SERVER_PORT_NAME,
    SERVICE_LABEL,
    SPEC_HASH_ANNOTATION,
    WARMED_CONDITION,
)
from warmgate_contract.report import ProfileEntry, render_profile
from warmgate_contract.shapes import Shape

from .spec import EmbeddingServiceSpec

SERVER_USER_ID = 10001
PRESTOP_SLEEP_SECONDS = 5
# Time the server may take after its drain to flush logs and exit, on top of preStop + drain.
EXIT_MARGIN_SECONDS = 10

CACHE_DIR = "/var/cache/warmgate"
MODELS_DIR = "/var/lib/warmgate/models"
# The hub source's Hugging Face cache: in the per-pod cache emptyDir, or on the cache claim.
HF_CACHE_DIR = f"{CACHE_DIR}/huggingface"
HF_CLAIM_DIR = "/var/lib/warmgate/huggingface"
COMPILE_CACHE_DIR = f"{CACHE_DIR}/compiled"
WARM_STATE_DIR = f"{CACHE_DIR}/warm-state"
"""What a restart reuses instead of reading or measuring it again (the server's --warm-state): in
the cache emptyDir, or on a claim mounted there to share it with the next pods of the model."""
"""Where --backend onnxruntime keeps its export: in the cache emptyDir, or on a claim a user
mounts there (spec.volumeMounts) to share it between pods and rollouts of the same model."""

DEFAULT_REQUESTS = {"cpu": "500m", "memory": "1536Mi"}
DEFAULT_MEMORY_LIMIT = "1536Mi"
"""Sized from measurement (docs/benchmarks.md, "What a CPU needs warmed, and what its memory
guard counts"): MiniLM with the default plan (1, 8, 32 x 32 to 256 tokens, two workers) needs
1.1-1.2 GiB as the server's guard counts it (anonymous memory, the model's files, 128 MiB of
code; 1.29 GB resident with the CUDA build of torch), and its budget here is 1.35 GiB (the limit
less 10%); tests/server/test_memory.py starts that pod 30 times under this limit. Past the
limit a plan is refused or fitted by the server (warmup.memoryPolicy), not killed; bigger
models need more, and their pods say how much."""
# The server container's imagePullPolicy when neither the spec nor the operator's
# --server-image-pull-policy says otherwise.
DEFAULT_PULL_POLICY = "IfNotPresent"

# The startup probe's budget when the spec leaves probes.startupTimeoutSeconds unset: three times
# the slowest start measured (status.startupSeconds), in whole minutes, from 2 minutes to an hour;
# 10 minutes until a pod has been measured.
UNMEASURED_STARTUP_BUDGET = 600
MIN_STARTUP_BUDGET = 120
MAX_STARTUP_BUDGET = 3600
STARTUP_BUDGET_FACTOR = 3


@dataclass(frozen=True)
class Owner:
    """The EmbeddingService the children belong to."""

    name: str
    namespace: str
    uid: str

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Owner:
        meta = body["metadata"]
        return cls(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])


def labels(name: str) -> dict[str, str]:
    return {
        NAME_LABEL: APP_NAME,
        INSTANCE_LABEL: name,
        MANAGED_BY_LABEL: MANAGED_BY,
        SERVICE_LABEL: name,
    }


def selector_labels(name: str) -> dict[str, str]:
    return {NAME_LABEL: APP_NAME, INSTANCE_LABEL: name}


def serving_labels(name: str, standby_pool: bool) -> dict[str, str]:
    """The labels of the pods that take traffic: the Service's selector, and the scale
    subresource's (which the HPA averages its metrics over). With a standby pool, serving
    pods only (the role the operator gives each Ready pod, roles.py)."""
    chosen = selector_labels(name)
    if standby_pool:
        chosen[ROLE_LABEL] = ROLE_SERVING
    return chosen


def selector_string(name: str, standby_pool: bool = False) -> str:
    """`status.selector`, as the scale subresource wants it."""
    return ",".join(f"{k}={v}" for k, v in sorted(serving_labels(name, standby_pool).items()))


def configmap_name(name: str) -> str:
    return f"{name}-warmup-profile"


def content_hash(obj: Any) -> str:
    """A short, stable hash of a JSON-able value."""
    canonical = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _metadata(owner: Owner, name: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": labels(owner.name),
        "ownerReferences": [
            {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "name": owner.name,
                "uid": owner.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ],
    }


def model_path(spec: EmbeddingServiceSpec) -> str:
    """What `--model` gets: the hub id (the hub source, a claim holding a Hugging Face cache,
    a model baked into the image's cache), or a folder (on a claim, in an image volume, in
    the server image)."""
    source = spec.model.source
    if source.volume is not None and source.volume.layout == "folder":
        return f"{MODELS_DIR}/{source.volume.path}".rstrip("/")
    if source.image is not None:
        return f"{MODELS_DIR}/{source.image.path}".rstrip("/")
    if source.baked is not None and source.baked.path:
        return source.baked.path
    return spec.model.id


def model_source_parts(
    spec: EmbeddingServiceSpec, hub_endpoint: str | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(env, volume mounts, volumes) that give the server its model's files.

    The hub source lets the server download (HF_HUB_OFFLINE=0) into a Hugging Face cache:
    the pod's cache emptyDir, or a claim the pods share; `hub_endpoint` (the operator's
    --hub-endpoint) stands in when the spec names no endpoint. Every other source is read
    offline: a claim (a model folder, or a Hugging Face cache), an image volume, the image.
    """
    source = spec.model.source
    env: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    volumes: list[dict[str, Any]] = []
    offline = "1"
    if source.kind == "hub":
        hub = source.hub
        offline = "1" if hub.offline else "0"
        home = HF_CACHE_DIR
        if hub.cache_claim_name:
            home = HF_CLAIM_DIR
            mounts.append({"name": "model", "mountPath": HF_CLAIM_DIR})
            volumes.append(
                {"name": "model", "persistentVolumeClaim": {"claimName": hub.cache_claim_name}}
            )
        env.append({"name": "HF_HOME", "value": home})
        endpoint = hub.endpoint or hub_endpoint
        if endpoint:
            env.append({"name": "HF_ENDPOINT", "value": endpoint})
        if hub.token_secret:
            ref = {"name": hub.token_secret, "key": hub.token_key}
            env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": ref}})
        # The server logs its own progress (and /ready counts the bytes): no progress bars.
        env.append({"name": "HF_HUB_DISABLE_PROGRESS_BARS", "value": "1"})
        env.append({"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"})
    elif source.volume is not None:
        mounts.append({"name": "model", "mountPath": MODELS_DIR, "readOnly": True})
        claim = {"claimName": source.volume.claim_name, "readOnly": True}
        volumes.append({"name": "model", "persistentVolumeClaim": claim})
        if source.volume.layout == "hubCache":
            home = f"{MODELS_DIR}/{source.volume.path}".rstrip("/")
            env.append({"name": "HF_HOME", "value": home})
    elif source.image is not None:
        mounts.append({"name": "model", "mountPath": MODELS_DIR, "readOnly": True})
        image = {"reference": source.image.reference, "pullPolicy": source.image.pull_policy}
        volumes.append({"name": "model", "image": image})
    env.append({"name": "HF_HUB_OFFLINE", "value": offline})
    return env, mounts, volumes


LEFT_OUT_AT_DEFAULT = ("packing", "cuda_graphs", "backend", "memory_policy")
"""Server flags written only when they differ from the server's default: the ones added after
pods were running, so that an operator upgrade changes no pod template (and rolls no pod). The
others are written always, as they always were; leaving them out too would roll every pod once,
and let a `WARMGATE_*` variable in spec.env win over what the spec says."""


def server_args(spec: EmbeddingServiceSpec) -> list[str]:
    """The server's flags (the contract's table), one `--flag=value` item each."""
    model, batching, warmup = spec.model, spec.batching, spec.warmup
    return render_args(
        {
            "model": model_path(spec),
            "model_revision": model.revision,
            # A model read from a folder is still called by its id, whatever the folder.
            "served_model_name": model.served_name
            or (model.id if model_path(spec) != model.id else None),
            "port": SERVER_PORT,
            "device": spec.runtime.device,
            "dtype": spec.runtime.dtype,
            "pooling": model.pooling,
            "normalize": model.normalize,
            "max_input_length": model.max_input_length,
            "auto_truncate": model.auto_truncate,
            # Unset is the server's default (a folder with custom code is refused, asking).
            "trust_remote_code": model.trust_remote_code,
            # auto is the server's default: it reads the task from the model's folder.
            "task": None if model.task == "auto" else model.task,
            "openai_token_ids": model.openai_token_ids,
            "default_prompt_name": model.default_prompt_name,
            "default_prompt": model.default_prompt,
            "packing": spec.runtime.packing,
            "cuda_graphs": spec.runtime.cuda_graphs,
            "backend": spec.runtime.backend,
            # The export kept in the pod's cache emptyDir: a restarted container (killed, or
            # restarted by its liveness probe) opens it instead of exporting again.
            "compile_cache": COMPILE_CACHE_DIR if spec.runtime.backend == "onnxruntime" else None,
            # What a restarted container reuses (the weights' digest, the linear kernels
            # measured at load), in the same emptyDir: warm_state.py.
            "warm_state": WARM_STATE_DIR,
            "tokenization_workers": spec.runtime.tokenization_workers,
            "max_batch_size": batching.max_batch_size,
            "max_client_batch_size": batching.max_client_batch_size,
            "max_batch_tokens": batching.max_batch_tokens,
            "max_wait_ms": batching.max_wait_milliseconds,
            "max_concurrent_requests": batching.max_concurrent_requests,
            "payload_limit": batching.payload_limit_bytes,
            "sequence_buckets": warmup.sequence_buckets,
            "warmup_batch_sizes": warmup.batch_sizes,
            "warmup_profile": PROFILE_PATH,
            "pad_batch": batching.pad_batch,
            "warmup": warmup.enabled,
            "memory_policy": warmup.memory_policy,
            "warmup_cpus": warmup_cpus(spec),
            "drain_seconds": spec.rollout.drain_seconds,
            "request_timeout": batching.request_timeout_seconds,
            "body_timeout": batching.body_timeout_seconds,
            "forward_timeout": spec.probes.forward_timeout_seconds,
            "fault_threshold": spec.probes.fault_threshold,
            "fault_restart_seconds": spec.probes.fault_restart_seconds,
        },
        leave_out_defaults=LEFT_OUT_AT_DEFAULT,
    )


def resources(spec: EmbeddingServiceSpec) -> dict[str, dict[str, str]]:
    """The user's resources, with CPU/memory requests filled in (the HPA's CPU target needs a
    CPU request), a memory limit when none was given (so a pod's warmup is measured against
    one, and a plan too big is refused or fitted rather than running the node out of memory),
    and a GPU limit when the device is cuda and none was given: the request's count, else one."""
    limits = dict(spec.resources.get("limits", {}))
    requests = dict(spec.resources.get("requests", {}))
    memory_given = "memory" in requests or "memory" in limits
    for key, value in DEFAULT_REQUESTS.items():
        if key not in requests and key not in limits:
            requests[key] = value
    if not memory_given:
        limits["memory"] = DEFAULT_MEMORY_LIMIT
    if spec.runtime.device == "cuda" and "nvidia.com/gpu" not in limits:
        # An extended resource's limit must equal its request: a GPU request alone sets it.
        limits["nvidia.com/gpu"] = str(requests.get("nvidia.com/gpu", "1"))
    out: dict[str, dict[str, str]] = {"requests": requests}
    if limits:
        out["limits"] = limits
    return out


def warmup_cpus(spec: EmbeddingServiceSpec) -> float | None:
    """The CPUs a pod's warmup may use on average: its CPU request (a request left out is the
    limit's, as Kubernetes fills it in), so that a warming pod without a CPU limit does not take
    the node's idle cores from the pods serving beside it (server: pacing.py). None on a GPU,
    whose warmup waits on the device, not the CPUs, and unless `warmup.pace: request` (the
    default is none: a scale-out under load is exactly when the node is busy, and a new pod
    held to 100m took 49.5 s to warm 4 shapes instead of 5, its capacity late by as much)."""
    if spec.runtime.device != "cpu" or spec.warmup.pace != "request":
        return None
    given = resources(spec)
    cpu = given["requests"].get("cpu") or given.get("limits", {}).get("cpu")
    try:
        cores = float(parse_quantity(cpu)) if cpu is not None else 0.0
    except (ValueError, ArithmeticError):  # the CRD's schema admits quantities only
        return None
    return cores if cores > 0 else None


def measured_startup_budget(startup_seconds: float | None) -> int:
    """The budget a measured start calls for (see STARTUP_BUDGET_FACTOR)."""
    if startup_seconds is None:
        return UNMEASURED_STARTUP_BUDGET
    minutes = math.ceil(startup_seconds * STARTUP_BUDGET_FACTOR / 60)
    return min(MAX_STARTUP_BUDGET, max(MIN_STARTUP_BUDGET, minutes * 60))


def live_startup_budget(deployment: Mapping[str, Any] | None) -> int | None:
    """The budget a live Deployment's pods run with (failureThreshold x periodSeconds)."""
    spec = ((deployment or {}).get("spec") or {}).get("template", {}).get("spec") or {}
    for container in spec.get("containers") or []:
        probe = container.get("startupProbe") if container.get("name") == SERVER_CONTAINER else None
        if probe and probe.get("failureThreshold") and probe.get("periodSeconds"):
            return int(probe["failureThreshold"]) * int(probe["periodSeconds"])
    return None


def startup_budget(
    spec: EmbeddingServiceSpec,
    owner: Owner,
    default_image: str,
    image_pull_secrets: Sequence[str],
    startup_seconds: float | None,
    live: Mapping[str, Any] | None,
    hub_endpoint: str | None = None,
    default_pull_policy: str = DEFAULT_PULL_POLICY,
) -> int:
    """The startup probe's budget in seconds: the spec's, or sized from the measured start.

    The budget is part of the pod template, and a template change rolls every pod, so a
    measurement alone only raises it (pods close to being killed must not wait) and is otherwise
    taken at the next rollout for another reason: a new model, image or setting.
    """
    if spec.probes.startup_timeout_seconds is not None:
        return spec.probes.startup_timeout_seconds
    wanted = measured_startup_budget(startup_seconds)
    if spec.rollout.progress_deadline_seconds is not None:
        # The Deployment must not be declared failed while its pods may still warm: whole probe
        # periods that end before the deadline.
        period = spec.probes.period_seconds
        within = (spec.rollout.progress_deadline_seconds - 1) // period * period
        wanted = max(period, min(wanted, within))
    current = live_startup_budget(live)
    if current is None or wanted >= current:
        return wanted
    kept = build_pod_template(
        spec, owner, default_image, image_pull_secrets, current, hub_endpoint, default_pull_policy
    )
    live_hash = (live or {})["spec"]["template"]["metadata"].get("annotations", {})
    if kept["metadata"]["annotations"][SPEC_HASH_ANNOTATION] == live_hash.get(SPEC_HASH_ANNOTATION):
        return current
    return wanted


def termination_grace_seconds(spec: EmbeddingServiceSpec) -> int:
    return PRESTOP_SLEEP_SECONDS + spec.rollout.drain_seconds + EXIT_MARGIN_SECONDS


def _probe(path: str, period: int, failure_threshold: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": SERVER_PORT_NAME, "scheme": "HTTP"},
        "periodSeconds": period,
        "timeoutSeconds": 2,
        "successThreshold": 1,
        "failureThreshold": failure_threshold,
    }


def build_pod_template(
    spec: EmbeddingServiceSpec,
    owner: Owner,
    default_image: str,
    image_pull_secrets: Sequence[str] = (),
    startup_budget_seconds: int = UNMEASURED_STARTUP_BUDGET,
    hub_endpoint: str | None = None,
    default_pull_policy: str = DEFAULT_PULL_POLICY,
) -> dict[str, Any]:
    """The server pods' template. `image_pull_secrets` (the operator's
    `--server-image-pull-secret`) are Secret names in the EmbeddingService's namespace;
    `startup_budget_seconds` is what `startup_budget` chose; `default_pull_policy` (the
    operator's `--server-image-pull-policy`) serves when the spec sets no imagePullPolicy."""
    period = spec.probes.period_seconds
    container: dict[str, Any] = {
        "name": SERVER_CONTAINER,
        "image": spec.image or default_image,
        "imagePullPolicy": spec.image_pull_policy or default_pull_policy,
        "args": server_args(spec),
        "env": [
            # Binds to the pod's own address (the --host flag's environment twin).
            {"name": BY_DEST["host"].env, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {
                "name": "POD_NAMESPACE",
                "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
            },
            # Caches (torch, Hugging Face modules) go to a writable emptyDir; a model baked into
            # the image under its own HF_HOME stays visible.
            {"name": "XDG_CACHE_HOME", "value": CACHE_DIR},
        ],
        "ports": [{"name": SERVER_PORT_NAME, "containerPort": SERVER_PORT, "protocol": "TCP"}],
        "resources": resources(spec),
        # Liveness only asks whether the event loop answers; it never fails a warming pod.
        "livenessProbe": _probe("/healthz", 10, 3),
        "readinessProbe": _probe("/ready", period, 2),
        # Holds liveness off until warm, and bounds a warmup that never ends.
        "startupProbe": _probe(
            "/started", period, spec.probes.startup_failure_threshold(startup_budget_seconds)
        ),
        "lifecycle": {
            # Lets endpoint removal reach every proxy before the server starts draining.
            "preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_SECONDS)]}}
        },
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "runAsUser": SERVER_USER_ID,
            "runAsGroup": SERVER_USER_ID,
        },
        "volumeMounts": [
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "cache", "mountPath": CACHE_DIR},
            {"name": "warmup-profile", "mountPath": PROFILE_DIR, "readOnly": True},
        ],
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    volumes: list[dict[str, Any]] = [
        {"name": "tmp", "emptyDir": {}},
        {"name": "cache", "emptyDir": {}},
        {
            "name": "warmup-profile",
            # optional: a pod may start before its ConfigMap exists; a missing profile is fine.
            "configMap": {"name": configmap_name(owner.name), "optional": True},
        },
    ]
    model_env, model_mounts, model_volumes = model_source_parts(spec, hub_endpoint)
    container["env"] += model_env
    container["volumeMounts"] += model_mounts
    volumes += model_volumes
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": SERVER_USER_ID,
            "runAsGroup": SERVER_USER_ID,
            "fsGroup": SERVER_USER_ID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
        "containers": [container],
        "volumes": volumes,
    }
    if image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": name} for name in image_pull_secrets]
    if spec.rollout.warm_gate:
        pod_spec["readinessGates"] = [{"conditionType": WARMED_CONDITION}]
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    # Placement and extras as the user wrote them; warmgate's own labels, annotations, env and
    # volumes come first and cannot be replaced (the selector and the gate rely on them).
    if spec.tolerations:
        pod_spec["tolerations"] = [dict(item) for item in spec.tolerations]
    if spec.affinity:
        pod_spec["affinity"] = dict(spec.affinity)
    if spec.priority_class_name:
        pod_spec["priorityClassName"] = spec.priority_class_name
    container["env"] += [dict(item) for item in spec.env]
    container["volumeMounts"] += [dict(item) for item in spec.volume_mounts]
    volumes += [dict(item) for item in spec.volumes]
    template: dict[str, Any] = {
        "metadata": {
            "labels": {**spec.pod_labels, **labels(owner.name)},
            "annotations": {
                **spec.pod_annotations,
                MODEL_ID_ANNOTATION: spec.model.id,
                MODEL_REVISION_ANNOTATION: spec.model.revision,
                "kubectl.kubernetes.io/default-container": SERVER_CONTAINER,
            },
        },
        "spec": pod_spec,
    }
    template["metadata"]["annotations"][SPEC_HASH_ANNOTATION] = content_hash(template)
    return template


def build_deployment(
    spec: EmbeddingServiceSpec,
    owner: Owner,
    default_image: str,
    image_pull_secrets: Sequence[str] = (),
    startup_budget_seconds: int = UNMEASURED_STARTUP_BUDGET,
    hub_endpoint: str | None = None,
    default_pull_policy: str = DEFAULT_PULL_POLICY,
) -> dict[str, Any]:
    deployment_spec: dict[str, Any] = {
        "selector": {"matchLabels": selector_labels(owner.name)},
        "strategy": {
            "type": "RollingUpdate",
            "rollingUpdate": {
                "maxSurge": spec.rollout.max_surge,
                "maxUnavailable": spec.rollout.max_unavailable,
            },
        },
        "progressDeadlineSeconds": spec.progress_deadline_seconds(startup_budget_seconds),
        "revisionHistoryLimit": 5,
        "template": build_pod_template(
            spec,
            owner,
            default_image,
            image_pull_secrets,
            startup_budget_seconds,
            hub_endpoint,
            default_pull_policy,
        ),
    }
    # Serving pods (spec.replicas, which the HPA sets through the EmbeddingService's scale
    # subresource when autoscaling is on) and the standby pool.
    deployment_spec = {"replicas": spec.pod_replicas, **deployment_spec}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(owner, owner.name),
        "spec": deployment_spec,
    }


def build_service(spec: EmbeddingServiceSpec, owner: Owner) -> dict[str, Any]:
    port: dict[str, Any] = {
        "name": SERVER_PORT_NAME,
        "port": spec.service.port,
        "targetPort": SERVER_PORT_NAME,
        "protocol": "TCP",
    }
    if spec.service.node_port is not None:
        port["nodePort"] = spec.service.node_port
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(owner, owner.name),
        "spec": {
            "type": spec.service.type,
            "selector": serving_labels(owner.name, spec.standby_replicas > 0),
            "ports": [port],
        },
    }


def _scaling_rules(rules: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"stabilizationWindowSeconds": rules.stabilization_window_seconds}
    policies = []
    if rules.max_pods_per_period is not None:
        policies.append(
            {
                "type": "Pods",
                "value": rules.max_pods_per_period,
                "periodSeconds": rules.period_seconds,
            }
        )
    if rules.max_percent_per_period is not None:
        policies.append(
            {
                "type": "Percent",
                "value": rules.max_percent_per_period,
                "periodSeconds": rules.period_seconds,
            }
        )
    if policies:
        out["policies"] = policies
        out["selectPolicy"] = "Max"
    return out


def build_hpa(spec: EmbeddingServiceSpec, owner: Owner) -> dict[str, Any] | None:
    """The HPA, or None when autoscaling is off (the apply layer then deletes it)."""
    autoscaling = spec.autoscaling
    if not autoscaling.enabled:
        return None
    metrics: list[dict[str, Any]] = []
    if autoscaling.target_cpu_utilization_percentage is not None:
        metrics.append(
            {
                "type": "Resource",
                "resource": {
                    "name": "cpu",
                    "target": {
                        "type": "Utilization",
                        "averageUtilization": autoscaling.target_cpu_utilization_percentage,
                    },
                },
            }
        )
    if autoscaling.pods_metric is not None:
        metrics.append(
            {
                "type": "Pods",
                "pods": {
                    "metric": {"name": autoscaling.pods_metric.name},
                    "target": {
                        "type": "AverageValue",
                        "averageValue": autoscaling.pods_metric.average_value,
                    },
                },
            }
        )
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _metadata(owner, owner.name),
        "spec": {
            # The EmbeddingService, not the Deployment: its scale subresource counts serving
            # pods and selects them only, so idle standby pods neither dilute the metrics nor
            # count as capacity; the operator sizes the Deployment as serving + standby.
            "scaleTargetRef": {"apiVersion": API_VERSION, "kind": KIND, "name": owner.name},
            # An HPA cannot scale to or from zero: it owns 1..max, and at 0 replicas of its
            # target it stops acting (ScalingDisabled) until warmgate-router sets 1 again.
            "minReplicas": max(1, autoscaling.min_replicas),
            "maxReplicas": autoscaling.max_replicas,
            "metrics": metrics,
            "behavior": {
                "scaleUp": _scaling_rules(autoscaling.scale_up),
                "scaleDown": _scaling_rules(autoscaling.scale_down),
            },
        },
    }


def build_pdb(spec: EmbeddingServiceSpec, owner: Owner) -> dict[str, Any] | None:
    """A disruption budget when more than one pod runs, else None (a budget on one pod would
    block every node drain)."""
    if not spec.disruption_budget.enabled or spec.min_pods <= 1:
        return None
    pdb_spec: dict[str, Any] = {"selector": {"matchLabels": selector_labels(owner.name)}}
    if spec.disruption_budget.min_available is not None:
        pdb_spec["minAvailable"] = spec.disruption_budget.min_available
    else:
        pdb_spec["maxUnavailable"] = 1
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(owner, owner.name),
        "spec": pdb_spec,
    }


def warmup_profile(observed_shapes: Iterable[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """The profile file's JSON (the contract's format), most frequent shapes first."""
    return render_profile(
        ProfileEntry(Shape.from_json(item), int(item.get("count", 0))) for item in observed_shapes
    )


def build_configmap(
    spec: EmbeddingServiceSpec, owner: Owner, observed_shapes: Iterable[Mapping[str, Any]] = ()
) -> dict[str, Any]:
    """The warmup profile new pods read at start. Its content never enters the pod template,
    so updating it never restarts running pods."""
    shapes = list(observed_shapes) if spec.warmup.observed_traffic.enabled else []
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(owner, configmap_name(owner.name)),
        "data": {PROFILE_KEY: json.dumps(warmup_profile(shapes), sort_keys=True)},
    }


@dataclass(frozen=True)
class DesiredChildren:
    """Every child kind, None where that child must not exist."""

    configmap: dict[str, Any]
    deployment: dict[str, Any]
    service: dict[str, Any]
    hpa: dict[str, Any] | None
    pdb: dict[str, Any] | None


def build_children(
    spec: EmbeddingServiceSpec,
    owner: Owner,
    default_image: str,
    observed_shapes: Iterable[Mapping[str, Any]] = (),
    image_pull_secrets: Sequence[str] = (),
    startup_seconds: float | None = None,
    live_deployment: Mapping[str, Any] | None = None,
    hub_endpoint: str | None = None,
    default_pull_policy: str = DEFAULT_PULL_POLICY,
) -> DesiredChildren:
    """Every child; `default_image` serves when the spec names no image, and its pods pull it
    with `image_pull_secrets` as `default_pull_policy` says, unless the spec sets a policy.
    `startup_seconds` (status.startupSeconds) and the live Deployment size the startup probe
    when the spec does not (`startup_budget`)."""
    budget = startup_budget(
        spec,
        owner,
        default_image,
        image_pull_secrets,
        startup_seconds,
        live_deployment,
        hub_endpoint,
        default_pull_policy,
    )
    return DesiredChildren(
        configmap=build_configmap(spec, owner, observed_shapes),
        deployment=build_deployment(
            spec,
            owner,
            default_image,
            image_pull_secrets,
            budget,
            hub_endpoint,
            default_pull_policy,
        ),
        service=build_service(spec, owner),
        hpa=build_hpa(spec, owner),
        pdb=build_pdb(spec, owner),
    )
