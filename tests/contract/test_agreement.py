"""The operator and the server agree, checked one against the other running for real.

For EmbeddingService specs generated over the CRD's whole range (hypothesis, the bounds read
from the CRD itself), the real apiserver validates and defaults each one (a server-side dry
run: the CEL rules judge it, as `kubectl apply` would); the operator builds its pod from what
the apiserver returned; the server parses that pod's arguments with its own `parse_config`, and
builds its app, whose `/ready` report lists the plan it will warm. Every spec the apiserver
accepts must start a server, and the plan the warm gate expects from the pod must be the plan
that server reports. A last test does the same with one real server process end to end.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from kubernetes import client
from kubernetes.client.rest import ApiException

from warmgate_contract.names import GROUP, PLURAL, VERSION
from warmgate_contract.shapes import Shape
from warmgate_operator import gate
from warmgate_operator.builders import Owner, build_pod_template
from warmgate_operator.spec import parse_spec
from warmgate_server.app import create_app
from warmgate_server.config import parse_config
from warmgate_server.context import RUNTIME
from warmgate_server.testing import ServerProcess, minilm_path

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "crds" / "warmgate.dev_embeddingservices.yaml").read_text())
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
OWNER = Owner(name="agree", namespace="default", uid="00000000-0000-4000-8000-000000000001")


def field(path: str) -> dict[str, Any]:
    node = SCHEMA
    for part in path.split("."):
        node = node["properties"][part]
    return node


def within(path: str, item: bool = False) -> st.SearchStrategy[int]:
    """Integers over the CRD's range for `path` (its items' range with `item`)."""
    node = field(path)["items"] if item else field(path)
    return st.integers(node.get("minimum", 0), node.get("maximum", 1 << 20))


def int_list(path: str) -> st.SearchStrategy[list[int]]:
    node = field(path)
    return st.lists(within(path, item=True), min_size=node["minItems"], max_size=node["maxItems"])


def choice(path: str) -> st.SearchStrategy[str]:
    return st.sampled_from(field(path)["enum"])


@st.composite
def specs(draw: st.DrawFn) -> dict[str, Any]:
    """A spec over the CRD's range, drawn so that its CEL rules mostly hold (the apiserver
    judges; what it rejects is discarded)."""
    batch_sizes = draw(int_list("warmup.batchSizes"))
    buckets = draw(int_list("warmup.sequenceBuckets"))
    spec: dict[str, Any] = {
        "model": {
            "id": draw(st.sampled_from(["sentence-transformers/all-MiniLM-L6-v2", "BAAI/bge"])),
            "revision": draw(st.sampled_from(["main", "v2", "2024-02", "a" * 40])),
            "pooling": draw(choice("model.pooling")),
            "normalize": draw(st.booleans()),
        },
        "runtime": {"device": draw(choice("runtime.device"))},
        "batching": {
            # At least the largest warmup batch and the largest shape, as the CEL rules ask.
            "maxBatchSize": max(batch_sizes) + draw(st.integers(0, 64)),
            "maxBatchTokens": max(batch_sizes) * max(buckets) + draw(st.integers(0, 4096)),
            "maxWaitMilliseconds": draw(within("batching.maxWaitMilliseconds")),
            "maxConcurrentRequests": draw(within("batching.maxConcurrentRequests")),
            "payloadLimitBytes": draw(within("batching.payloadLimitBytes")),
            "padBatch": draw(st.booleans()),
        },
        "warmup": {
            "enabled": draw(st.booleans()),
            "batchSizes": batch_sizes,
            "sequenceBuckets": buckets,
        },
        "rollout": {"drainSeconds": draw(within("rollout.drainSeconds"))},
    }
    if spec["runtime"]["device"] == "cuda":
        spec["runtime"]["dtype"] = draw(choice("runtime.dtype"))
    if draw(st.booleans()):
        spec["model"]["maxInputLength"] = draw(st.integers(1, max(buckets)))
    if draw(st.booleans()):
        spec["model"]["servedName"] = draw(st.sampled_from(["minilm", "bge-small-en"]))
    return spec


@pytest.fixture(scope="module")
def custom(devcluster: Any, crd_installed: None) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(devcluster.api_client())


@pytest.fixture(scope="module")
def crd_installed(devcluster: Any) -> None:
    from warmgate_devcluster.testkit import install_crd

    install_crd(devcluster)


def admitted(custom: client.CustomObjectsApi, spec: dict[str, Any]) -> dict[str, Any] | None:
    """What the apiserver would store (defaults applied), or None when it rejects the spec."""
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "EmbeddingService",
        "metadata": {"name": "agree", "namespace": "default"},
        "spec": spec,
    }
    try:
        return custom.create_namespaced_custom_object(
            GROUP, VERSION, "default", PLURAL, body, dry_run="All"
        )
    except ApiException as error:
        if error.status == 422:
            return None
        raise


def server_container(stored: dict[str, Any]) -> dict[str, Any]:
    template = build_pod_template(parse_spec(stored["spec"]), OWNER, "img")
    (container,) = template["spec"]["containers"]
    return {"spec": template["spec"], "container": container}


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much],
)
@given(spec=specs())
def test_every_accepted_spec_starts_a_server_that_reports_the_plan_the_gate_expects(
    custom: client.CustomObjectsApi, spec: dict[str, Any]
) -> None:
    stored = admitted(custom, spec)
    assume(stored is not None)
    pod = server_container(stored)
    args = pod["container"]["args"]
    # The server reads exactly what the operator wrote (it raises ConfigError otherwise).
    config = parse_config(args, environ={})
    report = create_app(config)[RUNTIME].lifecycle.report()
    reported = {Shape.from_json(item) for item in report["planned_shapes"]}
    expected = gate.expectation_for({"spec": pod["spec"]})
    assert expected is not None, args
    assert expected.required_shapes == reported, args
    assert (expected.model_id, expected.revision) == (
        report["model"]["id"],
        report["model"]["revision"],
    )


@pytest.mark.slow
def test_a_real_server_passes_the_gate_built_from_the_operators_own_pod(
    custom: client.CustomObjectsApi, tmp_path: Path
) -> None:
    spec = {
        "model": {"id": "sentence-transformers/all-MiniLM-L6-v2", "revision": "r7"},
        "batching": {"maxBatchSize": 4, "maxBatchTokens": 128},
        "warmup": {"batchSizes": [1, 4], "sequenceBuckets": [16, 32]},
    }
    stored = admitted(custom, spec)
    assert stored is not None
    pod = server_container(stored)
    # The pod's own arguments, but the model read from the local folder (its id resolves
    # through a hub cache on a cluster) and a free port on this machine.
    args = [a for a in pod["container"]["args"] if not a.startswith(("--model=", "--port="))]
    args += [f"--model={minilm_path()}", "--port=0"]
    expected = gate.expectation_for({"spec": pod["spec"]})
    with ServerProcess(args, log_path=tmp_path / "server.log") as server:
        report = server.wait_ready(300)
    verdict = gate.evaluate_report(
        report, gate.Expectation(str(minilm_path()), "r7", expected.required_shapes, 0)
    )
    assert verdict.passed, (verdict.message, json.dumps(report)[:2000])
    assert {Shape.from_json(item) for item in report["planned_shapes"]} == expected.required_shapes
