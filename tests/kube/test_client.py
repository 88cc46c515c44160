"""warmgate's one Kubernetes client: request accounting keys, error messages, the leader's
fence, and on real HTTP (an aiohttp server on loopback standing in for the apiserver, which
answers whatever is asked here) what every request carries and what an unanswered one raises."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from kubernetes import client as k8s_client

from warmgate_kube.client import UNANSWERED, ApiError, KubeClient, _request_key, api_error
from warmgate_kube.kinds import CONFIGMAP, DEPLOYMENT, EMBEDDING_SERVICE, HPA, POD


def test_requests_are_counted_by_verb_and_resource() -> None:
    assert _request_key("GET", DEPLOYMENT.path("ns", "x")) == "GET deployments"
    assert _request_key("PATCH", EMBEDDING_SERVICE.path("ns", "x", "status")) == (
        "PATCH embeddingservices/status"
    )
    # A GET of a collection is a LIST, in one namespace or in all.
    assert _request_key("GET", CONFIGMAP.path("ns")) == "LIST configmaps"
    assert _request_key("GET", POD.path(None)) == "LIST pods"
    assert _request_key("GET", HPA.path(None)) == "LIST horizontalpodautoscalers"
    assert POD.path(None) == "/api/v1/pods"


def test_api_errors_carry_the_apiserver_message() -> None:
    body = json.dumps({"reason": "Invalid", "message": "spec.replicas: Invalid value"}).encode()
    error = api_error(422, body)
    assert (error.status, error.reason) == (422, "Invalid")
    assert "spec.replicas" in str(error)
    assert api_error(502, b"<html>bad gateway</html>").message == "<html>bad gateway</html>"


async def test_a_fenced_client_refuses_writes_and_says_so_but_still_reads() -> None:
    """The leader's fence: once it may no longer hold the Lease, no write leaves the process
    (the call never reaches the API) and `on_fence` is told; reads still go."""
    from warmgate_kube.client import NotLeader

    kube = KubeClient(k8s_client.ApiClient(k8s_client.Configuration()), "warmgate-test")
    sent: list[str] = []
    kube._call = lambda method, path, body, query, content_type: sent.append(method) or {}
    fenced: list[bool] = []
    leading = [True]
    kube.write_fence = lambda: leading[0]
    kube.on_fence = lambda: fenced.append(True)
    try:
        await kube.request("PATCH", DEPLOYMENT.path("ns", "x"), body={})
        leading[0] = False
        with pytest.raises(NotLeader):
            await kube.request("PATCH", DEPLOYMENT.path("ns", "x"), body={})
        await kube.request("GET", DEPLOYMENT.path("ns", "x"))
    finally:
        kube.close()
    assert sent == ["PATCH", "GET"] and fenced == [True]


@contextlib.asynccontextmanager
async def apiserver(seen: list[web.Request]) -> AsyncIterator[str]:
    """An HTTP server on loopback answering as the apiserver does the three requests below:
    a pod, a 404 Status, and a watch stream sent in chunks that split its lines."""

    async def pod(request: web.Request) -> web.StreamResponse:
        seen.append(request)
        name = request.match_info["name"]
        if name == "missing":
            status = {"kind": "Status", "reason": "NotFound", "message": 'pods "missing" not found'}
            return web.json_response(status, status=404)
        return web.json_response({"kind": "Pod", "metadata": {"name": name}})

    async def pods(request: web.Request) -> web.StreamResponse:
        seen.append(request)
        assert request.query["watch"] == "true"
        response = web.StreamResponse()
        await response.prepare(request)
        events = b"".join(
            json.dumps({"type": t, "object": {"metadata": {"name": n}}}).encode() + b"\n"
            for t, n in (("ADDED", "a"), ("MODIFIED", "a"), ("DELETED", "b"))
        )
        for start in range(0, len(events), 7):  # lines cut anywhere
            await response.write(events[start : start + 7])
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/api/v1/namespaces/{namespace}/pods/{name}", pod)
    app.router.add_get("/api/v1/namespaces/{namespace}/pods", pods)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def client_for(host: str) -> KubeClient:
    configuration = k8s_client.Configuration(host=host)
    configuration.api_key = {"authorization": "s3cret"}
    configuration.api_key_prefix = {"authorization": "Bearer"}
    return KubeClient(k8s_client.ApiClient(configuration), "warmgate-test", max_threads=2)


async def test_requests_and_watch_streams_carry_the_user_agent_and_the_token() -> None:
    """The calls (from the client's threads, through the official client) and the watch
    streams (aiohttp, on the event loop) are one client to the apiserver: the same user
    agent, which is how its audit log and metrics tell warmgate's operator and router apart,
    and the same credentials."""
    seen: list[web.Request] = []
    async with apiserver(seen) as host:
        kube = client_for(host)
        try:
            assert await kube.get(POD, "ns", "x") == {"kind": "Pod", "metadata": {"name": "x"}}
            assert await kube.get(POD, "ns", "missing") is None
            events = [
                (event["type"], event["object"]["metadata"]["name"])
                async for event in kube.watch(POD, "ns", "7", timeout_seconds=5)
            ]
        finally:
            await kube.aclose()
    assert events == [("ADDED", "a"), ("MODIFIED", "a"), ("DELETED", "b")]
    assert [r.headers["User-Agent"] for r in seen] == ["warmgate-test"] * 3
    assert [r.headers["Authorization"] for r in seen] == ["Bearer s3cret"] * 3
    assert seen[2].query["resourceVersion"] == "7"
    assert kube.requests == {"GET pods": 2, "WATCH pods": 1}


async def test_an_error_status_carries_the_apiserver_message_and_no_answer_is_unanswered() -> None:
    seen: list[web.Request] = []
    async with apiserver(seen) as host:
        kube = client_for(host)
        try:
            with pytest.raises(ApiError) as refused:
                await kube.request("GET", POD.path("ns", "missing"))
        finally:
            await kube.aclose()
    assert (refused.value.status, refused.value.reason) == (404, "NotFound")
    assert 'pods "missing" not found' in str(refused.value)
    # The server is gone now: nothing listens on its port.
    kube = client_for(host)
    try:
        with pytest.raises(UNANSWERED):
            await kube.request("GET", POD.path("ns", "x"))
        with pytest.raises(UNANSWERED):
            async for _ in kube.watch(POD, "ns", "1", timeout_seconds=5):
                pass
    finally:
        await kube.aclose()
