"""warmgate-router end to end on the real node: the router in-cluster from its image (two
replicas, the chart's own templates, RBAC and Service), EmbeddingServices served by real
MiniLM pods, the operator as a process. Clients at their defaults through the router's node
port: the OpenAI SDK (pooled, retries off), LangChain (tiktoken ids) and LlamaIndex.

- Two services and an alias behind one address; the alias switched under load: 0 failed, every
  answer that arrived before the switch from the old target, every request sent after the
  first new answer from the new one, and each answer's vector from the service its header names.
- A pod deleted and a rollout under pooled load through the router: 0 failed, 0 cold.
- A router replica deleted under load: the other serves on, 0 failed; one killed (SIGKILL)
  under load: the other serves on, failures only in the moments after the kill.
- Scale to zero after the idle window, then requests: held, answered warm, the hold time next
  to the pod's start and warmup; past --max-held-requests a 503 with Retry-After. The
  operator's time of that wake (status.scaleToZero.wakeSeconds, what the next hold is sized
  from) agrees with how long the router held.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from support.flag_embedding import flag_embedding_m3
from support.load import LOAD_TEXT, pooled_load, weights_of

from warmgate_contract.names import SERVICE_HEADER
from warmgate_devcluster.testkit import (
    ROUTER_SELECTOR,
    condition,
    embedding_service,
    node_port,
    render_router,
    wait_ready,
    wait_until,
    warmup_seconds,
)
from warmgate_router.proxy import HELD_HEADER

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SMALL = {"requests": {"cpu": "100m", "memory": "512Mi"}}
MAX_HELD = 6


class RouterInstall:
    def __init__(self, kube, service: str, port: int) -> None:
        self.kube = kube
        self.service = service
        self.url = f"http://{kube.devcluster.node_ip}:{port}"

    def pods(self) -> list[dict]:
        found = self.kube.get("pods", selector=ROUTER_SELECTOR) or {}
        return [p for p in found.get("items", []) if not p["metadata"].get("deletionTimestamp")]

    def get(self, path: str) -> tuple[int, dict, Any]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=30) as response:
                return response.status, dict(response.headers), json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, dict(error.headers), json.loads(error.read() or b"null")
        except OSError:  # refused until kube-proxy has written the node port's rules
            return 0, {}, None

    def post(self, path: str, body: Any, timeout: float = 200) -> tuple[int, dict, Any]:
        request = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, dict(response.headers), json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, dict(error.headers), json.loads(error.read() or b"null")


@pytest.fixture
def router(kube, devcluster) -> Iterator[RouterInstall]:
    """The chart's router templates, rendered for this namespace and applied."""
    service = render_router(
        kube,
        "--set", "router.service.type=NodePort",
        "--set", f"router.maxHeldRequests={MAX_HELD}",
        "--set", "router.resources.requests.cpu=20m",
    )  # fmt: skip
    install = RouterInstall(kube, service, node_port(kube, service))
    wait_until(lambda: install.get("/ready")[0] == 200, 60, "the router's node port")
    yield install
    # The router's objects go with the test's namespace.


def test_names_and_an_alias_switch_through_the_router_never_mix_vector_spaces(
    kube, devcluster, operator, router, reference_vectors, report, tiktoken_cache, monkeypatch
) -> None:
    kube.apply(
        embedding_service("old", "v1", replicas=2, resources=SMALL, service={"type": "ClusterIP"})
    )
    kube.apply(
        embedding_service(
            "new", "v2", replicas=1, resources=SMALL, service={"type": "ClusterIP"},
        )
    )  # fmt: skip
    kube.apply(
        {
            "apiVersion": "warmgate.dev/v1alpha1",
            "kind": "EmbeddingAlias",
            "metadata": {"name": "search"},
            "spec": {"service": "old"},
        }
    )
    wait_ready(kube, "old", "v1", replicas=2, timeout=420)
    wait_ready(kube, "new", "v2", replicas=1, timeout=420)
    status, _, listed = router.get("/v1/models")
    assert status == 200
    models = {m["id"]: m for m in listed["data"]}
    assert set(models) == {"old", "new", "search"}
    assert models["search"]["alias_of"] == f"{kube.namespace}/old"
    wait_until(lambda: router.get("/v1/models")[2]["data"][0]["state"] == "ready", 60, "ready")

    # The OpenAI SDK reaches each name; the answer says which service served it.
    import openai

    sdk = openai.OpenAI(base_url=router.url + "/v1", api_key="-", max_retries=0)
    for name, service, revision in (
        ("old", "old", "v1"),
        ("new", "new", "v2"),
        ("search", "old", "v1"),
    ):
        raw = sdk.embeddings.with_raw_response.create(model=name, input=LOAD_TEXT)
        vector = list(raw.parse().data[0].embedding[:16])
        assert raw.headers[SERVICE_HEADER] == f"{kube.namespace}/{service}"
        assert raw.headers["x-warmgate-revision"] == revision
        assert weights_of(vector, reference_vectors) == revision

    # LangChain sends tiktoken ids by default; LlamaIndex batches at its own size.
    from langchain_openai import OpenAIEmbeddings
    from llama_index.embeddings.openai import OpenAIEmbedding

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tiktoken_cache))
    for name, revision in (("new", "v2"), ("search", "v1")):
        chain = OpenAIEmbeddings(
            model=name, base_url=router.url + "/v1", api_key="-", max_retries=0
        )
        vectors = chain.embed_documents([LOAD_TEXT, "샘플 문장입니다"])
        assert weights_of(vectors[0][:16], reference_vectors) == revision, name
    for name, revision in (("old", "v1"), ("search", "v1")):
        index = OpenAIEmbedding(model_name=name, api_base=router.url + "/v1", api_key="-")
        batch = index.get_text_embedding_batch([LOAD_TEXT] * 12)
        assert {weights_of(v[:16], reference_vectors) for v in batch} == {revision}, name

    # The alias switched under pooled load, four inputs a request: every vector of an answer
    # from the one service its header names.
    with pooled_load(
        router.url + "/v1", threads=3, model="search", text=LOAD_TEXT, inputs=4
    ) as load:
        wait_until(lambda: len(load.answers) >= 30, 60, "answers before the switch")
        switched = time.monotonic()
        kube.patch("embeddingalias", "search", {"spec": {"service": "new"}})
        wait_until(
            lambda: any(a.service.endswith("/new") for a in load.answers if a.service),
            30,
            "an answer from the new target",
        )
        first_new = min(a.at for a in load.answers if a.service and a.service.endswith("/new"))
        wait_until(lambda: len([a for a in load.answers if a.sent > first_new]) >= 30, 60, "more")
    answers = load.answers
    assert load.errors == []
    for answer in answers:
        expected = "v1" if answer.service.endswith("/old") else "v2"
        revisions = [weights_of(list(vector), reference_vectors) for vector in answer.vectors]
        assert revisions == [expected] * 4, f"{answer.service} answered with {revisions}"
    before = [a for a in answers if a.at < switched]
    after = [a for a in answers if a.sent > first_new]
    assert before and all(a.service.endswith("/old") for a in before)
    assert after and all(a.service.endswith("/new") for a in after)
    report(
        f"alias switch: {len(answers)} answers, 0 failed; first answer from the new target "
        f"{first_new - switched:.2f} s after the patch"
    )

    # A pod deleted and a rollout (a model reload) under pooled load: 0 failed, 0 cold.
    with pooled_load(router.url + "/v1", threads=2, model="old", text=LOAD_TEXT) as load:
        wait_until(lambda: len(load.answers) >= 20, 60, "answers")
        victim = kube.pods("old")[0]["metadata"]["name"]
        kube.run("delete", "pod", victim, "--wait=false")
        kube.patch("embeddingservice", "old", {"spec": {"model": {"revision": "v2"}}})
        wait_ready(kube, "old", "v2", replicas=2, timeout=420)
        count = len(load.answers)
        wait_until(lambda: len(load.answers) >= count + 20, 60, "answers after the rollout")
    assert load.errors == []
    assert {a.cold for a in load.answers} == {"0"}
    assert load.answers[-1].revision == "v2"

    # A router replica deleted under load: the other one serves on, 0 failed.
    with pooled_load(router.url + "/v1", threads=2, model="new", text=LOAD_TEXT) as load:
        wait_until(lambda: len(load.answers) >= 20, 60, "answers")
        kube.run("delete", "pod", router.pods()[0]["metadata"]["name"], "--wait=true")
        count = len(load.answers)
        wait_until(lambda: len(load.answers) >= count + 40, 90, "answers after a router left")
    assert load.errors == []

    # A router replica killed (SIGKILL: no drain) under load: the one that forwarded the latest
    # answers, with the pooled SDK at its default retries. Requests the killed process held,
    # or sent to it before its endpoint left the Service, may fail; the other replica serves on.
    wait_until(lambda: len(router.pods()) == 2 and all(
        condition(p, "Ready").get("status") == "True" for p in router.pods()), 90,
        "two Ready router replicas")  # fmt: skip
    with pooled_load(router.url + "/v1", threads=2, model="new", text=LOAD_TEXT, retries=2) as load:
        wait_until(lambda: len({a.router for a in load.answers}) >= 1 and len(load.answers)
                   >= 20, 60, "answers")  # fmt: skip
        victim_name = load.answers[-1].router
        victim = next(p for p in router.pods() if p["metadata"]["name"] == victim_name)
        killed_at = time.monotonic()
        for pid in devcluster.container_pids(victim, "router"):
            os.kill(pid, signal.SIGKILL)
        wait_until(lambda: len([a for a in load.answers if a.sent > killed_at + 10]) >= 40, 120,
                   "answers well after the kill")  # fmt: skip
    after_kill = [a for a in load.answers if a.sent > killed_at]
    survivors = {a.router for a in after_kill} - {victim_name}
    assert survivors, "no answer from the other replica after the kill"
    late = [sent - killed_at for sent in load.failed_sent if sent > killed_at + 10]
    assert late == [], (late, load.errors)
    report(
        f"router replica killed under pooled load: {len(load.errors)} failed (sent within "
        f"10 s of the kill), {len(after_kill)} answered after it, by {sorted(survivors)} and "
        f"{'the restarted one' if victim_name in {a.router for a in after_kill} else 'no other'}"
    )


def test_scale_to_zero_and_back_holds_requests_and_answers_them_warm(
    kube, operator, router, report
) -> None:
    kube.apply(
        embedding_service(
            "idle", "v1", replicas=1, resources=SMALL, service={"type": "ClusterIP"},
            autoscaling={
                "enabled": True, "minReplicas": 0, "maxReplicas": 2,
                "scaleToZero": {"idleSeconds": 10},
            },
        )
    )  # fmt: skip
    wait_ready(kube, "idle", "v1", replicas=1, timeout=420)

    def timed(woken: bool) -> int | None:
        """status.scaleToZero.wakeSeconds once the operator has timed the first start (or,
        `woken`, a wake) to a pod serving."""
        emb = kube.get("embeddingservice", "idle") or {}
        history = (emb.get("status") or {}).get("scaleToZero") or {}
        if not history.get("awakeAt") or woken != ("lastWokeAt" in history):
            return None
        return history.get("wakeSeconds")

    # Its first start is timed before any wake: what a first wake's hold is sized from.
    first_start = wait_until(lambda: timed(woken=False), 30, "the first start's time")

    # Steady traffic through the router for three idle windows keeps it up: the router's
    # last-request writes land inside every window.
    until = time.monotonic() + 30
    while time.monotonic() < until:
        status, _, _ = router.post("/v1/embeddings", {"model": "idle", "input": "still here"})
        assert status == 200
        emb = kube.get("embeddingservice", "idle") or {}
        assert emb["spec"].get("replicas") == 1, "scaled to zero while serving"
        assert condition(emb, "Ready").get("reason") != "ScaledToZero"
        time.sleep(0.5)

    def at_zero() -> dict | None:
        emb = kube.get("embeddingservice", "idle") or {}
        ready = condition(emb, "Ready")
        scaled = emb.get("spec", {}).get("replicas") == 0 and ready.get("reason") == "ScaledToZero"
        return emb if scaled and not kube.pods("idle") else None

    wait_until(at_zero, 180, "the operator to scale the idle service to zero")
    printed = kube.run("get", "emb", "idle").stdout
    assert "ScaledToZero" in printed
    _, _, listed = router.get("/v1/models")
    assert {m["id"]: m["state"] for m in listed["data"]}["idle"] == "scaled-to-zero"

    # A burst while at zero: MAX_HELD held and answered warm, the rest refused at once.
    results: list[tuple[int, dict, Any]] = []
    started = time.monotonic()

    def one(index: int) -> None:
        results.append(router.post("/v1/embeddings", {"model": "idle", "input": f"wake {index}"}))

    # Held requests are spread over both router replicas by kube-proxy: each holds up to
    # MAX_HELD; 3 * MAX_HELD sent at once leave some past the limit on at least one replica.
    threads = [threading.Thread(target=one, args=(i,)) for i in range(3 * MAX_HELD)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    woke = time.monotonic() - started
    served = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 503]
    assert len(served) + len(refused) == 3 * MAX_HELD, [r[0] for r in results]
    assert served and refused, [(r[0], r[2]) for r in results[:3]]
    assert all(r[1].get("X-Warmgate-Cold") == "0" for r in served)
    assert all(r[1].get("Retry-After") for r in refused)
    assert all("--max-held-requests" in r[2]["error"]["message"] for r in refused)
    held_ms = max(int(r[1]["X-Warmgate-Held-Ms"]) for r in served)
    pod = kube.pods("idle")[0]
    created = datetime.fromisoformat(pod["metadata"]["creationTimestamp"].replace("Z", "+00:00"))
    became_ready = condition(pod, "Ready").get("lastTransitionTime") or ""
    ready = datetime.fromisoformat(became_ready.replace("Z", "+00:00"))
    warmup = warmup_seconds(pod)
    # The operator timed the wake the router held requests through: the next wake's hold.
    wake = wait_until(lambda: timed(woken=True), 30, "the wake's time")
    assert abs(wake - held_ms / 1000) <= 5, (wake, held_ms)
    report(
        f"scale from zero: {len(served)} held requests answered warm, longest hold "
        f"{held_ms / 1000:.1f} s (all answered {woke:.1f} s after the burst); the pod: created "
        f"to Ready (start, load, warmup, gate) {(ready - created).total_seconds():.0f} s, its "
        f"warmup {warmup} s; {len(refused)} refused past "
        f"--max-held-requests; status.scaleToZero.wakeSeconds {first_start} s for the first "
        f"start, {wake} s for the wake"
    )


@contextlib.contextmanager
def model_claim(kube, tmp_path: Path, name: str, folders: dict[str, Path]) -> Iterator[str]:
    """A claim `name` bound to a hostPath volume on the node holding each of `folders` under
    its key (hard-linked, not copied: e5-base's size is 1.1 GiB), readable by the server's
    user; the volume is deleted on the way out (the claim goes with the namespace)."""
    root = tmp_path / f"{name}-volume"
    for key, built in folders.items():
        for item in (built, *built.rglob("*")):
            target = root / key / item.relative_to(built)
            if item.is_dir():
                target.mkdir(parents=True)
                target.chmod(0o755)
            else:
                item.chmod(0o644)  # a link shares the mode
                os.link(item, target)
    root.chmod(0o755)
    volume_name = f"{kube.namespace}-{name}"
    kube.devcluster.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": volume_name},
        "spec": {
            "capacity": {"storage": "2Gi"}, "accessModes": ["ReadWriteOnce"],
            "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
            "hostPath": {"path": str(root), "type": "Directory"},
        },
    }))  # fmt: skip
    kube.apply({
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name},
        "spec": {
            "accessModes": ["ReadWriteOnce"], "storageClassName": "", "volumeName": volume_name,
            "resources": {"requests": {"storage": "2Gi"}},
        },
    })  # fmt: skip
    try:
        yield name
    finally:
        kube.devcluster.kubectl("delete", "pv", volume_name, "--wait=false", check=False)


@pytest.fixture
def e5_base_claim(kube, tmp_path) -> Iterator[str]:
    """A claim holding an XLM-R folder of multilingual-e5-base's size (zoo.shaped: 12 layers
    of 768, 250,002 tokens, random weights; the hub has no real copy here), made once in the
    benchmarks' cache."""
    from warmgate_testkit import zoo

    with model_claim(kube, tmp_path, "e5", {"e5-base": zoo.shaped("e5-base")}) as claim:
        yield claim


def test_a_model_of_e5_base_s_size_at_zero_is_woken_by_a_request_and_answers_it_warm(
    kube, operator, router, report, e5_base_claim
) -> None:
    """Issue 40's wake: an XLM-R of multilingual-e5-base's size at the operator's default plan
    (1, 8, 32 x 32 to 256), scaled to zero, then one request through the router by the OpenAI
    SDK at its defaults: held until a pod is warm and answered warm. How long that took is
    reported beside the pod's start, load and warmup (docs/benchmarks.md has the figures)."""
    import openai

    service = embedding_service(
        "e5", "v1", replicas=1, service={"type": "ClusterIP"},
        model={
            "id": "intfloat/multilingual-e5-base",
            "source": {"volume": {"claimName": e5_base_claim, "path": "e5-base"}},
        },
        resources={"requests": {"cpu": "500m", "memory": "2560Mi"}, "limits": {"memory": "3Gi"}},
        autoscaling={
            "enabled": True, "minReplicas": 0, "maxReplicas": 1,
            "scaleToZero": {"idleSeconds": 10},
        },
    )  # fmt: skip
    del service["spec"]["warmup"], service["spec"]["batching"]  # the operator's defaults
    kube.apply(service)
    wait_ready(kube, "e5", "v1", replicas=1, timeout=420)

    def at_zero() -> bool:
        emb = kube.get("embeddingservice", "e5") or {}
        return emb["spec"].get("replicas") == 0 and not kube.pods("e5")

    wait_until(at_zero, 180, "the operator to scale the e5 service to zero")
    sdk = openai.OpenAI(base_url=router.url + "/v1", api_key="-")
    started = time.monotonic()
    raw = sdk.embeddings.with_raw_response.create(
        model="e5", input=["query: 서울의 날씨는 어떤가요?", "passage: A cold start is paid once."]
    )
    answered = time.monotonic() - started
    vectors = [item.embedding for item in raw.parse().data]
    assert len(vectors) == 2 and len(vectors[0]) == 768
    assert raw.headers.get("X-Warmgate-Cold") == "0", "the woken pod answered cold"
    held = int(raw.headers[HELD_HEADER]) / 1000
    (pod,) = kube.pods("e5")
    created = datetime.fromisoformat(pod["metadata"]["creationTimestamp"].replace("Z", "+00:00"))
    ready = datetime.fromisoformat(
        (condition(pod, "Ready").get("lastTransitionTime") or "").replace("Z", "+00:00")
    )
    report(
        f"e5-base's size woken from zero: answered warm {answered:.1f} s after the request "
        f"(held {held:.1f} s); the pod created to Ready {(ready - created).total_seconds():.0f} s, "
        f"its warmup {warmup_seconds(pod)} s"
    )


def reload_under_pooled_load(
    kube: Any,
    name: str,
    reloaded: dict,
    url: str,
    body: dict,
    headers: dict[str, str],
    parse: Any,
) -> list[tuple[int, str, str, Any]]:
    """Two pooled clients (keep-alive sessions, as clients hold them) post `body` to `url`
    while `name` is reloaded to `reloaded` (its revision v2): every answer's (status, cold
    header, revision header, `parse(answer)` of a 200), from 20 before the reload to answers
    of v2. Asserts that none failed and none was cold."""
    import requests

    answers: list[tuple[int, str, str, Any]] = []
    stop = threading.Event()

    def send() -> None:
        with requests.Session() as session:
            while not stop.is_set():
                try:
                    answer = session.post(url, json=body, headers=headers, timeout=30)
                except requests.RequestException as error:
                    answers.append((0, "", str(error), None))
                    continue
                parsed = parse(answer) if answer.status_code == 200 else None
                answers.append((
                    answer.status_code, answer.headers.get("X-Warmgate-Cold", ""),
                    answer.headers.get("X-Warmgate-Revision", ""), parsed,
                ))  # fmt: skip

    threads = [threading.Thread(target=send) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        wait_until(lambda: len(answers) >= 20, 60, "answers before the reload")
        kube.apply(reloaded)
        wait_ready(kube, name, "v2", replicas=1, timeout=420)
        wait_until(lambda: any(a[2] == "v2" for a in answers[-5:]), 120, "answers of v2")
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    failed = [a for a in answers if a[0] != 200]
    cold = [a for a in answers if a[1] != "0"]
    assert not failed, failed[:3]
    assert not cold, cold[:3]
    return answers


def test_a_re_ranker_through_the_router_and_its_reload_under_pooled_load(
    kube, operator, router, report, tmp_path
) -> None:
    """Issue 43 on the real node: an EmbeddingService whose folder is a CrossEncoder (a zoo
    BERT with its WordPiece tokenizer) is found to be a re-ranker, verified by the warm gate
    on /rerank, and served through the router by name at /v1/rerank (the body Cohere's, Jina's
    and Infinity's clients send) to a pooled client; its reload to other weights under that
    load: 0 failed, 0 cold, and every answer's scores those of the weights of the revision
    its pod serves (CrossEncoder.predict, computed here)."""
    from sentence_transformers import CrossEncoder

    from warmgate_testkit import zoo

    made = {
        "v1": zoo.cross_encoder("bert-mean", tmp_path / "zoo", 1, "sigmoid", seed=0),
        "v2": zoo.cross_encoder("bert-mean", tmp_path / "zoo", 1, "sigmoid", seed=5),
    }
    query = "서울의 날씨는 어떤가요?"
    documents = ["오늘 서울은 맑습니다.", "A man is eating food.", "readiness gates"]
    expected = {
        revision: [float(x) for x in CrossEncoder(str(folder), device="cpu").predict(
            [(query, doc) for doc in documents]
        )]
        for revision, folder in made.items()
    }  # fmt: skip
    assert expected["v1"] != expected["v2"]

    def service(revision: str) -> dict:
        return embedding_service(
            "ranker", revision, replicas=1, service={"type": "ClusterIP"}, resources=SMALL,
            # Up to the CrossEncoder's own 64 tokens, so a pair is cut where predict() cuts it.
            warmup={"sequenceBuckets": [32, 64]},
            # The gate also times a request on the pod: a re-ranker's is /rerank.
            rollout={"verifyLatency": True},
            model={
                "id": "cross-encoder/ms-marco-MiniLM-L6-v2",
                "source": {"volume": {"claimName": "rankers", "path": revision}},
            },
        )  # fmt: skip

    with model_claim(kube, tmp_path, "rankers", made):
        kube.apply(service("v1"))
        ready = wait_ready(kube, "ranker", "v1", replicas=1, timeout=420)
        assert ready["status"]["model"]["task"] == "rerank", ready["status"]  # its TASK column
        (pod,) = kube.pods("ranker")
        assert "verification" in (condition(pod, "warmgate.dev/warmed").get("message") or "")
        body = {"model": "ranker", "query": query, "documents": documents}

        def scores(answer: Any) -> list[float]:
            ranked = sorted(answer.json()["results"], key=lambda r: r["index"])
            return [r["relevance_score"] for r in ranked]

        answers = reload_under_pooled_load(
            kube, "ranker", service("v2"), router.url + "/v1/rerank", body, {}, scores
        )
        for _status, _cold, revision, scores in answers:
            assert scores == pytest.approx(expected[revision], abs=1e-5), revision
        report(
            f"re-ranker through the router: {len(answers)} pooled /v1/rerank requests across "
            f"its reload, 0 failed, 0 cold, each scored by its revision's weights; "
            f"status.model {ready['status'].get('model')}"
        )


def test_bge_m3_s_sparse_weights_through_the_router_and_its_reload_under_pooled_load(
    kube, operator, router, report, tmp_path
) -> None:
    """Issue 43 on the real node: an EmbeddingService whose folder has bge-m3's sparse and
    ColBERT heads (a zoo XLM-R with FlagEmbedding's sparse_linear.pt and colbert_linear.pt) is
    shown as `embed+sparse+colbert` by `kubectl get emb`, serves /embed_sparse and /embed_multi
    through the router by name to a pooled client, and reloads to other weights under that
    load: 0 failed, 0 cold, each answer the lexical weights of its revision's weights
    (FlagEmbedding's BGEM3FlagModel, computed here)."""
    import requests

    from warmgate_testkit import zoo

    made = {"v1": zoo.m3(tmp_path / "zoo", seed=0), "v2": zoo.m3(tmp_path / "zoo", seed=3)}
    texts = ["서울의 날씨는 어떤가요?", "A man is eating a piece of bread."]
    expected = {}
    for revision, folder in made.items():
        found = flag_embedding_m3()(str(folder), use_fp16=False, devices="cpu").encode(
            texts, max_length=64, return_dense=False, return_sparse=True
        )
        expected[revision] = [
            {int(k): float(v) for k, v in weights.items()} for weights in found["lexical_weights"]
        ]
    assert expected["v1"] != expected["v2"]

    def service(revision: str) -> dict:
        return embedding_service(
            "m3", revision, replicas=1, service={"type": "ClusterIP"}, resources=SMALL,
            warmup={"sequenceBuckets": [32, 64]},
            model={
                "id": "BAAI/bge-m3",
                "source": {"volume": {"claimName": "m3-models", "path": revision}},
            },
        )  # fmt: skip

    with model_claim(kube, tmp_path, "m3-models", made):
        kube.apply(service("v1"))
        ready = wait_ready(kube, "m3", "v1", replicas=1, timeout=420)
        assert ready["status"]["model"]["task"] == "embed+sparse+colbert", ready["status"]
        table = kube.run("get", "emb", "m3").stdout.splitlines()
        assert table[0].split()[:3] == ["NAME", "MODEL", "TASK"]
        assert table[1].split()[:3] == ["m3", "BAAI/bge-m3", "embed+sparse+colbert"]
        headers = {"X-Warmgate-Model": "m3"}
        multi = requests.post(
            router.url + "/embed_multi",
            json={"inputs": texts, "return_sparse": True, "return_colbert_vecs": True},
            headers=headers,
            timeout=30,
        )
        assert multi.status_code == 200, multi.text
        assert set(multi.json()) == {"dense_vecs", "lexical_weights", "colbert_vecs"}

        def lexical(answer: Any) -> list[dict[int, float]]:
            return [{item["index"]: item["value"] for item in found} for found in answer.json()]

        answers = reload_under_pooled_load(
            kube, "m3", service("v2"), router.url + "/embed_sparse", {"inputs": texts}, headers,
            lexical,
        )  # fmt: skip
        for _status, _cold, revision, weights in answers:
            assert weights is not None
            for got, want in zip(weights, expected[revision], strict=True):
                assert sorted(got) == sorted(want), revision
                assert [got[k] for k in sorted(want)] == pytest.approx(
                    [want[k] for k in sorted(want)], rel=1e-4, abs=1e-4
                ), revision
        report(
            f"bge-m3's heads through the router: {len(answers)} pooled /embed_sparse requests "
            f"across its reload, 0 failed, 0 cold, each weighed by its revision's heads; "
            f"status.model {ready['status'].get('model')}"
        )
