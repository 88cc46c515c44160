"""The CRD against the real kube-apiserver: valid examples pass, a corpus of mistakes is
rejected with a message that names the field, `kubectl explain` teaches the API."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest
import yaml
from support.cluster import ROOT, UNMAPPED_IMAGE, example, get_json, install_crd

pytestmark = pytest.mark.cluster


def _set(path: str, value: Any) -> Callable[[dict], None]:
    def mutate(body: dict) -> None:
        node = body
        *parents, last = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value

    return mutate


def _delete(path: str) -> Callable[[dict], None]:
    def mutate(body: dict) -> None:
        node = body
        *parents, last = path.split(".")
        for part in parents:
            node = node[part]
        del node[last]

    return mutate


def _all(*mutations: Callable[[dict], None]) -> Callable[[dict], None]:
    def mutate(body: dict) -> None:
        for m in mutations:
            m(body)

    return mutate


# (mistake, mutation of examples/minilm.yaml, words the apiserver's message must contain)
CORPUS: list[tuple[str, Callable[[dict], None], list[str]]] = [
    ("model id missing", _delete("spec.model.id"), ["spec.model.id", "Required value"]),
    ("misspelt field", _set("spec.replica", 3), ['unknown field "spec.replica"']),
    ("negative replicas", _set("spec.replicas", -1), ["spec.replicas", "greater than or equal"]),
    ("replicas as text", _set("spec.replicas", "two"), ["spec.replicas", "integer"]),
    (
        "min above max replicas",
        _set("spec.autoscaling", {"enabled": True, "minReplicas": 5, "maxReplicas": 2}),
        ["spec.autoscaling.minReplicas", "must be <= autoscaling.maxReplicas"],
    ),
    (
        "buckets out of order",
        _set("spec.warmup.sequenceBuckets", [64, 32, 128]),
        ["spec.warmup.sequenceBuckets", "ascending"],
    ),
    (
        "duplicate bucket",
        _set("spec.warmup.sequenceBuckets", [32, 32, 128]),
        ["spec.warmup.sequenceBuckets", "Duplicate value"],
    ),
    (
        "duplicate batch size",
        _set("spec.warmup.batchSizes", [1, 1, 8]),
        ["spec.warmup.batchSizes", "Duplicate value"],
    ),
    (
        "warmup shape over the token budget",
        _set("spec.batching.maxBatchTokens", 512),
        ["spec.batching.maxBatchTokens", "must not exceed batching.maxBatchTokens"],
    ),
    (
        "warmup batch above maxBatchSize",
        _all(_set("spec.warmup.batchSizes", [1, 16]), _set("spec.batching.maxBatchTokens", 4096)),
        ["spec.warmup.batchSizes", "batching.maxBatchSize"],
    ),
    ("empty warmup batch sizes", _set("spec.warmup.batchSizes", []), ["spec.warmup.batchSizes"]),
    (
        "startup timeout below probe period",
        _set("spec.probes", {"startupTimeoutSeconds": 2, "periodSeconds": 5}),
        ["spec.probes.startupTimeoutSeconds", "must be >= probes.periodSeconds"],
    ),
    (
        "two model sources",
        _set("spec.model.source", {"hub": {}, "image": {"reference": "models/minilm:1"}}),
        ["spec.model.source", "one of hub, volume, image or baked"],
    ),
    (
        "offline hub without a cache claim",
        _set("spec.model.source", {"hub": {"offline": True}}),
        ["spec.model.source.hub", "needs hub.cacheClaimName"],
    ),
    (
        "hub endpoint that is not a URL",
        _set("spec.model.source", {"hub": {"endpoint": "hf-mirror.internal"}}),
        ["spec.model.source.hub.endpoint", "should match"],
    ),
    (
        "model image without a reference",
        _set("spec.model.source", {"image": {"path": "minilm"}}),
        ["spec.model.source.image.reference", "Required value"],
    ),
    (
        "old and new volume spellings at once",
        _all(
            _set("spec.model.volume", {"claimName": "a"}),
            _set("spec.model.source", {"volume": {"claimName": "b"}}),
        ),
        ["spec.model", "set one, not both"],
    ),
    (
        "unknown pooling",
        _set("spec.model.pooling", "median"),
        ["spec.model.pooling", 'Unsupported value: "median"'],
    ),
    (
        "unknown device",
        _set("spec.runtime.device", "tpu"),
        ["spec.runtime.device", 'Unsupported value: "tpu"'],
    ),
    (
        "float16 on cpu",
        _set("spec.runtime.dtype", "float16"),
        ["spec.runtime.dtype", "needs runtime.device cuda"],
    ),
    (
        "ONNX Runtime on a GPU",
        _set("spec.runtime", {"backend": "onnxruntime", "device": "cuda"}),
        ["spec.runtime.backend", "onnxruntime runs padded float32 passes on the CPU"],
    ),
    (
        "ONNX Runtime with the packed pass required",
        _set("spec.runtime", {"backend": "onnxruntime", "packing": "on"}),
        ["spec.runtime.backend", "runtime.packing auto or off"],
    ),
    (
        "unknown service type",
        _set("spec.service.type", "ExternalName"),
        ["spec.service.type", "Unsupported value"],
    ),
    ("port out of range", _set("spec.service.port", 70000), ["spec.service.port", "65535"]),
    (
        "node port on a ClusterIP service",
        _set("spec.service", {"type": "ClusterIP", "nodePort": 30080}),
        ["spec.service.nodePort", "NodePort or LoadBalancer"],
    ),
    (
        "neither surge nor unavailability",
        _set("spec.rollout", {"maxSurge": 0, "maxUnavailable": 0}),
        ["spec.rollout.maxSurge", "cannot both be 0"],
    ),
    (
        "progress deadline shorter than warmup",
        _set("spec.rollout.progressDeadlineSeconds", 100),
        ["spec.rollout.progressDeadlineSeconds", "probes.startupTimeoutSeconds"],
    ),
    (
        "cpu target above 100",
        _set("spec.autoscaling.targetCPUUtilizationPercentage", 150),
        ["spec.autoscaling.targetCPUUtilizationPercentage", "less than or equal to 100"],
    ),
    (
        "min replicas 0 without scale to zero",
        _set("spec.autoscaling", {"enabled": True, "minReplicas": 0}),
        ["spec.autoscaling.minReplicas", "minReplicas 0 needs autoscaling.scaleToZero"],
    ),
    (
        "scale to zero above min replicas 0",
        _set("spec.autoscaling", {"enabled": True, "minReplicas": 1, "scaleToZero": {}}),
        ["spec.autoscaling.scaleToZero", "needs autoscaling.minReplicas 0"],
    ),
    (
        "scale to zero without autoscaling",
        _set("spec.autoscaling", {"minReplicas": 0, "scaleToZero": {"idleSeconds": 60}}),
        ["spec.autoscaling.scaleToZero", "needs autoscaling.enabled true"],
    ),
    (
        "scale to zero after too short an idle time",
        _set(
            "spec.autoscaling",
            {"enabled": True, "minReplicas": 0, "scaleToZero": {"idleSeconds": 5}},
        ),
        ["spec.autoscaling.scaleToZero.idleSeconds", "greater than or equal to 10"],
    ),
    (
        "disruption budget blocking every eviction",
        _set("spec.disruptionBudget", {"minAvailable": 2}),
        ["spec.disruptionBudget.minAvailable", "less than replicas"],
    ),
    (
        "input longer than the largest bucket",
        _set("spec.model.maxInputLength", 512),
        ["spec.model.maxInputLength", "largest warmup.sequenceBuckets"],
    ),
    (
        "not a quantity",
        _set("spec.resources.requests.cpu", "lots"),
        ["spec.resources.requests.cpu", "should match"],
    ),
    (
        "memory request above its limit",
        _set("spec.resources", {"requests": {"memory": "2Gi"}, "limits": {"memory": "1024Mi"}}),
        [
            "spec.resources.requests[memory]",
            "resources.requests.memory (2Gi) must be <= resources.limits.memory (1024Mi)",
        ],
    ),
    (
        "memory request above its limit by half a GiB",
        _set("spec.resources", {"requests": {"memory": "1.5Gi"}, "limits": {"memory": "1Gi"}}),
        ["resources.requests.memory (1.5Gi) must be <= resources.limits.memory (1Gi)"],
    ),
    (
        "cpu request above its limit",
        _set("spec.resources", {"requests": {"cpu": "2"}, "limits": {"cpu": "1500m"}}),
        [
            "spec.resources.requests[cpu]",
            "resources.requests.cpu (2) must be <= resources.limits.cpu (1500m)",
        ],
    ),
    (
        "gpu request other than its limit",
        _set(
            "spec.resources", {"requests": {"nvidia.com/gpu": 2}, "limits": {"nvidia.com/gpu": 1}}
        ),
        [
            "spec.resources.requests[nvidia.com/gpu]",
            "resources.requests[nvidia.com/gpu] (2) must equal"
            " resources.limits[nvidia.com/gpu] (1)",
        ],
    ),
    (
        "volume without a claim",
        _set("spec.model.volume", {"path": "minilm"}),
        ["spec.model.volume.claimName", "Required value"],
    ),
    (
        "name that cannot name a Service",
        _set("metadata.name", "9-minilm"),
        ["metadata.name", "must start with a letter"],
    ),
    (
        "name too long for pod names",
        _set("metadata.name", "m" * 60),
        ["metadata.name", "at most 47 characters"],
    ),
]


@pytest.fixture(scope="module")
def crd(devcluster: Any) -> None:
    install_crd(devcluster)


def test_corpus_is_large_and_distinct() -> None:
    names = [name for name, _, _ in CORPUS]
    assert len(names) >= 15
    assert len(set(names)) == len(names)


@pytest.mark.parametrize(("mistake", "mutate", "words"), CORPUS, ids=[c[0] for c in CORPUS])
def test_invalid_manifest_is_rejected_naming_the_field(
    devcluster: Any, crd: None, namespace: str, mistake: str, mutate: Callable, words: list[str]
) -> None:
    body = copy.deepcopy(example())
    mutate(body)
    result = devcluster.kubectl(
        "apply", "--dry-run=server", "-n", namespace, "-f", "-",
        input=json.dumps(body), check=False,
    )  # fmt: skip
    assert result.returncode != 0, f"{mistake}: accepted"
    for word in words:
        assert word in result.stderr, f"{mistake}: {word!r} not in {result.stderr!r}"


# (case, resource, request, limit, whether Kubernetes refuses the pods): quantities in different
# units, integers as well as strings, each judged by the CRD and by Kubernetes' own validation of
# the Deployment the operator builds from the spec, which must agree.
RESOURCES: list[tuple[str, str, str | int | None, str | int | None, bool]] = [
    ("memory request above its limit", "memory", "2Gi", "1024Mi", True),
    ("memory request above its limit by half", "memory", "1.5Gi", "1Gi", True),
    ("memory request in G above a limit in Gi", "memory", "1.1G", "1Gi", True),
    ("memory request as an exponent above its limit", "memory", "2e9", "1Gi", True),
    ("memory request equal to its limit in other units", "memory", "1Gi", "1024Mi", False),
    ("memory request below its limit", "memory", "1e9", "1Gi", False),
    ("memory request in bytes just below its limit", "memory", 1073741823, "1Gi", False),
    ("memory request only", "memory", "4Gi", None, False),
    ("memory limit only", "memory", None, "512Mi", False),
    ("cpu request above its limit", "cpu", "2", "1500m", True),
    ("cpu request as an integer above its limit", "cpu", 2, "1500m", True),
    ("cpu request equal to its limit", "cpu", "1.5", "1500m", False),
    ("cpu request below its limit", "cpu", 1, "1500m", False),
    ("cpu request only", "cpu", "8", None, False),
    ("cpu limit only", "cpu", None, "250m", False),
    ("ephemeral storage request above its limit", "ephemeral-storage", "2Gi", "1Gi", True),
    ("gpu request above its limit", "nvidia.com/gpu", 2, 1, True),
    ("gpu request below its limit", "nvidia.com/gpu", "1", "2", True),
    ("gpu request equal to its limit", "nvidia.com/gpu", "1", 1, False),
    ("gpu limit only", "nvidia.com/gpu", None, 1, False),
]


@pytest.mark.parametrize(
    ("case", "resource", "requested", "limit", "refused"), RESOURCES, ids=[r[0] for r in RESOURCES]
)
def test_resources_are_refused_at_apply_exactly_when_kubernetes_refuses_the_pods(
    devcluster: Any,
    crd: None,
    namespace: str,
    case: str,
    resource: str,
    requested: str | int | None,
    limit: str | int | None,
    refused: bool,
) -> None:
    """The CRD admits a spec only if the apiserver admits the Deployment the operator builds
    from it: otherwise the service waits on ApplyFailed instead of `kubectl apply` saying what
    to change."""
    from warmgate_operator.builders import Owner, build_deployment
    from warmgate_operator.spec import parse_spec

    body = example()
    given = {"requests": {resource: requested}, "limits": {resource: limit}}
    body["spec"]["resources"] = {
        kind: values for kind, values in given.items() if values[resource] is not None
    }
    service = devcluster.kubectl(
        "apply", "--dry-run=server", "-n", namespace, "-f", "-",
        input=json.dumps(body), check=False,
    )  # fmt: skip
    owner = Owner(name="minilm", namespace=namespace, uid="00000000-0000-4000-8000-000000000041")
    deployment = build_deployment(parse_spec(body["spec"]), owner, UNMAPPED_IMAGE)
    pods = devcluster.kubectl(
        "apply", "--dry-run=server", "-n", namespace, "-f", "-",
        input=json.dumps(deployment), check=False,
    )  # fmt: skip
    assert (pods.returncode != 0) == refused, f"{case}: the Deployment: {pods.stderr}"
    assert (service.returncode != 0) == refused, f"{case}: the EmbeddingService: {service.stderr}"
    if refused:
        for field in ("resources.requests", "resources.limits", str(requested), str(limit)):
            assert field in service.stderr, f"{case}: {field!r} not in {service.stderr!r}"


def test_examples_are_accepted_and_defaulted(devcluster: Any, crd: None, namespace: str) -> None:
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        result = devcluster.kubectl(
            "apply", "--dry-run=server", "-n", namespace, "-f", str(path), "-o", "json"
        )
        stored = json.loads(result.stdout)
        if stored.get("kind") == "EmbeddingService":
            assert stored["spec"]["warmup"]["observedTraffic"]["enabled"] is True, path.name
    minimal = {
        "apiVersion": "warmgate.dev/v1alpha1",
        "kind": "EmbeddingService",
        "metadata": {"name": "minimal"},
        "spec": {"model": {"id": "sentence-transformers/all-MiniLM-L6-v2"}},
    }
    result = devcluster.kubectl(
        "apply", "--dry-run=server", "-n", namespace, "-f", "-", "-o", "yaml",
        input=json.dumps(minimal),
    )  # fmt: skip
    spec = yaml.safe_load(result.stdout)["spec"]
    assert spec["replicas"] == 1
    assert spec["rollout"] == {
        "maxSurge": 1,
        "maxUnavailable": 0,
        "warmGate": True,
        "verifyLatency": False,
        "drainSeconds": 15,
    }
    # No startup timeout by default: the operator sizes it from the measured start.
    assert spec["probes"] == {
        "periodSeconds": 5,
        "forwardTimeoutSeconds": 30,
        "faultThreshold": 3,
        "faultRestartSeconds": 30,
    }
    assert spec["warmup"]["sequenceBuckets"] == [32, 64, 128, 256]
    assert spec["autoscaling"]["scaleDown"]["stabilizationWindowSeconds"] == 300


def test_kubectl_explain_teaches_the_api(devcluster: Any, crd: None) -> None:
    result = devcluster.kubectl("explain", "embeddingservice.spec.warmup")
    assert "batchSizes" in result.stdout
    assert "sequenceBuckets" in result.stdout
    assert "warmup plan" in result.stdout
    result = devcluster.kubectl("explain", "emb.spec.probes.startupTimeoutSeconds")
    assert "failureThreshold" in result.stdout


def test_a_status_computed_from_an_older_read_does_not_overwrite_a_newer_one(
    devcluster: Any, crd: None, namespace: str
) -> None:
    """The traffic observer writes status.observedShapes between a reconcile's read and its
    status write: the write from the older read is refused by the real API server and the
    observer's shapes stay."""
    import asyncio

    from warmgate_kube.client import KubeClient
    from warmgate_kube.kinds import EMBEDDING_SERVICE
    from warmgate_operator.builders import Owner
    from warmgate_operator.reconcile import write_status

    body = example("racy")
    body["metadata"]["namespace"] = namespace
    devcluster.kubectl("apply", "-f", "-", input=json.dumps(body))
    read = get_json(devcluster, "embeddingservice", "racy", "-n", namespace)
    assert read is not None
    meta = read["metadata"]
    owner = Owner(name="racy", namespace=namespace, uid=meta["uid"])
    shapes = [{"batch_size": 8, "seq_len": 64, "count": 5}]
    client = KubeClient(devcluster.api_client(), "warmgate-test")
    try:

        async def race() -> tuple[Any, Any]:
            observed = await client.json_patch(
                EMBEDDING_SERVICE, namespace, "racy",
                [{"op": "add", "path": "/status", "value": {"observedShapes": shapes}}],
                subresource="status",
            )  # fmt: skip
            stale = await write_status(client, owner, {"replicas": 0}, meta["resourceVersion"])
            fresh = await write_status(
                client, owner, {**observed["status"], "replicas": 0},
                observed["metadata"]["resourceVersion"],
            )  # fmt: skip
            return stale, fresh

        stale, fresh = asyncio.run(race())
    finally:
        client.close()
    assert stale is None  # refused: computed before the observer's write
    assert fresh is not None and fresh["status"]["replicas"] == 0
    final = get_json(devcluster, "embeddingservice", "racy", "-n", namespace)
    assert final is not None and final["status"]["observedShapes"] == shapes


def test_scale_to_zero_is_accepted_and_its_idle_time_defaulted(
    devcluster: Any, crd: None, namespace: str
) -> None:
    body = example("sleepy")
    body["spec"]["autoscaling"] = {"enabled": True, "minReplicas": 0, "scaleToZero": {}}
    result = devcluster.kubectl(
        "apply", "--dry-run=server", "-n", namespace, "-f", "-", "-o", "json",
        input=json.dumps(body),
    )  # fmt: skip
    autoscaling = json.loads(result.stdout)["spec"]["autoscaling"]
    assert autoscaling["minReplicas"] == 0
    assert autoscaling["scaleToZero"] == {"idleSeconds": 300}


def alias(name: str = "search", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "warmgate.dev/v1alpha1",
        "kind": "EmbeddingAlias",
        "metadata": {"name": name},
        "spec": spec,
    }


ALIAS_MISTAKES: list[tuple[str, dict[str, Any], list[str]]] = [
    ("no service", alias(), ["spec.service", "Required value"]),
    ("no spec", {**alias(), "spec": None}, ["spec", "Required value"]),
    ("a service name with a dot", alias(service="bge.v2"), ["spec.service", "should match"]),
    ("misspelt field", alias(service="bge", target="x"), ['unknown field "spec.target"']),
]


@pytest.mark.parametrize(
    ("mistake", "body", "words"), ALIAS_MISTAKES, ids=[m[0] for m in ALIAS_MISTAKES]
)
def test_an_invalid_alias_is_rejected_naming_the_field(
    devcluster: Any, crd: None, namespace: str, mistake: str, body: dict, words: list[str]
) -> None:
    result = devcluster.kubectl(
        "apply", "--dry-run=server", "-n", namespace, "-f", "-",
        input=json.dumps(body), check=False,
    )  # fmt: skip
    assert result.returncode != 0, f"{mistake}: accepted"
    for word in words:
        assert word in result.stderr, f"{mistake}: {word!r} not in {result.stderr!r}"


def test_an_alias_is_served_with_its_short_name_and_explained(
    devcluster: Any, crd: None, namespace: str
) -> None:
    """A dotted alias name (as model names often are) is a valid one; `kubectl get emba`
    shows the documented columns."""
    body = alias("bge-small-en-v1.5", service="bge")
    devcluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(body))
    table = devcluster.kubectl("get", "emba", "-n", namespace).stdout
    header = table.splitlines()[0].split()
    assert header == ["NAME", "SERVICE", "READY", "REASON", "AGE"]
    assert "bge-small-en-v1.5" in table and " bge " in table
    explained = devcluster.kubectl("explain", "embeddingalias.spec.service").stdout
    assert "never at another alias" in explained
