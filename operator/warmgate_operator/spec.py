"""The EmbeddingService spec as typed, frozen values, with the CRD's defaults.

The apiserver already applies the CRD schema's defaults; parsing applies the same defaults again
so that the builders never see a missing field (an object stored before a default was added, or a
unit test that writes a minimal spec). `tests/operator/test_crd.py` checks that the two agree.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from warmgate_contract import flags
from warmgate_contract.names import ROLE_LABEL

# The server's values (the contract's), less `auto` for the device and dtype: the operator
# decides them before the pod exists (a cuda pod requests a GPU; float16 needs cuda).
DEVICES = tuple(value for value in flags.DEVICES if value != "auto")
DTYPES = tuple(value for value in flags.DTYPES if value != "auto")
POOLINGS = flags.POOLINGS
TOKEN_ID_KINDS = flags.TOKEN_ID_KINDS
PACKINGS = flags.PACKINGS
BACKENDS = flags.BACKENDS
ONNXRUNTIME_NEEDS = (
    "spec.runtime.backend onnxruntime runs padded float32 passes on the CPU: "
    "it needs runtime.device cpu, runtime.dtype float32 and runtime.packing auto or off"
)
CUDA_GRAPHS = flags.CUDA_GRAPHS
MEMORY_POLICIES = flags.MEMORY_POLICIES
SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer")
PULL_POLICIES = ("IfNotPresent", "Always", "Never")
# The server pods' own volumes (builders.py): spec.volumes may not reuse these names.
RESERVED_VOLUMES = ("tmp", "cache", "warmup-profile", "model")


class SpecError(ValueError):
    """The spec cannot be turned into objects; the message names the field and what to change."""


SOURCES = ("hub", "volume", "image", "baked")
VOLUME_LAYOUTS = ("folder", "hubCache")


@dataclass(frozen=True)
class HubSource:
    """Downloaded by the pod from a Hugging Face hub (or a mirror) into its cache volume."""

    endpoint: str | None = None
    """HF_ENDPOINT; None: the operator's --hub-endpoint, else huggingface.co."""
    token_secret: str | None = None
    token_key: str = "token"
    cache_claim_name: str | None = None
    """A PersistentVolumeClaim for the cache (shared by the pods); None: an emptyDir per pod."""
    offline: bool = False
    """Only the cache claim: never ask the hub."""


@dataclass(frozen=True)
class VolumeSource:
    """A model read from a PersistentVolumeClaim: a plain model folder, or a Hugging Face
    cache (`hubCache`, resolved offline by id and revision)."""

    claim_name: str
    path: str = ""
    layout: str = "folder"


@dataclass(frozen=True)
class ImageSource:
    """An OCI image holding the model's files, mounted as an image volume."""

    reference: str
    pull_policy: str = "IfNotPresent"
    path: str = ""


@dataclass(frozen=True)
class BakedSource:
    """The model is in the server image: a folder (path), or the image's own Hugging Face cache
    (no path: the id and revision resolve offline from HF_HOME)."""

    path: str | None = None


@dataclass(frozen=True)
class ModelSource:
    kind: str = "hub"
    hub: HubSource = field(default_factory=HubSource)
    volume: VolumeSource | None = None
    image: ImageSource | None = None
    baked: BakedSource | None = None


@dataclass(frozen=True)
class ModelSpec:
    id: str
    revision: str = "main"
    served_name: str | None = None
    # None: the server follows the model folder's own sentence-transformers configuration.
    pooling: str | None = None
    normalize: bool | None = None
    max_input_length: int | None = None
    auto_truncate: bool = False
    trust_remote_code: bool | None = None
    """Unset: a model folder that points at custom code is refused, naming both choices."""
    openai_token_ids: str = "cl100k_base"
    default_prompt_name: str | None = None
    default_prompt: str | None = None
    source: ModelSource = field(default_factory=ModelSource)


@dataclass(frozen=True)
class RuntimeSpec:
    device: str = "cpu"
    dtype: str = "float32"
    packing: str = "auto"
    cuda_graphs: str = "auto"
    tokenization_workers: int | None = None
    backend: str = "torch"


@dataclass(frozen=True)
class BatchingSpec:
    max_batch_size: int = 32
    max_batch_tokens: int = 16384
    max_wait_milliseconds: int = 2
    max_client_batch_size: int = 2048
    max_concurrent_requests: int = 512
    payload_limit_bytes: int = 2_000_000
    pad_batch: bool = True
    request_timeout_seconds: int = 60
    body_timeout_seconds: int = 15


@dataclass(frozen=True)
class ObservedTrafficSpec:
    enabled: bool = True
    max_shapes: int = 16
    refresh_seconds: int = 300


@dataclass(frozen=True)
class WarmupSpec:
    enabled: bool = True
    batch_sizes: tuple[int, ...] = (1, 8, 32)
    sequence_buckets: tuple[int, ...] = (32, 64, 128, 256)
    memory_policy: str = "refuse"
    pace: str = "none"
    """request: while the node is busy the warmup uses on average the pod's CPU request
    (builders.warmup_cpus); none (the default): unpaced."""
    observed_traffic: ObservedTrafficSpec = field(default_factory=ObservedTrafficSpec)


@dataclass(frozen=True)
class ProbesSpec:
    # None: sized from the measured startup (builders.startup_budget).
    startup_timeout_seconds: int | None = None
    period_seconds: int = 5
    forward_timeout_seconds: int = 30
    fault_threshold: int = 3
    fault_restart_seconds: int = 30

    def startup_failure_threshold(self, budget_seconds: int) -> int:
        """How many failed startup probes a pod may take, loading and warming, before the
        kubelet restarts it: the whole budget, in probe periods."""
        return max(1, math.ceil(budget_seconds / self.period_seconds))


@dataclass(frozen=True)
class RolloutSpec:
    max_surge: int = 1
    max_unavailable: int = 0
    warm_gate: bool = True
    verify_latency: bool = False
    drain_seconds: int = 15
    progress_deadline_seconds: int | None = None


@dataclass(frozen=True)
class ScalingRules:
    """One direction of the HPA's `behavior`."""

    stabilization_window_seconds: int
    max_pods_per_period: int | None = None
    max_percent_per_period: int | None = None
    period_seconds: int = 60


@dataclass(frozen=True)
class PodsMetric:
    name: str
    average_value: str


@dataclass(frozen=True)
class ScaleToZeroSpec:
    """Scale to zero after `idle_seconds` without a request (idle.py decides)."""

    idle_seconds: int = 300


@dataclass(frozen=True)
class AutoscalingSpec:
    enabled: bool = False
    min_replicas: int = 1
    """0 only with `scale_to_zero`: the HPA itself keeps at least 1 (builders.build_hpa)."""
    max_replicas: int = 4
    target_cpu_utilization_percentage: int | None = 70
    pods_metric: PodsMetric | None = None
    scale_up: ScalingRules = field(
        default_factory=lambda: ScalingRules(stabilization_window_seconds=0)
    )
    scale_down: ScalingRules = field(
        default_factory=lambda: ScalingRules(stabilization_window_seconds=300)
    )
    scale_to_zero: ScaleToZeroSpec | None = None


@dataclass(frozen=True)
class DisruptionBudgetSpec:
    enabled: bool = True
    min_available: int | None = None


@dataclass(frozen=True)
class ServiceSpec:
    type: str = "ClusterIP"
    port: int = 80
    node_port: int | None = None


@dataclass(frozen=True)
class EmbeddingServiceSpec:
    model: ModelSpec
    image: str | None = None
    image_pull_policy: str | None = None
    """None: the operator's --server-image-pull-policy."""
    replicas: int = 1
    standby_replicas: int = 0
    """Pods kept loaded, warmed and verified but outside the Service, promoted first on a
    scale-out (roles.py)."""
    runtime: RuntimeSpec = field(default_factory=RuntimeSpec)
    resources: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    batching: BatchingSpec = field(default_factory=BatchingSpec)
    warmup: WarmupSpec = field(default_factory=WarmupSpec)
    probes: ProbesSpec = field(default_factory=ProbesSpec)
    rollout: RolloutSpec = field(default_factory=RolloutSpec)
    autoscaling: AutoscalingSpec = field(default_factory=AutoscalingSpec)
    disruption_budget: DisruptionBudgetSpec = field(default_factory=DisruptionBudgetSpec)
    service: ServiceSpec = field(default_factory=ServiceSpec)
    node_selector: Mapping[str, str] = field(default_factory=dict)
    # Placement and pod metadata, passed through to the pod template as given.
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] = field(default_factory=dict)
    priority_class_name: str | None = None
    pod_labels: Mapping[str, str] = field(default_factory=dict)
    pod_annotations: Mapping[str, str] = field(default_factory=dict)
    env: tuple[Mapping[str, Any], ...] = ()
    volumes: tuple[Mapping[str, Any], ...] = ()
    volume_mounts: tuple[Mapping[str, Any], ...] = ()

    def progress_deadline_seconds(self, startup_budget_seconds: int) -> int:
        """The rollout's deadline: explicit, or the startup budget plus ten minutes."""
        if self.rollout.progress_deadline_seconds is not None:
            return self.rollout.progress_deadline_seconds
        return startup_budget_seconds + 600

    @property
    def serving_replicas(self) -> int:
        """Pods that serve: spec.replicas (which the HPA sets through the scale subresource
        while autoscaling is on, kept within its bounds here)."""
        if self.autoscaling.enabled:
            low, high = self.autoscaling.min_replicas, self.autoscaling.max_replicas
            return max(low, min(high, self.replicas))
        return self.replicas

    @property
    def scaled_to_zero(self) -> bool:
        """Idle at zero (autoscaling.scaleToZero and spec.replicas 0): no pod runs."""
        return self.autoscaling.scale_to_zero is not None and self.serving_replicas == 0

    @property
    def pod_replicas(self) -> int:
        """The Deployment's replicas: serving pods and the standby pool; none at all while
        scaled to zero (a warm pool for a service nobody calls is what scaling to zero saves)."""
        if self.scaled_to_zero:
            return 0
        return self.serving_replicas + self.standby_replicas

    @property
    def min_pods(self) -> int:
        """The fewest pods this service runs, which decides whether a disruption budget helps."""
        if self.autoscaling.enabled:
            return self.autoscaling.min_replicas
        return self.replicas


def _get(raw: Mapping[str, Any], key: str, default: Any) -> Any:
    value = raw.get(key)
    return default if value is None else value


def _section(raw: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = raw.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SpecError(f"spec.{key} must be an object")
    return value


def _int(raw: Mapping[str, Any], key: str, default: Any, where: str) -> Any:
    value = _get(raw, key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{where}.{key} must be an integer, got {value!r}")
    return value


def _items(raw: Mapping[str, Any], key: str) -> tuple[Mapping[str, Any], ...]:
    value = raw.get(key) or []
    if not isinstance(value, list) or not all(isinstance(item, Mapping) for item in value):
        raise SpecError(f"spec.{key} must be a list of objects")
    return tuple(dict(item) for item in value)


def _optional_bool(value: Any) -> bool | None:
    return None if value is None else bool(value)


def _ints(
    raw: Mapping[str, Any], key: str, default: tuple[int, ...], where: str
) -> tuple[int, ...]:
    values = _get(raw, key, default)
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise SpecError(f"{where}.{key} must be a non-empty list of integers")
    return tuple(values)


def _scaling(raw: Mapping[str, Any], default: ScalingRules, where: str) -> ScalingRules:
    return ScalingRules(
        stabilization_window_seconds=_int(
            raw, "stabilizationWindowSeconds", default.stabilization_window_seconds, where
        ),
        max_pods_per_period=_int(raw, "maxPodsPerPeriod", None, where),
        max_percent_per_period=_int(raw, "maxPercentPerPeriod", None, where),
        period_seconds=_int(raw, "periodSeconds", default.period_seconds, where),
    )


def _scale_to_zero(autoscaling: Mapping[str, Any]) -> ScaleToZeroSpec | None:
    if autoscaling.get("scaleToZero") is None:
        return None
    raw = _section(autoscaling, "scaleToZero")
    where = "spec.autoscaling.scaleToZero"
    return ScaleToZeroSpec(_int(raw, "idleSeconds", ScaleToZeroSpec.idle_seconds, where))


def _model_source(model_raw: Mapping[str, Any]) -> ModelSource:
    """`spec.model.source` (one of hub, volume, image, baked; unset: hub). The older
    `spec.model.volume` still means `source.volume`."""
    raw = dict(_section(model_raw, "source"))
    if model_raw.get("volume"):
        if raw:
            raise SpecError(
                "spec.model.volume is the older spelling of spec.model.source.volume: set one"
            )
        raw = {"volume": model_raw["volume"]}
    given = [kind for kind in SOURCES if raw.get(kind) is not None]
    if len(given) > 1:
        raise SpecError(f"spec.model.source takes one of {', '.join(SOURCES)}, got {given}")
    kind = given[0] if given else "hub"
    where = f"spec.model.source.{kind}"
    part = _section(raw, kind) if kind in raw else {}
    if kind == "hub":
        secret = _section(part, "tokenSecret")
        if secret and not secret.get("name"):
            raise SpecError(f"{where}.tokenSecret.name is required when tokenSecret is set")
        offline = bool(_get(part, "offline", False))
        if offline and not part.get("cacheClaimName"):
            raise SpecError(f"{where}.offline needs {where}.cacheClaimName (a cache to read)")
        hub = HubSource(
            endpoint=part.get("endpoint") or None,
            token_secret=secret.get("name") or None,
            token_key=_get(secret, "key", "token"),
            cache_claim_name=part.get("cacheClaimName") or None,
            offline=offline,
        )
        return ModelSource("hub", hub=hub)
    if kind == "volume":
        if not part.get("claimName"):
            raise SpecError(f"{where}.claimName is required")
        layout = _get(part, "layout", "folder")
        if layout not in VOLUME_LAYOUTS:
            raise SpecError(f"{where}.layout must be one of {', '.join(VOLUME_LAYOUTS)}")
        volume = VolumeSource(part["claimName"], _get(part, "path", ""), layout)
        return ModelSource("volume", volume=volume)
    if kind == "image":
        if not part.get("reference"):
            raise SpecError(f"{where}.reference is required: the image holding the model")
        pull = _get(part, "pullPolicy", "IfNotPresent")
        if pull not in PULL_POLICIES:
            raise SpecError(f"{where}.pullPolicy must be one of {', '.join(PULL_POLICIES)}")
        image = ImageSource(part["reference"], pull, _get(part, "path", ""))
        return ModelSource("image", image=image)
    return ModelSource("baked", baked=BakedSource(part.get("path") or None))


def parse_spec(raw: Mapping[str, Any]) -> EmbeddingServiceSpec:
    """Read `EmbeddingService.spec` into typed values, applying the CRD's defaults."""
    model_raw = _section(raw, "model")
    model_id = model_raw.get("id")
    if not isinstance(model_id, str) or not model_id:
        raise SpecError("spec.model.id is required: a Hugging Face id or a folder name")
    source = _model_source(model_raw)
    model = ModelSpec(
        id=model_id,
        revision=_get(model_raw, "revision", "main"),
        served_name=model_raw.get("servedName"),
        pooling=_get(model_raw, "pooling", None),
        normalize=_optional_bool(_get(model_raw, "normalize", None)),
        max_input_length=_int(model_raw, "maxInputLength", None, "spec.model"),
        auto_truncate=bool(_get(model_raw, "autoTruncate", False)),
        trust_remote_code=_optional_bool(_get(model_raw, "trustRemoteCode", None)),
        openai_token_ids=_get(model_raw, "openaiTokenIds", "cl100k_base"),
        default_prompt_name=_get(model_raw, "defaultPromptName", None),
        default_prompt=_get(model_raw, "defaultPrompt", None),
        source=source,
    )

    runtime_raw = _section(raw, "runtime")
    runtime = RuntimeSpec(
        device=_get(runtime_raw, "device", "cpu"),
        dtype=_get(runtime_raw, "dtype", "float32"),
        packing=_get(runtime_raw, "packing", "auto"),
        cuda_graphs=_get(runtime_raw, "cudaGraphs", "auto"),
        tokenization_workers=_int(runtime_raw, "tokenizationWorkers", None, "spec.runtime"),
        backend=_get(runtime_raw, "backend", "torch"),
    )

    b = _section(raw, "batching")
    d = BatchingSpec()
    batching = BatchingSpec(
        max_batch_size=_int(b, "maxBatchSize", d.max_batch_size, "spec.batching"),
        max_batch_tokens=_int(b, "maxBatchTokens", d.max_batch_tokens, "spec.batching"),
        max_wait_milliseconds=_int(
            b, "maxWaitMilliseconds", d.max_wait_milliseconds, "spec.batching"
        ),
        max_client_batch_size=_int(
            b, "maxClientBatchSize", d.max_client_batch_size, "spec.batching"
        ),
        max_concurrent_requests=_int(
            b, "maxConcurrentRequests", d.max_concurrent_requests, "spec.batching"
        ),
        payload_limit_bytes=_int(b, "payloadLimitBytes", d.payload_limit_bytes, "spec.batching"),
        pad_batch=bool(_get(b, "padBatch", d.pad_batch)),
        request_timeout_seconds=_int(
            b, "requestTimeoutSeconds", d.request_timeout_seconds, "spec.batching"
        ),
        body_timeout_seconds=_int(b, "bodyTimeoutSeconds", d.body_timeout_seconds, "spec.batching"),
    )

    w = _section(raw, "warmup")
    dw = WarmupSpec()
    o = _section(w, "observedTraffic")
    do = ObservedTrafficSpec()
    warmup = WarmupSpec(
        enabled=bool(_get(w, "enabled", dw.enabled)),
        batch_sizes=_ints(w, "batchSizes", dw.batch_sizes, "spec.warmup"),
        sequence_buckets=_ints(w, "sequenceBuckets", dw.sequence_buckets, "spec.warmup"),
        memory_policy=str(_get(w, "memoryPolicy", dw.memory_policy)),
        pace=str(_get(w, "pace", dw.pace)),
        observed_traffic=ObservedTrafficSpec(
            enabled=bool(_get(o, "enabled", do.enabled)),
            max_shapes=_int(o, "maxShapes", do.max_shapes, "spec.warmup.observedTraffic"),
            refresh_seconds=_int(
                o, "refreshSeconds", do.refresh_seconds, "spec.warmup.observedTraffic"
            ),
        ),
    )

    p = _section(raw, "probes")
    dp = ProbesSpec()
    probes = ProbesSpec(
        startup_timeout_seconds=_int(
            p, "startupTimeoutSeconds", dp.startup_timeout_seconds, "spec.probes"
        ),
        period_seconds=_int(p, "periodSeconds", dp.period_seconds, "spec.probes"),
        forward_timeout_seconds=_int(
            p, "forwardTimeoutSeconds", dp.forward_timeout_seconds, "spec.probes"
        ),
        fault_threshold=_int(p, "faultThreshold", dp.fault_threshold, "spec.probes"),
        fault_restart_seconds=_int(
            p, "faultRestartSeconds", dp.fault_restart_seconds, "spec.probes"
        ),
    )
    if probes.period_seconds < 1:
        raise SpecError("spec.probes.periodSeconds must be at least 1")

    r = _section(raw, "rollout")
    dr = RolloutSpec()
    rollout = RolloutSpec(
        max_surge=_int(r, "maxSurge", dr.max_surge, "spec.rollout"),
        max_unavailable=_int(r, "maxUnavailable", dr.max_unavailable, "spec.rollout"),
        warm_gate=bool(_get(r, "warmGate", dr.warm_gate)),
        verify_latency=bool(_get(r, "verifyLatency", dr.verify_latency)),
        drain_seconds=_int(r, "drainSeconds", dr.drain_seconds, "spec.rollout"),
        progress_deadline_seconds=_int(r, "progressDeadlineSeconds", None, "spec.rollout"),
    )

    a = _section(raw, "autoscaling")
    da = AutoscalingSpec()
    pods_raw = a.get("podsMetric")
    pods_metric = None
    if pods_raw:
        pods_metric = PodsMetric(name=pods_raw["name"], average_value=str(pods_raw["averageValue"]))
    autoscaling = AutoscalingSpec(
        enabled=bool(_get(a, "enabled", da.enabled)),
        min_replicas=_int(a, "minReplicas", da.min_replicas, "spec.autoscaling"),
        max_replicas=_int(a, "maxReplicas", da.max_replicas, "spec.autoscaling"),
        # CPU is the target unless only a pods metric was asked for.
        target_cpu_utilization_percentage=_int(
            a,
            "targetCPUUtilizationPercentage",
            None if pods_metric else da.target_cpu_utilization_percentage,
            "spec.autoscaling",
        ),
        pods_metric=pods_metric,
        scale_up=_scaling(_section(a, "scaleUp"), da.scale_up, "spec.autoscaling.scaleUp"),
        scale_down=_scaling(_section(a, "scaleDown"), da.scale_down, "spec.autoscaling.scaleDown"),
        scale_to_zero=_scale_to_zero(a),
    )

    db = _section(raw, "disruptionBudget")
    disruption_budget = DisruptionBudgetSpec(
        enabled=bool(_get(db, "enabled", True)),
        min_available=_int(db, "minAvailable", None, "spec.disruptionBudget"),
    )

    s = _section(raw, "service")
    service = ServiceSpec(
        type=_get(s, "type", "ClusterIP"),
        port=_int(s, "port", 80, "spec.service"),
        node_port=_int(s, "nodePort", None, "spec.service"),
    )

    resources = {
        kind: {str(k): str(v) for k, v in (values or {}).items()}
        for kind, values in _section(raw, "resources").items()
        if kind in ("limits", "requests")
    }

    spec = EmbeddingServiceSpec(
        model=model,
        image=raw.get("image") or None,
        image_pull_policy=raw.get("imagePullPolicy") or None,
        replicas=_int(raw, "replicas", 1, "spec"),
        standby_replicas=_int(raw, "standbyReplicas", 0, "spec"),
        runtime=runtime,
        resources=resources,
        batching=batching,
        warmup=warmup,
        probes=probes,
        rollout=rollout,
        autoscaling=autoscaling,
        disruption_budget=disruption_budget,
        service=service,
        node_selector=dict(_section(raw, "nodeSelector")),
        tolerations=_items(raw, "tolerations"),
        affinity=dict(_section(raw, "affinity")),
        priority_class_name=_get(raw, "priorityClassName", None),
        pod_labels=dict(_section(raw, "podLabels")),
        pod_annotations=dict(_section(raw, "podAnnotations")),
        env=_items(raw, "env"),
        volumes=_items(raw, "volumes"),
        volume_mounts=_items(raw, "volumeMounts"),
    )
    _check(spec)
    return spec


def _check(spec: EmbeddingServiceSpec) -> None:
    """The rules the builders rely on; the CRD rejects these first, this guards old objects."""
    for name, value, allowed in (
        ("spec.runtime.device", spec.runtime.device, DEVICES),
        ("spec.runtime.dtype", spec.runtime.dtype, DTYPES),
        ("spec.runtime.packing", spec.runtime.packing, PACKINGS),
        ("spec.runtime.cudaGraphs", spec.runtime.cuda_graphs, CUDA_GRAPHS),
        ("spec.runtime.backend", spec.runtime.backend, BACKENDS),
        ("spec.warmup.memoryPolicy", spec.warmup.memory_policy, MEMORY_POLICIES),
        ("spec.model.pooling", spec.model.pooling, POOLINGS),
        ("spec.model.openaiTokenIds", spec.model.openai_token_ids, TOKEN_ID_KINDS),
        ("spec.service.type", spec.service.type, SERVICE_TYPES),
        ("spec.imagePullPolicy", spec.image_pull_policy, PULL_POLICIES),
    ):
        if value is not None and value not in allowed:
            raise SpecError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
    if spec.model.default_prompt_name is not None and spec.model.default_prompt is not None:
        raise SpecError("spec.model.defaultPromptName and spec.model.defaultPrompt: set one")
    if spec.runtime.cuda_graphs == "on" and spec.runtime.device != "cuda":
        raise SpecError("spec.runtime.cudaGraphs on needs spec.runtime.device cuda")
    runtime = spec.runtime
    if runtime.backend == "onnxruntime" and (
        runtime.device != "cpu" or runtime.dtype != "float32" or runtime.packing == "on"
    ):
        raise SpecError(ONNXRUNTIME_NEEDS)
    if spec.replicas < 0:
        raise SpecError("spec.replicas must be 0 or more")
    if spec.standby_replicas < 0:
        raise SpecError("spec.standbyReplicas must be 0 or more")
    if ROLE_LABEL in spec.pod_labels:
        raise SpecError(f"spec.podLabels: {ROLE_LABEL} is the operator's (serving or standby)")
    if spec.autoscaling.enabled and spec.autoscaling.min_replicas > spec.autoscaling.max_replicas:
        raise SpecError("spec.autoscaling.minReplicas must be <= spec.autoscaling.maxReplicas")
    _check_scale_to_zero(spec.autoscaling)
    for name, values in (
        ("spec.warmup.batchSizes", spec.warmup.batch_sizes),
        ("spec.warmup.sequenceBuckets", spec.warmup.sequence_buckets),
    ):
        if list(values) != sorted(set(values)) or values[0] < 1:
            raise SpecError(f"{name} must be positive, ascending and unique, got {list(values)}")
    if spec.rollout.max_surge + spec.rollout.max_unavailable < 1:
        raise SpecError("spec.rollout.maxSurge and spec.rollout.maxUnavailable cannot both be 0")
    taken = sorted({str(v.get("name")) for v in spec.volumes} & set(RESERVED_VOLUMES))
    if taken:
        raise SpecError(
            f"spec.volumes: {', '.join(taken)} is the name of a volume warmgate mounts itself "
            f"({', '.join(RESERVED_VOLUMES)}): rename yours"
        )


def _check_scale_to_zero(autoscaling: AutoscalingSpec) -> None:
    """The CRD's rules on scaleToZero, for objects stored before them."""
    if autoscaling.min_replicas < 0:
        raise SpecError("spec.autoscaling.minReplicas must be 0 or more")
    if autoscaling.scale_to_zero is None:
        if autoscaling.min_replicas == 0:
            raise SpecError(
                "spec.autoscaling.minReplicas 0 needs spec.autoscaling.scaleToZero: set it, or "
                "set minReplicas to 1 or more"
            )
        return
    if autoscaling.min_replicas != 0:
        raise SpecError("spec.autoscaling.scaleToZero needs spec.autoscaling.minReplicas 0")
    if not autoscaling.enabled:
        raise SpecError("spec.autoscaling.scaleToZero needs spec.autoscaling.enabled true")
    if autoscaling.scale_to_zero.idle_seconds < 1:
        raise SpecError("spec.autoscaling.scaleToZero.idleSeconds must be at least 1")


class ParsedSpecs:
    """Each EmbeddingService's spec, parsed once per content and shared by the reconciler, the
    warm gate and the traffic observer, so none reads the raw object with defaults of its own.
    Keyed by the spec's own text, not `metadata.generation`: what is parsed is what is there."""

    def __init__(self) -> None:
        self._parsed: dict[str, tuple[str, EmbeddingServiceSpec | SpecError]] = {}

    def of(self, body: Mapping[str, Any]) -> EmbeddingServiceSpec:
        """The parsed spec; SpecError (the same one each time) when it cannot be built."""
        raw = body.get("spec") or {}
        text = json.dumps(raw, sort_keys=True, separators=(",", ":"))
        uid = (body.get("metadata") or {}).get("uid") or ""
        cached = self._parsed.get(uid)
        if cached is not None and cached[0] == text:
            result = cached[1]
        else:
            try:
                result = parse_spec(raw)
            except SpecError as error:
                result = error
            if uid:
                self._parsed[uid] = (text, result)
        if isinstance(result, SpecError):
            raise result
        return result

    def forget(self, uid: str | None) -> None:
        self._parsed.pop(uid or "", None)
