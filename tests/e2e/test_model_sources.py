"""Where a pod's model comes from, end to end on the devcluster's real node: the hub (the
default; here the devcluster's own hub, `hubmirror`, since no hub outside this machine can be
reached), an OCI image mounted as an image volume, and the server image itself; and the warm
gate holding back a pod whose files differ from its template siblings' when a branch moves on
the hub between their starts."""

from __future__ import annotations

import json
import urllib.request
import uuid

import pytest
from support.load import LOAD_TEXT, service_load, summary, wait_for_traffic, weights_of

from warmgate_devcluster.hubmirror import set_ref
from warmgate_devcluster.images import MODEL_MINILM_V2, SERVER_MINILM
from warmgate_devcluster.loadgen import first_vector
from warmgate_devcluster.models import MINILM_ID, hub_root, minilm_v2_folder
from warmgate_devcluster.testkit import (
    condition,
    embedding_service,
    service_url,
    wait_ready,
    wait_until,
)
from warmgate_server.source import weights_digest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def embed_once(kube, name: str) -> tuple[float, ...] | None:
    request = urllib.request.Request(
        service_url(kube, name),
        data=json.dumps({"input": LOAD_TEXT}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return first_vector(response.read())


def test_a_branch_that_moves_between_two_pods_of_one_template_is_caught(
    kube, operator, reference_vectors
):
    revisions = kube.devcluster.hub_revisions
    branch = f"moving-{uuid.uuid4().hex[:6]}"
    set_ref(hub_root(), MINILM_ID, branch, revisions["v1"])
    try:
        kube.apply(embedding_service("moving", branch, replicas=1))
        emb = wait_ready(kube, "moving", branch, replicas=1)
        assert emb["status"]["model"]["commit"] == revisions["v1"]
        (first,) = kube.pods("moving")
        with service_load(kube, "moving") as load:
            wait_for_traffic(load, 20)
            # Someone pushes other weights to the branch; then the service scales out. The
            # new pod has the same template, asks for the same revision, and gets v2's files.
            set_ref(hub_root(), MINILM_ID, branch, revisions["v2"])
            kube.patch("embeddingservice", "moving", {"spec": {"replicas": 2}})

            def mismatched() -> dict | None:
                for pod in kube.pods("moving"):
                    warmed = condition(pod, "warmgate.dev/warmed")
                    if warmed.get("reason") == "ModelMismatch":
                        return pod
                return None

            second = wait_until(mismatched, 300, "the gate to refuse the new pod")
            wait_for_traffic(load, 40)
        report = load.report
    finally:
        set_ref(hub_root(), MINILM_ID, branch, None)

    message = condition(second, "warmgate.dev/warmed")["message"]
    assert revisions["v2"] in message and revisions["v1"] in message, message
    assert first["metadata"]["name"] in message and "pin spec.model.revision" in message
    assert condition(second, "Ready").get("status") != "True"
    # Every answer, before and after, came from the first pod's weights.
    assert not report.failed, summary(report.failed)
    assert {weights_of(sample.vector, reference_vectors) for sample in report.samples} == {"v1"}
    assert {sample.pod for sample in report.samples} == {first["metadata"]["name"]}
    emb = kube.get("embeddingservice", "moving")
    assert emb["status"]["model"]["commit"] == revisions["v1"]
    assert any(
        event.get("reason") == "ModelMismatch"
        and event["involvedObject"].get("name") == second["metadata"]["name"]
        for event in kube.events()
    ), "no ModelMismatch event on the refused pod"


def test_a_model_from_an_image_volume_and_one_baked_into_the_server_image(
    kube, operator, reference_vectors
):
    image = {"image": {"reference": MODEL_MINILM_V2.name, "pullPolicy": "Never"}}
    kube.apply(embedding_service("fromimage", "v2", replicas=1, model={"source": image}))
    kube.apply(
        embedding_service(
            "baked", "main", replicas=1, image=SERVER_MINILM.name, model={"source": {"baked": {}}}
        )
    )
    from_image = wait_ready(kube, "fromimage", "v2", replicas=1, timeout=400)
    baked = wait_ready(kube, "baked", "main", replicas=1, timeout=400)

    # The image holds v2's weights; the server image has the real MiniLM baked in.
    assert weights_of(embed_once(kube, "fromimage"), reference_vectors) == "v2"
    assert weights_of(embed_once(kube, "baked"), reference_vectors) == "v1"
    # A folder has no hub commit; what was loaded is named by the weights' digest.
    assert "commit" not in from_image["status"]["model"]
    assert from_image["status"]["model"]["weightsDigest"] == weights_digest(minilm_v2_folder())
    assert (
        baked["status"]["model"]["weightsDigest"] != from_image["status"]["model"]["weightsDigest"]
    )
    (pod,) = kube.pods("fromimage")
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["model"]["image"]["reference"] == MODEL_MINILM_V2.name
    # Clients see the model's id, not the folder it was read from.
    assert pod["spec"]["containers"][0]["args"].count(f"--served-model-name={MINILM_ID}") == 1
