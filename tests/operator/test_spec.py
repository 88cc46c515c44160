"""The spec model: defaults, the startup budget maths, and the guard rules."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from warmgate_operator.spec import (
    EmbeddingServiceSpec,
    ModelSpec,
    ParsedSpecs,
    SpecError,
    field_name,
    parse_spec,
)


def test_minimal_spec_gets_the_documented_defaults() -> None:
    spec = parse_spec({"model": {"id": "sentence-transformers/all-MiniLM-L6-v2"}})
    assert spec.model.revision == "main"
    assert spec.model.pooling is None  # the model folder's own, on the server
    assert spec.model.normalize is None
    assert spec.image is None
    assert spec.replicas == 1
    assert (spec.runtime.device, spec.runtime.dtype) == ("cpu", "float32")
    assert spec.batching.max_batch_size == 32
    assert spec.batching.max_batch_tokens == 16384
    assert spec.batching.max_concurrent_requests == 512
    assert spec.warmup.batch_sizes == (1, 8, 32)
    assert spec.warmup.sequence_buckets == (32, 64, 128, 256)
    assert spec.probes.startup_timeout_seconds is None  # sized from the measured start
    assert spec.probes.period_seconds == 5
    assert (spec.rollout.max_surge, spec.rollout.max_unavailable) == (1, 0)
    assert spec.rollout.warm_gate is True
    assert spec.autoscaling.enabled is False
    assert spec.autoscaling.scale_up.stabilization_window_seconds == 0
    assert spec.autoscaling.scale_down.stabilization_window_seconds == 300
    assert (spec.service.type, spec.service.port) == ("ClusterIP", 80)
    assert spec.progress_deadline_seconds(600) == 600 + 600


def test_what_a_spec_leaves_out_is_the_spec_models_own_default() -> None:
    """parse_spec writes no default of its own: a minimal spec is the model's defaults."""
    assert parse_spec({"model": {"id": "m"}}) == EmbeddingServiceSpec(model=ModelSpec(id="m"))
    given = {"model": {"id": "m", "revision": None}, "batching": {"maxBatchSize": None}}
    assert parse_spec(given) == parse_spec({"model": {"id": "m"}})  # null is left out too


def test_each_crd_key_names_its_field() -> None:
    for key, name in (
        ("maxBatchSize", "max_batch_size"),
        ("targetCPUUtilizationPercentage", "target_cpu_utilization_percentage"),
        ("openaiTokenIds", "openai_token_ids"),
        ("id", "id"),
    ):
        assert field_name(key) == name


def test_pods_metric_alone_drops_the_cpu_target() -> None:
    spec = parse_spec(
        {
            "model": {"id": "m"},
            "autoscaling": {
                "enabled": True,
                "podsMetric": {"name": "warmgate_queue_depth", "averageValue": "10"},
            },
        }
    )
    assert spec.autoscaling.target_cpu_utilization_percentage is None
    assert spec.autoscaling.pods_metric.average_value == "10"


@given(timeout=st.integers(1, 86400), period=st.integers(1, 300))
def test_startup_failure_threshold_covers_the_whole_timeout(timeout: int, period: int) -> None:
    spec = parse_spec(
        {
            "model": {"id": "m"},
            "probes": {"startupTimeoutSeconds": timeout, "periodSeconds": period},
        }
    )
    threshold = spec.probes.startup_failure_threshold(spec.probes.startup_timeout_seconds)
    assert threshold == max(1, math.ceil(timeout / period))
    # The kubelet gives up after threshold * period seconds: never before the timeout.
    assert threshold * period >= timeout
    assert (threshold - 1) * period < timeout or threshold == 1


@pytest.mark.parametrize(
    ("startup", "period", "expected"), [(600, 5, 120), (601, 5, 121), (10, 3, 4), (2, 2, 1)]
)
def test_startup_failure_threshold_examples(startup: int, period: int, expected: int) -> None:
    spec = parse_spec(
        {
            "model": {"id": "m"},
            "probes": {"startupTimeoutSeconds": startup, "periodSeconds": period},
        }
    )
    assert spec.probes.startup_failure_threshold(startup) == expected


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({}, "spec.model.id"),
        ({"model": {"id": "m"}, "runtime": {"device": "tpu"}}, "spec.runtime.device"),
        ({"model": {"id": "m"}, "warmup": {"sequenceBuckets": [64, 32]}}, "sequenceBuckets"),
        ({"model": {"id": "m"}, "warmup": {"batchSizes": [1, 1]}}, "batchSizes"),
        ({"model": {"id": "m"}, "replicas": "two"}, "spec.replicas"),
        (
            {
                "model": {"id": "m"},
                "autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2},
            },
            "minReplicas",
        ),
        ({"model": {"id": "m"}, "rollout": {"maxSurge": 0, "maxUnavailable": 0}}, "maxSurge"),
        ({"model": {"id": "m"}, "runtime": {"cudaGraphs": "yes"}}, "spec.runtime.cudaGraphs"),
        ({"model": {"id": "m"}, "runtime": {"cudaGraphs": "on"}}, "cudaGraphs on needs"),
        ({"model": {"id": "m"}, "runtime": {"backend": "tensorrt"}}, "spec.runtime.backend"),
        (
            {"model": {"id": "m"}, "runtime": {"backend": "onnxruntime", "device": "cuda"}},
            "backend onnxruntime runs padded float32 passes on the CPU",
        ),
        (
            {"model": {"id": "m"}, "runtime": {"backend": "onnxruntime", "packing": "on"}},
            "runtime.packing auto or off",
        ),
        (
            {"model": {"id": "m", "defaultPromptName": "q", "defaultPrompt": "q: "}},
            "defaultPromptName and spec.model.defaultPrompt",
        ),
    ],
)
def test_bad_specs_name_the_field(raw: dict, field: str) -> None:
    with pytest.raises(SpecError, match=field):
        parse_spec(raw)


def test_a_spec_is_parsed_once_and_again_when_it_changes() -> None:
    specs = ParsedSpecs()
    body = {"metadata": {"uid": "u1", "generation": 1}, "spec": {"model": {"id": "m"}}}
    first = specs.of(body)
    assert specs.of(body) is first
    body["spec"]["rollout"] = {"verifyLatency": True}
    assert specs.of(body).rollout.verify_latency is True
    bad = {"metadata": {"uid": "u2", "generation": 1}, "spec": {}}
    with pytest.raises(SpecError):
        specs.of(bad)
    specs.forget("u1")
    assert specs.of(body) is not first


@pytest.mark.parametrize(
    ("source", "words"),
    [
        ({"hub": {}, "baked": {}}, "takes one of hub, volume, image, baked"),
        ({"hub": {"offline": True}}, "offline needs"),
        ({"image": {"path": "m"}}, "reference is required"),
        ({"volume": {"claimName": "c", "layout": "zip"}}, "layout must be one of"),
    ],
)
def test_a_model_source_the_builders_cannot_use_is_refused(source, words):
    with pytest.raises(SpecError, match=words):
        parse_spec({"model": {"id": "m", "source": source}})
    old_and_new = {"id": "m", "volume": {"claimName": "a"}, "source": {"hub": {}}}
    with pytest.raises(SpecError, match="older spelling"):
        parse_spec({"model": old_and_new})


def autoscaling(**fields: object) -> dict[str, object]:
    return {"model": {"id": "m"}, "autoscaling": {"enabled": True, **fields}}


def test_scale_to_zero_is_parsed_with_its_default_idle_time() -> None:
    spec = parse_spec(autoscaling(minReplicas=0, scaleToZero={"idleSeconds": 90}))
    assert spec.autoscaling.scale_to_zero is not None
    assert spec.autoscaling.scale_to_zero.idle_seconds == 90
    assert parse_spec(autoscaling(minReplicas=0, scaleToZero={})).autoscaling.scale_to_zero == (
        type(spec.autoscaling.scale_to_zero)(idle_seconds=300)
    )
    assert parse_spec(autoscaling()).autoscaling.scale_to_zero is None


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (autoscaling(minReplicas=0), "minReplicas 0 needs spec.autoscaling.scaleToZero"),
        (autoscaling(minReplicas=1, scaleToZero={}), "scaleToZero needs spec.autoscaling.min"),
        (
            {"model": {"id": "m"}, "autoscaling": {"minReplicas": 0, "scaleToZero": {}}},
            "scaleToZero needs spec.autoscaling.enabled true",
        ),
        (autoscaling(minReplicas=0, scaleToZero={"idleSeconds": "5m"}), "must be an integer"),
    ],
)
def test_scale_to_zero_rules_guard_objects_stored_before_them(
    raw: dict[str, object], words: str
) -> None:
    with pytest.raises(SpecError, match=words):
        parse_spec(raw)


def test_scaled_to_zero_means_no_pod_standby_pool_included() -> None:
    asleep = parse_spec(
        {**autoscaling(minReplicas=0, scaleToZero={}), "replicas": 0, "standbyReplicas": 2}
    )
    assert (asleep.scaled_to_zero, asleep.serving_replicas, asleep.pod_replicas) == (True, 0, 0)
    assert asleep.min_pods == 0
    awake = parse_spec(
        {**autoscaling(minReplicas=0, scaleToZero={}), "replicas": 2, "standbyReplicas": 2}
    )
    assert (awake.scaled_to_zero, awake.pod_replicas) == (False, 4)
    # Without scale to zero, replicas 0 keeps its standby pool (a person's choice).
    manual = parse_spec({"model": {"id": "m"}, "replicas": 0, "standbyReplicas": 1})
    assert (manual.scaled_to_zero, manual.pod_replicas) == (False, 1)


def test_the_task_is_auto_unless_the_spec_decides_it() -> None:
    assert parse_spec({"model": {"id": "m"}}).model.task == "auto"
    assert parse_spec({"model": {"id": "m", "task": "rerank"}}).model.task == "rerank"
    with pytest.raises(SpecError, match=r"spec\.model\.task"):
        parse_spec({"model": {"id": "m", "task": "summarize"}})
