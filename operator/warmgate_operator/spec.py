"""The EmbeddingService spec as typed, frozen values, and the one source of its defaults.

The dataclasses below declare every default; `parse_spec` reads a field left out as its
dataclass default and writes none of its own, so the builders never see a missing field (an
object stored before a default was added, or a unit test that writes a minimal spec). The CRD's
schema declares the same defaults for the apiserver to apply: tools/gen-crd-defaults.py writes
them there (spec_defaults.py spells them as CRD paths) and `tests/operator/test_crd.py` holds
the two equal. A few fields have none on purpose: unset means something (trustRemoteCode,
normalize, pooling), or the operator computes the value (the CPU target, the startup budget, the
resources builders.py fills in).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from warmgate_contract import flags
from warmgate_contract.names import ROLE_LABEL

# The server's values (the contract's), less `auto` for the device and dtype: the operator
# decides them before the pod exists (a cuda pod requests a GPU; float16 needs cuda).
DEVICES = tuple(value for value in flags.DEVICES if value != "auto")
DTYPES = tuple(value for value in flags.DTYPES if value != "auto")
POOLINGS = flags.POOLINGS
TASKS = flags.TASKS
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
    task: str = "auto"
    """auto: the server reads it from the model's folder (embed, rerank or classify)."""
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


_WORD_BREAK = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")


def field_name(key: str) -> str:
    """The spec model's field for a key of the CRD's schema: `maxBatchSize` ->
    `max_batch_size`, `targetCPUUtilizationPercentage` -> `target_cpu_utilization_percentage`."""
    return _WORD_BREAK.sub("_", key).lower()


def defaults_of(model: Any) -> dict[str, Any]:
    """{field: default} of a spec model class (its declared defaults; a field without one is
    left out), or of a value of one (its own fields: autoscaling's default scaleDown rules)."""
    if not isinstance(model, type):
        return {item.name: getattr(model, item.name) for item in fields(model)}
    found = {}
    for item in fields(model):
        if item.default is not MISSING:
            found[item.name] = item.default
        elif item.default_factory is not MISSING:
            found[item.name] = item.default_factory()
    return found


_MODEL_DEFAULT: Any = object()


class _Given:
    """One object of the raw spec, read key by key: a key left out (or null) takes the spec
    model's default for the field of the same name, so parsing writes no default of its own."""

    def __init__(self, raw: Mapping[str, Any], where: str, model: Any) -> None:
        self.raw = raw
        self.where = where
        self._defaults = defaults_of(model)

    def default(self, key: str) -> Any:
        return self._defaults[field_name(key)]

    def value(self, key: str) -> Any:
        return _get(self.raw, key, self.default(key))

    def text(self, key: str) -> str:
        return str(self.value(key))

    def boolean(self, key: str) -> bool:
        return bool(self.value(key))

    def optional_boolean(self, key: str) -> bool | None:
        value = self.value(key)
        return None if value is None else bool(value)

    def integer(self, key: str, default: Any = _MODEL_DEFAULT) -> Any:
        """An integer, or None where the field's default is None and none is given."""
        value = _get(self.raw, key, self.default(key) if default is _MODEL_DEFAULT else default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(f"{self.where}.{key} must be an integer, got {value!r}")
        return value

    def integers(self, key: str) -> tuple[int, ...]:
        values = self.value(key)
        if not values or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise SpecError(f"{self.where}.{key} must be a non-empty list of integers")
        return tuple(values)

    def section(self, key: str, model: Any = _MODEL_DEFAULT) -> _Given:
        """A nested object, read with `model`'s defaults (unset: this field's own default,
        e.g. the scaleUp rules of autoscaling)."""
        model = self.default(key) if model is _MODEL_DEFAULT else model
        return _Given(_section(self.raw, key), f"{self.where}.{key}", model)


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


def _items(raw: Mapping[str, Any], key: str) -> tuple[Mapping[str, Any], ...]:
    value = raw.get(key) or []
    if not isinstance(value, list) or not all(isinstance(item, Mapping) for item in value):
        raise SpecError(f"spec.{key} must be a list of objects")
    return tuple(dict(item) for item in value)


def _model_source(model: Mapping[str, Any]) -> ModelSource:
    """`spec.model.source` (one of hub, volume, image, baked; unset: hub). The older
    `spec.model.volume` still means `source.volume`."""
    raw = dict(_section(model, "source"))
    if model.get("volume"):
        if raw:
            raise SpecError(
                "spec.model.volume is the older spelling of spec.model.source.volume: set one"
            )
        raw = {"volume": model["volume"]}
    given = [kind for kind in SOURCES if raw.get(kind) is not None]
    if len(given) > 1:
        raise SpecError(f"spec.model.source takes one of {', '.join(SOURCES)}, got {given}")
    kind = given[0] if given else ModelSource.kind
    where = f"spec.model.source.{kind}"
    part = _section(raw, kind) if kind in raw else {}
    if kind == "hub":
        hub = _Given(part, where, HubSource)
        secret = _section(part, "tokenSecret")
        if secret and not secret.get("name"):
            raise SpecError(f"{where}.tokenSecret.name is required when tokenSecret is set")
        offline = hub.boolean("offline")
        if offline and not part.get("cacheClaimName"):
            raise SpecError(f"{where}.offline needs {where}.cacheClaimName (a cache to read)")
        return ModelSource(
            "hub",
            hub=HubSource(
                endpoint=part.get("endpoint") or None,
                token_secret=secret.get("name") or None,
                token_key=_get(secret, "key", HubSource.token_key),
                cache_claim_name=part.get("cacheClaimName") or None,
                offline=offline,
            ),
        )
    if kind == "volume":
        volume = _Given(part, where, VolumeSource)
        if not part.get("claimName"):
            raise SpecError(f"{where}.claimName is required")
        layout = volume.value("layout")
        if layout not in VOLUME_LAYOUTS:
            raise SpecError(f"{where}.layout must be one of {', '.join(VOLUME_LAYOUTS)}")
        return ModelSource(
            "volume", volume=VolumeSource(part["claimName"], volume.value("path"), layout)
        )
    if kind == "image":
        image = _Given(part, where, ImageSource)
        if not part.get("reference"):
            raise SpecError(f"{where}.reference is required: the image holding the model")
        pull_policy = image.value("pullPolicy")
        if pull_policy not in PULL_POLICIES:
            raise SpecError(f"{where}.pullPolicy must be one of {', '.join(PULL_POLICIES)}")
        return ModelSource(
            "image", image=ImageSource(part["reference"], pull_policy, image.value("path"))
        )
    return ModelSource("baked", baked=BakedSource(part.get("path") or None))


def parse_spec(raw: Mapping[str, Any]) -> EmbeddingServiceSpec:
    """Read `EmbeddingService.spec` into typed values. What is left out takes the spec model's
    defaults, the ones the CRD's schema declares too (tools/gen-crd-defaults.py writes them
    there), so an object stored before a default was added reads as a new one would."""
    model = _model(_Given(_section(raw, "model"), "spec.model", ModelSpec))
    top = _Given(raw, "spec", EmbeddingServiceSpec)
    runtime = _runtime(top.section("runtime"))
    batching = _batching(top.section("batching"))
    warmup = _warmup(top.section("warmup"))
    probes = _probes(top.section("probes"))
    rollout = _rollout(top.section("rollout"))
    autoscaling = _autoscaling(top.section("autoscaling"))
    disruption_budget = _disruption_budget(top.section("disruptionBudget"))
    service = _service(top.section("service"))
    resources = {
        kind: {str(k): str(v) for k, v in (values or {}).items()}
        for kind, values in _section(raw, "resources").items()
        if kind in ("limits", "requests")
    }

    spec = EmbeddingServiceSpec(
        model=model,
        image=raw.get("image") or None,
        image_pull_policy=raw.get("imagePullPolicy") or None,
        replicas=top.integer("replicas"),
        standby_replicas=top.integer("standbyReplicas"),
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
        priority_class_name=top.value("priorityClassName"),
        pod_labels=dict(_section(raw, "podLabels")),
        pod_annotations=dict(_section(raw, "podAnnotations")),
        env=_items(raw, "env"),
        volumes=_items(raw, "volumes"),
        volume_mounts=_items(raw, "volumeMounts"),
    )
    _check(spec)
    return spec


def _model(model: _Given) -> ModelSpec:
    model_id = model.raw.get("id")
    if not isinstance(model_id, str) or not model_id:
        raise SpecError("spec.model.id is required: a Hugging Face id or a folder name")
    source = _model_source(model.raw)
    return ModelSpec(
        id=model_id,
        revision=model.value("revision"),
        served_name=model.value("servedName"),
        pooling=model.value("pooling"),
        normalize=model.optional_boolean("normalize"),
        max_input_length=model.integer("maxInputLength"),
        auto_truncate=model.boolean("autoTruncate"),
        trust_remote_code=model.optional_boolean("trustRemoteCode"),
        task=model.value("task") or "auto",
        openai_token_ids=model.value("openaiTokenIds"),
        default_prompt_name=model.value("defaultPromptName"),
        default_prompt=model.value("defaultPrompt"),
        source=source,
    )


def _runtime(runtime: _Given) -> RuntimeSpec:
    return RuntimeSpec(
        device=runtime.value("device"),
        dtype=runtime.value("dtype"),
        packing=runtime.value("packing"),
        cuda_graphs=runtime.value("cudaGraphs"),
        tokenization_workers=runtime.integer("tokenizationWorkers"),
        backend=runtime.value("backend"),
    )


def _batching(batching: _Given) -> BatchingSpec:
    return BatchingSpec(
        max_batch_size=batching.integer("maxBatchSize"),
        max_batch_tokens=batching.integer("maxBatchTokens"),
        max_wait_milliseconds=batching.integer("maxWaitMilliseconds"),
        max_client_batch_size=batching.integer("maxClientBatchSize"),
        max_concurrent_requests=batching.integer("maxConcurrentRequests"),
        payload_limit_bytes=batching.integer("payloadLimitBytes"),
        pad_batch=batching.boolean("padBatch"),
        request_timeout_seconds=batching.integer("requestTimeoutSeconds"),
        body_timeout_seconds=batching.integer("bodyTimeoutSeconds"),
    )


def _warmup(warmup: _Given) -> WarmupSpec:
    observed = warmup.section("observedTraffic")
    return WarmupSpec(
        enabled=warmup.boolean("enabled"),
        batch_sizes=warmup.integers("batchSizes"),
        sequence_buckets=warmup.integers("sequenceBuckets"),
        memory_policy=warmup.text("memoryPolicy"),
        pace=warmup.text("pace"),
        observed_traffic=ObservedTrafficSpec(
            enabled=observed.boolean("enabled"),
            max_shapes=observed.integer("maxShapes"),
            refresh_seconds=observed.integer("refreshSeconds"),
        ),
    )


def _probes(probes: _Given) -> ProbesSpec:
    parsed = ProbesSpec(
        startup_timeout_seconds=probes.integer("startupTimeoutSeconds"),
        period_seconds=probes.integer("periodSeconds"),
        forward_timeout_seconds=probes.integer("forwardTimeoutSeconds"),
        fault_threshold=probes.integer("faultThreshold"),
        fault_restart_seconds=probes.integer("faultRestartSeconds"),
    )
    if parsed.period_seconds < 1:
        raise SpecError("spec.probes.periodSeconds must be at least 1")
    return parsed


def _rollout(rollout: _Given) -> RolloutSpec:
    return RolloutSpec(
        max_surge=rollout.integer("maxSurge"),
        max_unavailable=rollout.integer("maxUnavailable"),
        warm_gate=rollout.boolean("warmGate"),
        verify_latency=rollout.boolean("verifyLatency"),
        drain_seconds=rollout.integer("drainSeconds"),
        progress_deadline_seconds=rollout.integer("progressDeadlineSeconds"),
    )


def _autoscaling(autoscaling: _Given) -> AutoscalingSpec:
    pods_raw = autoscaling.raw.get("podsMetric")
    pods_metric = None
    if pods_raw:
        pods_metric = PodsMetric(name=pods_raw["name"], average_value=str(pods_raw["averageValue"]))
    cpu_target = "targetCPUUtilizationPercentage"
    return AutoscalingSpec(
        enabled=autoscaling.boolean("enabled"),
        min_replicas=autoscaling.integer("minReplicas"),
        max_replicas=autoscaling.integer("maxReplicas"),
        # CPU is the target unless only a pods metric was asked for: the operator's own
        # default, which is why the CRD declares none.
        target_cpu_utilization_percentage=autoscaling.integer(
            cpu_target, default=None if pods_metric else autoscaling.default(cpu_target)
        ),
        pods_metric=pods_metric,
        scale_up=_scaling(autoscaling.section("scaleUp")),
        scale_down=_scaling(autoscaling.section("scaleDown")),
        scale_to_zero=_scale_to_zero(autoscaling),
    )


def _scaling(rules: _Given) -> ScalingRules:
    return ScalingRules(
        stabilization_window_seconds=rules.integer("stabilizationWindowSeconds"),
        max_pods_per_period=rules.integer("maxPodsPerPeriod"),
        max_percent_per_period=rules.integer("maxPercentPerPeriod"),
        period_seconds=rules.integer("periodSeconds"),
    )


def _scale_to_zero(autoscaling: _Given) -> ScaleToZeroSpec | None:
    if autoscaling.raw.get("scaleToZero") is None:
        return None
    scale_to_zero = autoscaling.section("scaleToZero", ScaleToZeroSpec)
    return ScaleToZeroSpec(scale_to_zero.integer("idleSeconds"))


def _disruption_budget(budget: _Given) -> DisruptionBudgetSpec:
    return DisruptionBudgetSpec(
        enabled=budget.boolean("enabled"),
        min_available=budget.integer("minAvailable"),
    )


def _service(service: _Given) -> ServiceSpec:
    return ServiceSpec(
        type=service.value("type"),
        port=service.integer("port"),
        node_port=service.integer("nodePort"),
    )


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
        ("spec.model.task", spec.model.task, TASKS),
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
