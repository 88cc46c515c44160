"""What a person sees driving warmgate with kubectl: the examples apply, `get` prints the
columns that matter, `explain` explains, `describe` shows conditions and Events, `wait` and
`scale` work. One real MiniLM pod serves the tests that need a Ready EmbeddingService."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from support.kubectl import (
    EXAMPLES,
    UNMAPPED_IMAGE,
    Operator,
    get_json,
    install_crd,
    tiny_minilm,
    wait_until,
)

pytestmark = pytest.mark.cluster

READY_TIMEOUT = 300
MODEL = "sentence-transformers/all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def ns(devcluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A namespace with the CRD installed and an operator watching it (module-scoped, so the
    tests share one warming server pod)."""
    name = f"kubectl-{uuid.uuid4().hex[:8]}"
    install_crd(devcluster)
    devcluster.kubectl("create", "namespace", name)
    operator = Operator(devcluster, name, tmp_path_factory.mktemp("kubectl") / "operator.log")
    try:
        yield name
    finally:
        operator.stop()
        print("\n".join(operator.log().splitlines()[-40:]))  # shown when a test failed
        devcluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def minilm(devcluster: Any, ns: str) -> str:
    """A real (tiny) MiniLM EmbeddingService, applied once; not waited for."""
    devcluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(tiny_minilm("minilm")))
    return "minilm"


def kubectl_wait_ready(cluster: Any, ns: str, name: str) -> Any:
    return cluster.kubectl(
        "wait", "--for=condition=Ready", f"emb/{name}", "-n", ns,
        f"--timeout={READY_TIMEOUT}s", check=False, timeout=READY_TIMEOUT + 30,
    )  # fmt: skip


@pytest.fixture
def ready(devcluster: Any, ns: str, minilm: str) -> str:
    result = kubectl_wait_ready(devcluster, ns, minilm)
    assert result.returncode == 0, (result.stderr, get_json(devcluster, "emb", minilm, "-n", ns))
    return minilm


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_every_example_is_accepted_by_the_apiserver(devcluster: Any, ns: str, example: str):
    """Server-side dry run: the CRD's schema and CEL rules judge it, nothing is created."""
    result = devcluster.kubectl(
        "apply", "--dry-run=server", "-n", ns, "-f", str(EXAMPLES / example), check=False
    )
    assert result.returncode == 0, result.stderr
    kinds = [doc["kind"] for doc in yaml.safe_load_all((EXAMPLES / example).read_text()) if doc]
    assert "EmbeddingService" in kinds
    assert result.stdout.count("(server dry run)") == len(kinds), result.stdout


def test_a_broken_example_is_rejected_with_the_field_named(devcluster: Any, ns: str) -> None:
    """The dry run above really validates: the GPU example on CPU breaks a CEL rule."""
    docs = list(yaml.safe_load_all((EXAMPLES / "gpu-fp16-autoscaling.yaml").read_text()))
    (service,) = [doc for doc in docs if doc["kind"] == "EmbeddingService"]
    service["spec"]["runtime"]["device"] = "cpu"
    result = devcluster.kubectl(
        "apply", "--dry-run=server", "-n", ns, "-f", "-", input=yaml.safe_dump(service), check=False
    )
    assert result.returncode != 0
    assert "runtime.dtype float16 needs runtime.device cuda" in result.stderr


def test_kubectl_wait_for_ready(devcluster: Any, ns: str, minilm: str) -> None:
    result = kubectl_wait_ready(devcluster, ns, minilm)
    assert result.returncode == 0, (result.stderr, get_json(devcluster, "emb", minilm, "-n", ns))
    assert "condition met" in result.stdout


def test_kubectl_get_shows_model_task_ready_serving_standby_warmed_reason_and_age(
    devcluster: Any, ns: str, ready: str
) -> None:
    table = devcluster.kubectl("get", "emb", ready, "-n", ns).stdout.splitlines()
    assert table[0].split() == [
        "NAME", "MODEL", "TASK", "READY", "SERVING", "STANDBY", "WARMED", "REASON", "AGE"
    ]  # fmt: skip
    name, model, task, ready_column, serving, standby, warmed, reason, age = table[1].split()
    # The task the serving pod's server read from the model's folder (its /ready report).
    assert (name, model, task, ready_column, serving, standby, warmed, reason) == (
        ready, MODEL, "embed", "1/1", "1", "0", "1", "AllReplicasReady"
    )  # fmt: skip
    assert re.fullmatch(r"\d+[smhd]\w*", age), age
    wide = devcluster.kubectl("get", "embeddingservices", "-n", ns, "-o", "wide").stdout
    assert wide.splitlines()[0].split()[:3] == ["NAME", "MODEL", "REVISION"]
    assert " main " in wide.splitlines()[1]


def test_kubectl_explain_explains_the_warmup_plan(devcluster: Any) -> None:
    text = devcluster.kubectl("explain", "embeddingservice.spec.warmup").stdout
    assert "KIND:       EmbeddingService" in text
    for field in ("batchSizes", "sequenceBuckets", "observedTraffic", "enabled"):
        assert field in text
    assert "warmup plan" in text.lower()
    deeper = devcluster.kubectl("explain", "emb.spec.warmup.observedTraffic.maxShapes").stdout
    assert "Most frequent shapes" in deeper


def test_kubectl_describe_shows_conditions_and_events(devcluster: Any, ns: str, ready: str) -> None:
    text = devcluster.kubectl("describe", "emb", ready, "-n", ns).stdout
    conditions = text.split("Conditions:", 1)[1].split("Events:", 1)[0]
    for kind, reason in (("Ready", "AllReplicasReady"), ("Warmed", "AllReplicasWarmed")):
        assert re.search(rf"Type:\s+{kind}\b", conditions), conditions
        assert reason in conditions
    events = text.split("Events:", 1)[1]
    assert re.search(r"Normal\s+Created\s+", events), events


def test_kubectl_scale_sets_replicas_through_the_scale_subresource(
    devcluster: Any, ns: str
) -> None:
    """On an EmbeddingService whose pods never start (unmapped image): no server processes."""
    body = tiny_minilm("scaled", image=UNMAPPED_IMAGE)
    devcluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(body))
    devcluster.kubectl("scale", "emb/scaled", "-n", ns, "--replicas=3")
    assert get_json(devcluster, "emb", "scaled", "-n", ns)["spec"]["replicas"] == 3
    wait_until(
        lambda: (get_json(devcluster, "deployment", "scaled", "-n", ns) or {}).get("spec", {})
        .get("replicas") == 3,
        60, "the Deployment to follow kubectl scale",
    )  # fmt: skip

    path = f"/apis/warmgate.dev/v1alpha1/namespaces/{ns}/embeddingservices/scaled/scale"

    def scale() -> dict[str, Any] | None:
        found = json.loads(devcluster.kubectl("get", "--raw", path).stdout)
        return found if found["status"].get("replicas") == 3 else None

    found = wait_until(scale, 60, "the scale subresource to report 3 pods")
    assert found["spec"]["replicas"] == 3
    assert found["status"]["selector"] == (
        "app.kubernetes.io/instance=scaled,app.kubernetes.io/name=warmgate-server"
    )
    row = devcluster.kubectl("get", "emb", "scaled", "-n", ns, "--no-headers").stdout.split()
    assert "0/3" in row[2:4], row  # after the task, which no pod has told yet
    devcluster.kubectl("delete", "emb", "scaled", "-n", ns, "--wait=false")
