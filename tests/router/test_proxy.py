"""The router's HTTP side against real warmgate servers (the real all-MiniLM-L6-v2, warmed) on
this machine's loopback, through real clients (the OpenAI SDK pooled with retries off, aiohttp).

What the router knows of the cluster (EmbeddingServices, aliases, EndpointSlices) is given to
its View here as the apiserver would list it, with endpoints on 127.0.0.1: the EndpointSlice
API refuses loopback addresses, so these tests cannot put real pods' slices behind it. The
watches, the scale from zero and the router in its image on the real node are
tests/e2e/test_router.py."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import aiohttp
import openai
import pytest
from support.server import serving

from warmgate_contract.names import API_VERSION, MODEL_HEADER, SERVICE_HEADER
from warmgate_operator.idle import parse_stamp, zero_status
from warmgate_router.config import RouterConfig
from warmgate_router.httpd import Server
from warmgate_router.metrics import Metrics
from warmgate_router.proxy import Router, build_server
from warmgate_router.view import ALIASES, SERVICES, SLICES, View
from warmgate_server.config import parse_config
from warmgate_server.loading import LoadedModel, load_model
from warmgate_testkit.process import minilm_path

NS = "team"
MINILM = "sentence-transformers/all-MiniLM-L6-v2"
T0 = parse_stamp("2026-03-01T12:00:00Z") or 0.0


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(parse_config(["--model", str(minilm_path()), "--device", "cpu"], environ={}))


def es(name: str, replicas: int = 1, created: str = "2026-01-01T00:00:00Z", **spec: Any) -> dict:
    return {
        "apiVersion": API_VERSION,
        "kind": "EmbeddingService",
        "metadata": {"namespace": NS, "name": name, "creationTimestamp": created},
        "spec": {"model": {"id": MINILM}, "replicas": replicas, **spec},
    }


def alias(name: str, service: str, created: str = "2026-01-02T00:00:00Z") -> dict:
    return {
        "apiVersion": API_VERSION,
        "kind": "EmbeddingAlias",
        "metadata": {"namespace": NS, "name": name, "creationTimestamp": created},
        "spec": {"service": service},
    }


def endpoint_slice(service: str, ports: list[int], ready: bool = True, tag: str = "a") -> dict:
    return {
        "metadata": {
            "namespace": NS,
            "name": f"{service}-{tag}",
            "labels": {"kubernetes.io/service-name": service},
        },
        "ports": [{"name": "http", "port": port} for port in ports[:1]],
        "endpoints": [
            {
                "addresses": ["127.0.0.1"],
                "conditions": {"ready": ready, "serving": ready, "terminating": False},
                "targetRef": {"kind": "Pod", "name": f"{service}-pod-{port}"},
            }
            for port in ports[:1]
        ],
    }


def per_port(service: str, ports: list[int]) -> list[dict]:
    """One slice per pod, since slice ports are per slice."""
    return [endpoint_slice(service, [port], tag=str(port)) for port in ports]


def free_port() -> int:
    """A port nothing listens on (bound, then released): connecting to it is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Rig:
    def __init__(self, view: View, router: Router, server: Server, port: int) -> None:
        self.view = view
        self.router = router
        self.server = server
        self.url = f"http://127.0.0.1:{port}"

    def counter(self, name: str, **labels: str) -> float:
        value = self.router.metrics.registry.get_sample_value(name, labels)
        return value or 0.0


@pytest.fixture
async def pods(loaded):
    """Two real warm servers on loopback (the pods of two services)."""
    from support.server import make_config

    async with (
        serving(make_config(minilm_path()), loaded) as one,
        serving(make_config(minilm_path()), loaded) as two,
    ):
        yield one.server.port, two.server.port


def record_picks(router: Router) -> list[int]:
    """The port of every pod the balancer picks from now on, in order (0: none left)."""
    picked: list[int] = []
    pick = router.balancer.pick

    def recording(endpoints, tried=()):
        chosen = pick(endpoints, tried)
        picked.append(chosen.port if chosen else 0)
        return chosen

    router.balancer.pick = recording
    return picked


async def make_rig(**config: Any) -> Rig:
    view = View()
    router = Router(RouterConfig(**config), view, None, Metrics())
    router.synced.set()
    server = build_server(router)
    port = await server.start("127.0.0.1", 0)
    return Rig(view, router, server, port)


@pytest.fixture
async def rig():
    made: list[Rig] = []

    async def build(**config: Any) -> Rig:
        made.append(await make_rig(**config))
        return made[-1]

    yield build
    for one in made:
        await one.server.shutdown(seconds=5)
        await one.router.close()


def names(view: View, services: list[dict], aliases: list[dict]) -> None:
    view.on_listing(SERVICES, NS, services)
    view.on_listing(ALIASES, NS, aliases)


async def test_every_name_reaches_its_service_through_the_openai_sdk(rig, pods):
    r = await rig()
    names(r.view, [es("query"), es("docs")], [alias("search", "docs")])
    r.view.on_listing(
        SLICES, NS, [endpoint_slice("query", [pods[0]]), endpoint_slice("docs", [pods[1]])]
    )

    def call(model: str) -> tuple[str, str, int]:
        client = openai.OpenAI(base_url=r.url + "/v1", api_key="-", max_retries=0)
        raw = client.embeddings.with_raw_response.create(
            model=model, input=["샘플 문장입니다", "hi"]
        )
        body = raw.parse()
        return raw.headers[SERVICE_HEADER], raw.headers["X-Warmgate-Revision"], len(body.data)

    answers = {
        m: await asyncio.to_thread(call, m) for m in ("query", "docs", "search", f"{NS}/docs")
    }
    assert answers["query"][0] == f"{NS}/query"
    assert answers["docs"][0] == f"{NS}/docs"
    assert answers["search"][0] == f"{NS}/docs"
    assert answers[f"{NS}/docs"][0] == f"{NS}/docs"
    assert all(n == 2 for _, _, n in answers.values())

    async with aiohttp.ClientSession() as session, session.get(r.url + "/v1/models") as response:
        listed = {m["id"]: m for m in (await response.json())["data"]}
    assert set(listed) == {"query", "docs", "search"}
    assert listed["search"]["alias_of"] == f"{NS}/docs"
    assert listed["search"]["kind"] == "EmbeddingAlias"
    assert listed["docs"]["state"] == "ready" and listed["docs"]["root"] == MINILM


async def test_tei_routes_take_the_model_from_a_header_or_the_path(rig, pods):
    r = await rig()
    names(r.view, [es("query"), es("docs")], [])
    r.view.on_listing(
        SLICES, NS, [endpoint_slice("query", [pods[0]]), endpoint_slice("docs", [pods[1]])]
    )
    async with aiohttp.ClientSession() as session:
        async with session.post(
            r.url + "/embed", json={"inputs": ["a", "b"]}, headers={MODEL_HEADER: "docs"}
        ) as response:
            assert response.status == 200, await response.text()
            assert response.headers[SERVICE_HEADER] == f"{NS}/docs"
            assert len(await response.json()) == 2
        async with session.post(
            r.url + f"/models/{NS}/query/embed", json={"inputs": "a"}
        ) as response:
            assert response.status == 200, await response.text()
            assert response.headers[SERVICE_HEADER] == f"{NS}/query"
        async with session.post(r.url + "/embed", json={"inputs": "a"}) as response:
            body = await response.json()
            assert response.status == 400
            assert "docs" in body["error"] and "query" in body["error"]
        # TEI's OpenAI route: the path's or the header's model, which the body may repeat.
        for url, headers, body in (
            (f"/models/{NS}/query/embeddings", {}, {"input": "a"}),
            (f"/models/{NS}/query/embeddings", {}, {"input": "a", "model": f"{NS}/query"}),
            ("/embeddings", {MODEL_HEADER: "query"}, {"input": "a"}),
        ):
            async with session.post(r.url + url, json=body, headers=headers) as response:
                assert response.status == 200, await response.text()
                assert response.headers[SERVICE_HEADER] == f"{NS}/query", url
        async with session.post(
            r.url + f"/models/{NS}/query/embeddings", json={"input": "a", "model": "docs"}
        ) as response:
            error = (await response.json())["error"]
            assert response.status == 400 and error["code"] == "model_mismatch", error
            assert "'docs'" in error["message"] and f"'{NS}/query'" in error["message"]


async def test_unknown_names_conflicts_and_bad_bodies_get_a_clear_error(rig, pods):
    r = await rig()
    # An alias named like an older EmbeddingService is refused; the service keeps its name.
    names(
        r.view,
        [es("docs")],
        [alias("docs", "other"), alias("orphan", "gone"), alias("chain", "orphan")],
    )
    r.view.on_listing(SLICES, NS, [endpoint_slice("docs", [pods[1]])])
    async with aiohttp.ClientSession() as session:

        async def post(body: Any) -> tuple[int, dict]:
            async with session.post(r.url + "/v1/embeddings", data=body) as response:
                return response.status, await response.json()

        status, body = await post(b'{"model": "nope", "input": "x"}')
        assert status == 404 and body["error"]["code"] == "model_not_found"
        assert "docs" in body["error"]["message"]
        status, body = await post(b'{"model": "orphan", "input": "x"}')
        assert status == 404 and "gone, which does not exist" in body["error"]["message"]
        status, body = await post(b'{"model": "chain", "input": "x"}')
        assert (
            status == 404 and "an alias points at an EmbeddingService" in body["error"]["message"]
        )
        status, body = await post(b"{not json")
        assert status == 400 and body["error"]["code"] == "invalid_json"
        status, body = await post(b'{"model": "docs", "input": "x"}')
        assert status == 200, body
        # The pod's own validation still answers, through the router.
        status, body = await post(b'{"model": "docs", "input": 7}')
        assert status == 400 and body["error"]["param"] == "input"


async def test_a_refused_connection_goes_to_another_pod_and_load_goes_to_the_least_busy(rig, pods):
    r = await rig()
    names(r.view, [es("docs", replicas=3)], [])
    dead = free_port()
    r.view.on_listing(SLICES, NS, per_port("docs", [dead, pods[0], pods[1]]))
    picked = record_picks(r.router)
    async with aiohttp.ClientSession() as session:

        async def one(i: int) -> None:
            body = {"model": "docs", "input": [f"text {i}"] * 4}
            async with session.post(r.url + "/v1/embeddings", json=body) as response:
                assert response.status == 200, await response.text()

        await asyncio.gather(*(one(i) for i in range(24)))
    assert r.counter("warmgate_router_connect_retries_total", service=f"{NS}/docs") >= 1
    assert (
        r.counter("warmgate_router_requests_total", model="docs", service=f"{NS}/docs", code="200")
        == 24
    )
    # The refused pod was tried, then skipped; both live pods took a fair share of the 24.
    assert dead in picked
    assert min(picked.count(pods[0]), picked.count(pods[1])) >= 8, picked
    assert r.router.balancer.in_flight == {}


async def test_a_connection_that_never_opens_goes_to_another_pod(rig, pods):
    """A pod that takes no connection within --connect-timeout never saw the request (a
    NetworkPolicy that drops packets, a node gone): the request goes to another pod. Made for
    real on loopback: a listening socket that never accepts, its one-place accept queue full,
    so the kernel drops further SYNs and connecting times out."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(0)
    filler = socket.create_connection(silent.getsockname())  # fills the accept queue
    try:
        r = await rig(connect_timeout=0.5)
        names(r.view, [es("docs", replicas=2)], [])
        r.view.on_listing(SLICES, NS, per_port("docs", [silent.getsockname()[1], pods[0]]))
        async with aiohttp.ClientSession() as session:
            for i in range(4):
                started = time.monotonic()
                body = {"model": "docs", "input": f"text {i}"}
                async with session.post(r.url + "/v1/embeddings", json=body) as response:
                    assert response.status == 200, await response.text()
                assert time.monotonic() - started < 5
        retries = r.counter("warmgate_router_connect_retries_total", service=f"{NS}/docs")
        assert retries >= 1
    finally:
        filler.close()
        silent.close()


async def test_a_request_a_pod_may_have_run_is_never_sent_to_another(rig, pods):
    """A pod that takes the whole request and then drops the connection without an answer
    may have run it (embedding is idempotent, but its cost and its metrics are not, and the
    router cannot know): a 502 saying so, and the request goes to no other pod. A pod that
    dies mid-request is made for real on loopback: a listener that reads the request, then
    closes its socket."""
    taken: list[bytes] = []

    async def dying(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))  # fmt: skip
        taken.append(head + await reader.readexactly(length))
        writer.close()

    server = await asyncio.start_server(dying, "127.0.0.1", 0)
    dying_port = server.sockets[0].getsockname()[1]
    try:
        r = await rig()
        names(r.view, [es("docs", replicas=2)], [])
        r.view.on_listing(SLICES, NS, per_port("docs", [dying_port, pods[0]]))
        picked = record_picks(r.router)
        statuses = []
        async with aiohttp.ClientSession() as session:
            for i in range(8):
                body = {"model": "docs", "input": f"text {i}"}
                async with session.post(r.url + "/v1/embeddings", json=body) as response:
                    answer = await response.json()
                    statuses.append(response.status)
                    if response.status == 502:
                        assert "may have" in answer["error"]["message"], answer
        assert picked.count(dying_port) == len(taken) >= 1, picked
        assert statuses.count(502) == len(taken)  # each one the dying pod took failed, once
        assert statuses.count(200) == picked.count(pods[0]) == 8 - len(taken)
        assert len(picked) == 8  # one pick per request: nothing was sent twice
    finally:
        server.close()
        await server.wait_closed()


async def test_a_request_for_a_service_without_a_warm_pod_is_held_until_one_is_ready(rig, pods):
    r = await rig(hold_seconds=30)
    names(r.view, [es("docs")], [])
    r.view.on_listing(SLICES, NS, [endpoint_slice("docs", [pods[0]], ready=False)])
    async with aiohttp.ClientSession() as session:
        started = time.monotonic()
        request = asyncio.create_task(
            session.post(r.url + "/v1/embeddings", json={"model": "docs", "input": "held"})
        )
        await asyncio.sleep(1.0)
        assert not request.done()
        assert r.router.held == 1
        assert r.counter("warmgate_router_held_requests", service=f"{NS}/docs") == 1
        # The warm gate passes: the slice turns Ready.
        r.view.on_change(SLICES, "MODIFIED", endpoint_slice("docs", [pods[0]], ready=True))
        response = await request
        waited = time.monotonic() - started
        assert response.status == 200, await response.text()
        held_ms = int(response.headers["X-Warmgate-Held-Ms"])
        assert 900 <= held_ms <= waited * 1000 + 50
        assert response.headers["X-Warmgate-Cold"] == "0"
        response.release()
    assert r.router.held == 0
    assert r.counter("warmgate_router_held_requests", service=f"{NS}/docs") == 0
    served = {"service": f"{NS}/docs", "outcome": "served"}
    assert r.counter("warmgate_router_hold_seconds_count", **served) == 1
    assert r.counter("warmgate_router_hold_seconds_sum", **served) >= 0.9


async def test_holding_is_bounded_in_time_and_count_and_ends_when_the_client_leaves(rig, pods):
    r = await rig(hold_seconds=1.0, max_held_requests=1)
    names(r.view, [es("docs"), es("off", replicas=0)], [])
    async with aiohttp.ClientSession() as session:
        started = time.monotonic()
        async with session.post(
            r.url + "/v1/embeddings", json={"model": "docs", "input": "x"}
        ) as resp:
            body = await resp.json()
            assert resp.status == 503 and resp.headers["Retry-After"] == "5"
            assert "no warm pod for 1 s" in body["error"]["message"]
        assert 0.9 <= time.monotonic() - started < 5
        # 0 replicas without scale to zero: refused at once, it would never get a pod.
        async with session.post(
            r.url + "/v1/embeddings", json={"model": "off", "input": "x"}
        ) as resp:
            body = await resp.json()
            assert resp.status == 503 and "does not scale from zero" in body["error"]["message"]

    r = await rig(hold_seconds=0)  # a router that holds nothing says so
    names(r.view, [es("docs")], [])
    async with aiohttp.ClientSession() as session:
        started = time.monotonic()
        body = {"model": "docs", "input": "x"}
        async with session.post(r.url + "/v1/embeddings", json=body) as resp:
            error = (await resp.json())["error"]
            assert resp.status == 503 and resp.headers["Retry-After"] == "5"
            assert "holds no request (--hold-seconds 0)" in error["message"], error
        assert time.monotonic() - started < 1

    r = await rig(hold_seconds=30, max_held_requests=1)
    names(r.view, [es("docs")], [])
    async with aiohttp.ClientSession() as first, aiohttp.ClientSession() as second:
        held = asyncio.create_task(
            first.post(r.url + "/v1/embeddings", json={"model": "docs", "input": "x"})
        )
        await asyncio.sleep(0.5)
        async with second.post(
            r.url + "/v1/embeddings", json={"model": "docs", "input": "y"}
        ) as resp:
            assert (
                resp.status == 503
                and "--max-held-requests 1" in (await resp.json())["error"]["message"]
            )
        held.cancel()  # the client hangs up
        await first.close()
    for _ in range(50):  # the router notices within its 0.25 s polling of the connection
        if not r.router.held:
            break
        await asyncio.sleep(0.1)
    assert r.router.held == 0
    assert (
        r.counter("warmgate_router_hold_seconds_count", service=f"{NS}/docs", outcome="client_gone")
        == 1
    )


def waking_service(name: str, wake_seconds: int) -> dict:
    """An EmbeddingService at zero (autoscaling.scaleToZero) whose last wake took
    `wake_seconds`, with the status the operator's own idle.zero_status records for it."""
    autoscaling = {"enabled": True, "minReplicas": 0, "maxReplicas": 2,
                   "scaleToZero": {"idleSeconds": 300}}  # fmt: skip
    body = es(name, replicas=0, autoscaling=autoscaling)
    asleep = zero_status({}, True, True, 0, T0)
    woken = zero_status(asleep, True, False, 0, T0 + 10)
    awake = zero_status(woken, True, False, 1, T0 + 10 + wake_seconds)
    body["status"] = {"servingReplicas": 0, **zero_status(awake, True, True, 0, T0 + 900)}
    return body


class ScaleRecorder:
    """The apiserver's side of the router's wake, in memory: a Scale at 0 replicas to read,
    and every write the router makes."""

    def __init__(self) -> None:
        self.writes: list[tuple[str, str, Any]] = []

    async def request(self, method: str, path: str, body: Any = None, **_: Any) -> Any:
        if method == "GET":
            return {"metadata": {"resourceVersion": "7"}, "spec": {}}
        self.writes.append((method, path, body))
        return {}

    def scaled_to(self) -> list[Any]:
        return [b["spec"]["replicas"] for m, p, b in self.writes if p.endswith("/scale")]


async def test_a_service_slower_to_warm_than_the_hold_is_held_as_long_as_its_last_wake(rig, pods):
    """--hold-seconds 1, but the service's last wake took 3 s: its request is held 1.5 x 3 +
    30 s, and answered when its pod turns warm 2.5 s later. A service not measured yet still
    gets --hold-seconds."""
    r = await rig(hold_seconds=1)
    names(r.view, [waking_service("big", wake_seconds=3), es("new")], [])
    r.view.on_listing(SLICES, NS, [endpoint_slice("big", [pods[0]], ready=False)])

    def call(model: str) -> Any:
        client = openai.OpenAI(base_url=r.url + "/v1", api_key="-", max_retries=0)
        return client.embeddings.with_raw_response.create(model=model, input="held")

    started = time.monotonic()
    request = asyncio.create_task(asyncio.to_thread(call, "big"))
    await asyncio.sleep(2.5)
    assert not request.done() and r.router.held == 1
    r.view.on_change(SLICES, "MODIFIED", endpoint_slice("big", [pods[0]], ready=True))
    raw = await request
    assert raw.http_response.status_code == 200
    assert int(raw.headers["X-Warmgate-Held-Ms"]) >= 2000  # twice --hold-seconds
    assert len(raw.parse().data) == 1
    assert time.monotonic() - started < 10

    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as refused:
        await asyncio.to_thread(call, "new")
    assert refused.value.status_code == 503
    assert refused.value.response.headers["Retry-After"] == "5"
    assert "--hold-seconds 1" in refused.value.message
    assert 0.9 <= time.monotonic() - started < 5


async def test_a_wake_longer_than_the_router_holds_is_answered_at_once_with_retry_after(rig, pods):
    """A 40 s wake and --max-hold-seconds 5: no blind hold and timeout, but a 503 at once that
    says the model is waking, how long it takes, and when to retry (Retry-After 40), in the
    route's own error format. The service is still woken, so the retry finds it warm."""
    r = await rig(hold_seconds=1, max_hold_seconds=5)
    apiserver = ScaleRecorder()
    r.router.waker.kube = apiserver  # type: ignore[assignment]
    names(r.view, [waking_service("big", wake_seconds=40)], [])

    def call() -> None:
        client = openai.OpenAI(base_url=r.url + "/v1", api_key="-", max_retries=0)
        client.embeddings.create(model="big", input="x")

    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as refused:
        await asyncio.to_thread(call)
    assert time.monotonic() - started < 1
    assert refused.value.status_code == 503
    assert refused.value.response.headers["Retry-After"] == "40"
    error = refused.value.body
    assert error["code"] == "model_waking" and error["type"] == "service_unavailable"
    assert error["message"] == (
        f"EmbeddingService {NS}/big is waking from zero: it took 40 s to warm "
        "(status.scaleToZero.wakeSeconds) and about 40 s remain, longer than this request "
        "can be held (--max-hold-seconds 5): retry in 40 s"
    )
    assert apiserver.scaled_to() == [1]

    async with aiohttp.ClientSession() as session:
        started = time.monotonic()
        async with session.post(
            r.url + "/embed", json={"inputs": "x"}, headers={MODEL_HEADER: "big"}
        ) as response:
            body = await response.json()
        assert time.monotonic() - started < 1
    assert response.status == 503 and response.headers["Retry-After"] == "40"
    assert body["error_type"] == "Overloaded" and "waking from zero" in body["error"]
    assert r.router.held == 0


async def test_a_client_with_a_short_timeout_is_told_when_to_retry_and_then_served(rig, pods):
    """The OpenAI SDK (its default retries) with a 2 s timeout, which it sends the router
    (X-Stainless-Read-Timeout), and a model whose last wake took 3 s: held, the client would
    time out; told at once to retry in 3 s, it sleeps that long and its retry is served."""
    r = await rig()
    names(r.view, [waking_service("big", wake_seconds=3)], [])
    r.view.on_listing(SLICES, NS, [endpoint_slice("big", [pods[0]], ready=False)])

    def call() -> int:
        client = openai.OpenAI(base_url=r.url + "/v1", api_key="-", timeout=2.0)
        return len(client.embeddings.create(model="big", input="x").data)

    started = time.monotonic()
    request = asyncio.create_task(asyncio.to_thread(call))
    await asyncio.sleep(1.5)  # the pod turns warm while the client waits to retry
    r.view.on_change(SLICES, "MODIFIED", endpoint_slice("big", [pods[0]], ready=True))
    assert await request == 1
    assert 2.9 <= time.monotonic() - started < 8
    big = {"model": "big", "service": f"{NS}/big"}
    assert r.counter("warmgate_router_requests_total", code="503", **big) == 1
    assert r.counter("warmgate_router_requests_total", code="200", **big) == 1


async def test_a_replica_that_stops_answers_its_held_requests_at_once_with_retry_after(rig, pods):
    """After the drain, a stopping replica does not keep held requests to its end: each gets a
    503 with Retry-After and a connection closed, so the client's retry goes to another
    replica through the Service."""
    r = await rig(hold_seconds=60)
    names(r.view, [es("docs")], [])
    async with aiohttp.ClientSession() as session:
        held = asyncio.create_task(
            session.post(r.url + "/v1/embeddings", json={"model": "docs", "input": "x"})
        )
        await asyncio.sleep(0.5)
        assert not held.done() and r.router.held == 1
        r.router.draining = True
        r.router.stopping = True
        stopped = time.monotonic()
        response = await held
        assert time.monotonic() - stopped < 2
        body = await response.json()
        assert response.status == 503 and response.headers["Retry-After"] == "5"
        assert "shutting down" in body["error"]["message"]
        assert response.headers.get("Connection", "").lower() == "close", dict(response.headers)
        assert body["error"]["code"] == "router_stopping"
        response.release()
    assert r.router.held == 0
    outcome = {"service": f"{NS}/docs", "outcome": "router_stopping"}
    assert r.counter("warmgate_router_hold_seconds_count", **outcome) == 1


async def test_a_pod_that_closes_its_connections_loses_no_request(rig, pods, loaded):
    """A standby or draining server answers `Connection: close` and closes idle connections:
    the router's pool reconnects, no request fails."""
    r = await rig()
    names(r.view, [es("docs")], [])
    r.view.on_listing(SLICES, NS, [endpoint_slice("docs", [pods[0]])])
    async with aiohttp.ClientSession() as session:
        async with session.post(
            f"http://127.0.0.1:{pods[0]}/role", json={"role": "standby"}
        ) as resp:
            assert resp.status == 200, await resp.text()
        statuses = []
        for i in range(20):
            async with session.post(
                r.url + "/v1/embeddings", json={"model": "docs", "input": f"t{i}"}
            ) as resp:
                statuses.append(resp.status)
                assert (
                    resp.headers.get("Connection", "").lower() != "close"
                )  # the client's own stays
    assert statuses == [200] * 20


@pytest.fixture(scope="module")
def ranker(tmp_path_factory):
    """A real warm re-ranker server (a zoo CrossEncoder) on loopback: a re-ranker's pod."""
    from warmgate_testkit import zoo
    from warmgate_testkit.process import ServerProcess

    folder = zoo.cross_encoder("bert-mean", tmp_path_factory.mktemp("ranker"), 1, "sigmoid")
    args = ["--model", str(folder), "--sequence-buckets", "32,64", "--warmup-batch-sizes", "1,4"]
    with ServerProcess(args) as server:
        assert server.wait_ready(300)["phase"] == "ready"
        yield server.port


async def test_rerank_and_predict_routes_reach_the_re_ranker_they_name(rig, pods, ranker):
    """/v1/rerank and /v2/rerank by the body's model (as Cohere's, Jina's and Infinity's
    clients send it),
    TEI's /rerank by header or path; a re-ranking route sent to an embedder gets the pod's
    424, which says what the model is."""
    r = await rig()
    names(r.view, [es("ranker"), es("docs")], [])
    r.view.on_listing(
        SLICES, NS, [endpoint_slice("ranker", [ranker]), endpoint_slice("docs", [pods[1]])]
    )
    documents = ["a man eats bread", "the weather in Seoul", "readiness gates"]
    async with aiohttp.ClientSession() as session:
        body = {"model": "ranker", "query": "Seoul weather", "documents": documents, "top_n": 2}
        async with session.post(r.url + "/v1/rerank", json=body) as response:
            assert response.status == 200, await response.text()
            assert response.headers[SERVICE_HEADER] == f"{NS}/ranker"
            cohere = await response.json()
        assert len(cohere["results"]) == 2
        # Cohere's ClientV2 (LangChain's and LlamaIndex's CohereRerank): the same body.
        async with session.post(r.url + "/v2/rerank", json=body) as response:
            assert response.status == 200, await response.text()
            assert response.headers[SERVICE_HEADER] == f"{NS}/ranker"
            assert (await response.json())["results"] == cohere["results"]
        tei = {"query": "Seoul weather", "texts": documents}
        for url, headers in (
            ("/rerank", {MODEL_HEADER: "ranker"}),
            (f"/models/{NS}/ranker/rerank", {}),
        ):
            async with session.post(r.url + url, json=tei, headers=headers) as response:
                assert response.status == 200, await response.text()
                ranked = await response.json()
            # The same pod, the same scores, in either API's shape.
            top = {item["index"]: item["score"] for item in ranked}
            for item in cohere["results"]:
                assert top[item["index"]] == pytest.approx(item["relevance_score"])
        async with session.post(r.url + "/v1/rerank", json={**body, "model": "docs"}) as response:
            assert response.status == 424, await response.text()
            assert "embedding model" in (await response.json())["error"]["message"]
