"""Where a pod's model comes from, end to end on the devcluster's real node: the hub (the
default; here the devcluster's own hub, `hubmirror`, since no hub outside this machine can be
reached), a PersistentVolumeClaim filled by the Job of `examples/model-from-pvc.yaml` (a plain
folder, and a Hugging Face cache), an OCI image mounted as an image volume, and the server image
itself; and the warm gate holding back a pod whose files differ from its template siblings'
when a branch moves on the hub between their starts."""

from __future__ import annotations

import copy
import json
import os
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.load import LOAD_TEXT, service_load, summary, wait_for_traffic, weights_of

from warmgate_devcluster.hubmirror import set_ref
from warmgate_devcluster.images import MODEL_MINILM_V2, SERVER_MINILM
from warmgate_devcluster.loadgen import first_vector
from warmgate_devcluster.models import MINILM_ID, hub_root, minilm_folder, minilm_v2_folder
from warmgate_devcluster.testkit import (
    condition,
    embedding_service,
    p_revision,
    service_url,
    wait_ready,
    wait_until,
)
from warmgate_server.source import weights_digest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PVC_EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "model-from-pvc.yaml"
SERVER_USER = 10001


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


# ------------------------------------------------------------------ a PersistentVolumeClaim
def pvc_example(kind: str) -> dict[str, Any]:
    (doc,) = [doc for doc in yaml.safe_load_all(PVC_EXAMPLE.read_text()) if doc["kind"] == kind]
    return doc


@pytest.fixture
def model_claim(kube, tmp_path: Path) -> Iterator[str]:
    """The example's claim, bound to a hostPath volume on the devcluster's node (what a
    cluster's storage would provision), writable by the server image's user as the Job's
    fsGroup makes a real volume (a hostPath ignores fsGroup)."""
    folder = tmp_path / "volume"
    folder.mkdir()
    os.chown(folder, SERVER_USER, SERVER_USER)
    claim = pvc_example("PersistentVolumeClaim")
    volume_name = f"{kube.namespace}-models"
    volume = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": volume_name},
        "spec": {
            "capacity": claim["spec"]["resources"]["requests"],
            "accessModes": claim["spec"]["accessModes"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": "",
            "hostPath": {"path": str(folder), "type": "Directory"},
        },
    }
    kube.devcluster.kubectl("apply", "-f", "-", input=json.dumps(volume))
    claim["spec"].update(storageClassName="", volumeName=volume_name)
    kube.apply(claim)
    try:
        yield claim["metadata"]["name"]
    finally:
        # Deleted once the namespace's deletion releases the claim (pv-protection).
        kube.devcluster.kubectl("delete", "pv", volume_name, "--wait=false", check=False)


def fill(kube, name: str, revision: str, *target: str) -> None:
    """Run the example's Job (`hf download` in the server image, as the server's user) for
    MiniLM at `revision` into `target` (--local-dir or --cache-dir) on the claim, from the
    devcluster's hub, and wait for it to finish."""
    job = copy.deepcopy(pvc_example("Job"))
    job["metadata"]["name"] = name
    (container,) = job["spec"]["template"]["spec"]["containers"]
    command, _model, *_options = container["args"]
    container["args"] = [command, MINILM_ID, "--revision", revision, *target]
    container["env"].append({"name": "HF_ENDPOINT", "value": kube.devcluster.hub_endpoint})
    kube.apply(job)
    done = kube.run(
        "wait", "--for=condition=complete", f"job/{name}", "--timeout=300s", check=False
    )
    assert done.returncode == 0, kube.run("logs", f"job/{name}", check=False).stdout[-3000:]


def test_a_model_from_a_claim_as_a_folder_and_as_a_hugging_face_cache_and_its_reload(
    kube, operator, reference_vectors, model_claim
):
    # The example's two ways to fill a claim: a plain folder, and a Hugging Face cache.
    fill(kube, "fill-folder", "v2", "--local-dir", "/models/minilm-v2")
    fill(kube, "fill-cache", "v1", "--cache-dir", "/models/hub")
    folder = {"volume": {"claimName": model_claim, "path": "minilm-v2"}}
    kube.apply(embedding_service("fromclaim", "v2", replicas=1, model={"source": folder}))
    cache = {"volume": {"claimName": model_claim, "layout": "hubCache"}}
    kube.apply(embedding_service("fromcache", "v1", replicas=1, model={"source": cache}))
    from_folder = wait_ready(kube, "fromclaim", "v2", replicas=1, timeout=400)
    from_cache = wait_ready(kube, "fromcache", "v1", replicas=1, timeout=400)

    assert weights_of(embed_once(kube, "fromclaim"), reference_vectors) == "v2"
    assert weights_of(embed_once(kube, "fromcache"), reference_vectors) == "v1"
    # A folder is named by its weights; a cache also by the commit its revision points at.
    assert "commit" not in from_folder["status"]["model"]
    assert from_folder["status"]["model"]["weightsDigest"] == weights_digest(minilm_v2_folder())
    revisions = kube.devcluster.hub_revisions
    assert from_cache["status"]["model"]["commit"] == revisions["v1"]
    assert from_cache["status"]["model"]["weightsDigest"] == weights_digest(minilm_folder())
    # The claim is mounted read-only and nothing is downloaded at start.
    (pod,) = kube.pods("fromcache")
    (server,) = pod["spec"]["containers"]
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "model"]
    assert volume["persistentVolumeClaim"] == {"claimName": model_claim, "readOnly": True}
    env = {item["name"]: item.get("value") for item in server["env"]}
    assert env["HF_HUB_OFFLINE"] == "1" and env["HF_HOME"] == "/var/lib/warmgate/models"
    kube.run("delete", "embeddingservice", "fromclaim", "--wait=false")

    # A reload, as the example says: download the new revision into the cache, then ask for it.
    # Requests keep being answered, by the old weights and then by the new.
    fill(kube, "fill-cache-v2", "v2", "--cache-dir", "/models/hub")
    with service_load(kube, "fromcache") as load:
        wait_for_traffic(load, 20)
        kube.patch("embeddingservice", "fromcache", {"spec": {"model": {"revision": "v2"}}})
        reloaded = wait_ready(kube, "fromcache", "v2", replicas=1, timeout=400)
        # The old pod drains (it answers what kube-proxy still sends it until its endpoint is
        # gone from the node's rules): once it has exited, every answer is v2's.
        wait_until(
            lambda: {p_revision(pod) for pod in kube.pods("fromcache")} == {"v2"},
            120,
            "the old pod gone",
        )
        wait_for_traffic(load, 20)
    assert reloaded["status"]["model"]["commit"] == revisions["v2"]
    assert not load.report.failed, summary(load.report.failed)
    served = [weights_of(sample.vector, reference_vectors) for sample in load.report.samples]
    assert served[0] == "v1" and served[-1] == "v2" and set(served) == {"v1", "v2"}
