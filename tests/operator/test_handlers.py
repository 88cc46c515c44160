"""How real kopf delivers the custom resources' watch events to handlers.py's handlers, which the
operator's design relies on: a listing reaches `Operator.observe` as type None, watch events with
their own type and in order, kopf writes nothing to the API, and a relist after a 410 yields only
the objects that exist (an empty one, nothing at all), so what vanished in the gap is never told.

kopf runs in-process with the product's registry, login handler included, against a fake
apiserver on 127.0.0.1 (the kubeconfig points there): a 410 at a chosen moment and an empty relist
cannot be caused on demand on the real devcluster apiserver. The cluster tests
(test_cluster_operator.py) cover the real path.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import kopf
import pytest
from aiohttp import web

from warmgate_kube.kinds import EMBEDDING_ALIAS, EMBEDDING_SERVICE, ResourceKind
from warmgate_operator.handlers import register

pytestmark = pytest.mark.timeout(60)

ES, EA = EMBEDDING_SERVICE.plural, EMBEDDING_ALIAS.plural
GROUP_VERSION = "/apis/" + EMBEDDING_SERVICE.api_version
WAIT_S = 10.0
GONE = {
    "type": "ERROR",
    "object": {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
               "reason": "Expired", "message": "too old resource version", "code": 410},
}  # fmt: skip


def _resource(plural: str, kind: str, namespaced: bool = True) -> dict[str, Any]:
    verbs = ["get", "list", "watch", "patch", "create", "delete"]
    return {"name": plural, "singularName": kind.lower(), "kind": kind, "namespaced": namespaced,
            "verbs": verbs}  # fmt: skip


def _group(name: str, version: str) -> dict[str, Any]:
    gv = {"groupVersion": f"{name}/{version}", "version": version}
    return {"name": name, "versions": [gv], "preferredVersion": gv}


DISCOVERY = {
    "/api": {"kind": "APIVersions", "versions": ["v1"]},
    "/api/v1": {"resources": [_resource("namespaces", "Namespace", False),
                              _resource("events", "Event")]},
    "/apis": {"kind": "APIGroupList", "groups": [_group("apiextensions.k8s.io", "v1"),
                                                 _group("warmgate.dev", "v1alpha1")]},
    "/apis/apiextensions.k8s.io/v1": {
        "resources": [_resource("customresourcedefinitions", "CustomResourceDefinition", False)]},
    GROUP_VERSION: {"resources": [_resource(ES, EMBEDDING_SERVICE.kind),
                                  _resource(f"{ES}/status", EMBEDDING_SERVICE.kind),
                                  _resource(EA, EMBEDDING_ALIAS.kind)]},
}  # fmt: skip


def obj(kind: ResourceKind, name: str, version: int = 1) -> dict[str, Any]:
    meta = {"name": name, "namespace": "default", "uid": f"uid-{name}",
            "resourceVersion": str(version)}  # fmt: skip
    return {"apiVersion": kind.api_version, "kind": kind.kind, "metadata": meta, "spec": {}}


class Seen(NamedTuple):
    verb: str  # GET (discovery), LIST, WATCH, PATCH, ...
    path: str
    query: dict[str, str]
    user_agent: str


class FakeApiserver:
    """Discovery, LIST and WATCH of the two custom resources; every request is recorded, and
    each watch streams what the test puts on its queue (an ERROR event ends it, as it does on
    the apiserver)."""

    def __init__(self) -> None:
        self.seen: list[Seen] = []
        self.items: dict[str, list[dict[str, Any]]] = {ES: [], EA: []}
        self.watches: dict[str, list[asyncio.Queue[dict[str, Any] | None]]] = {ES: [], EA: []}
        self.version = 10

    def count(self, verb: str, plural: str) -> int:
        return sum(s.verb == verb and s.path == f"{GROUP_VERSION}/{plural}" for s in self.seen)

    def send(self, plural: str, event: dict[str, Any]) -> None:
        self.watches[plural][-1].put_nowait(event)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        plural = request.path.removeprefix(f"{GROUP_VERSION}/")
        verb = request.method
        if verb == "GET" and plural in self.items:
            verb = "WATCH" if request.query.get("watch") == "true" else "LIST"
        self.seen.append(
            Seen(verb, request.path, dict(request.query), request.headers.get("User-Agent", ""))
        )
        if verb == "WATCH":
            return await self._watch(request, plural)
        if verb == "LIST":
            self.version += 1
            listing = {"metadata": {"resourceVersion": str(self.version)}}
            return web.json_response({**listing, "items": self.items[plural]})
        if verb == "GET" and request.path in DISCOVERY:
            return web.json_response(DISCOVERY[request.path])
        print(f"fake apiserver: unexpected {request.method} {request.path_qs}")
        return web.json_response({"kind": "Status", "code": 404}, status=404)

    async def _watch(self, request: web.Request, plural: str) -> web.StreamResponse:
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self.watches[plural].append(queue)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        while (event := await queue.get()) is not None:
            await response.write(json.dumps(event).encode() + b"\n")
            if event["type"] == "ERROR":
                break
        return response

    def close_watches(self) -> None:
        for queues in self.watches.values():
            for queue in queues:
                queue.put_nowait(None)


@pytest.fixture
async def apiserver(monkeypatch, tmp_path) -> AsyncIterator[FakeApiserver]:
    fake = FakeApiserver()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fake.handle)
    # handler_cancellation: a watch whose client went away ends instead of waiting on its queue.
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
            "users": [{"name": "fake", "user": {}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
        })
    )  # fmt: skip
    # The product's login handler reads this kubeconfig; a CI pod's own service account (which
    # that handler prefers) must not send kopf to a real cluster.
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.setattr(kopf, "login_with_service_account", lambda **_: None)
    try:
        yield fake
    finally:
        fake.close_watches()
        await runner.cleanup()


@dataclass
class Memo:
    """The Operator's stand-in: records start, stop and every observe call."""

    log: list[tuple[Any, ...]] = field(default_factory=list)

    def observe(self, kind: ResourceKind, type_: str | None, body: dict[str, Any]) -> None:
        self.log.append(("observe", kind.plural, type_, body["metadata"]["name"]))

    async def start(self) -> None:
        self.log.append(("start",))

    async def stop(self) -> None:
        self.log.append(("stop",))

    def listed(self) -> bool:
        return True

    def __copy__(self) -> Memo:  # kopf hands each object's handlers copy.copy(memo)
        return self

    @property
    def observed(self) -> list[tuple[str, str | None, str]]:
        return [entry[1:] for entry in self.log if entry[0] == "observe"]


@dataclass
class Running:
    fake: FakeApiserver
    memo: Memo
    task: asyncio.Task[None]

    async def until(self, predicate: Callable[[], bool], what: str) -> None:
        """Wait for `predicate`; fail if kopf exits or it takes more than WAIT_S."""
        try:
            async with asyncio.timeout(WAIT_S):
                while not predicate():
                    if self.task.done():
                        self.task.result()
                        raise AssertionError(f"kopf exited before {what}")
                    await asyncio.sleep(0.01)
        except TimeoutError:
            raise AssertionError(f"no {what} in {WAIT_S}s: {self.fake.seen}") from None

    async def listed_and_watching(self, plural: str, times: int = 1) -> None:
        await self.until(lambda: self.fake.count("WATCH", plural) >= times, f"watch #{times}")
        assert self.fake.count("LIST", plural) == times


@contextlib.asynccontextmanager
async def operator(fake: FakeApiserver, *, aliases: bool = True) -> AsyncIterator[Running]:
    """Real kopf with the product's handlers, stopped by its stop flag on exit."""
    registry = kopf.OperatorRegistry()
    register(registry, aliases=aliases)
    settings = kopf.OperatorSettings()
    # kopf SIGKILLs its own process 10 min after any stop but the flag's (running.py).
    settings.process.ultimate_exiting_timeout = None
    memo, stop = Memo(), asyncio.Event()
    # kopf installs loop handlers for SIGINT/SIGTERM; conftest's SIGTERM handler is put back.
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    task = asyncio.create_task(
        kopf.operator(registry=registry, settings=settings, standalone=True, clusterwide=True,
                      memo=memo, stop_flag=stop)
    )  # fmt: skip
    try:
        yield Running(fake, memo, task)
    finally:
        stop.set()
        try:
            await asyncio.wait_for(task, WAIT_S)
        finally:
            loop = asyncio.get_running_loop()
            for sig, handler in saved.items():
                loop.remove_signal_handler(sig)
                signal.signal(sig, handler)
    assert memo.log[-1] == ("stop",)


async def start_with_two(op: Running) -> None:
    op.fake.items[ES] = [obj(EMBEDDING_SERVICE, "a"), obj(EMBEDDING_SERVICE, "b")]
    await op.listed_and_watching(ES)
    await op.until(lambda: len(op.memo.observed) == 2, "initial listing")


async def gone_then_relist(op: Running, remaining: list[str]) -> None:
    """Objects vanish while the watch is away; the watch ends with a 410; kopf relists."""
    op.fake.items[ES] = [obj(EMBEDDING_SERVICE, name, 20) for name in remaining]
    op.fake.send(ES, GONE)
    await op.listed_and_watching(ES, times=2)


async def test_listing_is_observed_as_type_none_and_nothing_is_written(apiserver):
    """An operator start sees every existing EmbeddingService once, after Operator.start(), and
    kopf writes nothing to the API (no finalizer, annotation, status or Event)."""
    async with operator(apiserver) as op:
        await start_with_two(op)
    assert sorted(op.memo.observed) == [(ES, None, "a"), (ES, None, "b")]
    assert op.memo.log[0] == ("start",)
    assert [s for s in apiserver.seen if s.verb not in ("GET", "LIST", "WATCH")] == []
    watch = next(s for s in apiserver.seen if s.verb == "WATCH")
    assert watch.query["timeoutSeconds"] == "300"  # configure_settings ran before the watch


async def test_empty_relist_after_410_tells_nothing(apiserver):
    """The limit that forces the operator's own audit: objects deleted while the watch was away
    are never reported by kopf when the relist is empty: no DELETED, no call at all."""
    async with operator(apiserver) as op:
        await start_with_two(op)
        await gone_then_relist(op, remaining=[])
        # A barrier: an object made after the relist arrives, so the relist's were handled.
        op.fake.send(ES, {"type": "ADDED", "object": obj(EMBEDDING_SERVICE, "c", 21)})
        await op.until(lambda: len(op.memo.observed) == 3, "the event after the relist")
    assert op.memo.observed[2:] == [(ES, "ADDED", "c")]


async def test_relist_after_410_yields_only_the_survivors(apiserver):
    """After a 410 the relist reports the survivor as type None again; the one deleted in the
    gap gets no DELETED."""
    async with operator(apiserver) as op:
        await start_with_two(op)
        await gone_then_relist(op, remaining=["b"])
        await op.until(lambda: len(op.memo.observed) == 3, "the relisted survivor")
        op.fake.send(ES, {"type": "ADDED", "object": obj(EMBEDDING_SERVICE, "c", 21)})
        await op.until(lambda: len(op.memo.observed) == 4, "the event after the relist")
    assert op.memo.observed[2:] == [(ES, None, "b"), (ES, "ADDED", "c")]


async def test_watch_events_keep_their_type_and_order(apiserver):
    """Changes to an EmbeddingService reach the Operator as ADDED/MODIFIED/DELETED, in the order
    the apiserver sent them for each object."""
    expected = [("c", "ADDED"), ("d", "ADDED"), ("c", "MODIFIED"), ("d", "MODIFIED"),
                ("c", "MODIFIED"), ("d", "DELETED"), ("c", "DELETED")]  # fmt: skip
    async with operator(apiserver) as op:
        await op.listed_and_watching(ES)
        for version, (name, type_) in enumerate(expected, start=30):
            op.fake.send(ES, {"type": type_, "object": obj(EMBEDDING_SERVICE, name, version)})
        await op.until(lambda: len(op.memo.observed) == len(expected), "all watch events")
    for name in ("c", "d"):
        got = [type_ for _, type_, n in op.memo.observed if n == name]
        assert got == [type_ for n, type_ in expected if n == name]


async def test_every_request_is_kopfs(apiserver):
    """Every request kopf makes (discovery, lists, watches, the relist) names itself in its
    User-Agent, so the cluster tests can tell kopf's traffic from the operator's own client."""
    async with operator(apiserver) as op:
        await start_with_two(op)
        await gone_then_relist(op, remaining=["a"])
    assert {s.verb for s in apiserver.seen} >= {"GET", "LIST", "WATCH"}
    assert [s for s in apiserver.seen if not s.user_agent.startswith("kopf/")] == []


@pytest.mark.parametrize("aliases", [False, True])
async def test_aliases_are_carried_only_when_asked(apiserver, aliases):
    """With aliases=False kopf never lists or watches EmbeddingAliases (the Operator watches them
    itself); with aliases=True both kinds are listed and watched and reach observe."""
    apiserver.items[EA] = [obj(EMBEDDING_ALIAS, "x")]
    async with operator(apiserver, aliases=aliases) as op:
        await op.listed_and_watching(ES)
        if aliases:
            await op.listed_and_watching(EA)
            await op.until(lambda: (EA, None, "x") in op.memo.observed, "the alias's listing")
        # A barrier: a round trip through the EmbeddingService watch after both watchers started.
        op.fake.send(ES, {"type": "ADDED", "object": obj(EMBEDDING_SERVICE, "c", 21)})
        await op.until(lambda: (ES, "ADDED", "c") in op.memo.observed, "the barrier event")
    alias_requests = [s for s in apiserver.seen if s.path.startswith(f"{GROUP_VERSION}/{EA}")]
    if aliases:
        assert {s.verb for s in alias_requests} == {"LIST", "WATCH"}
    else:
        assert alias_requests == []
        assert all(plural == ES for plural, _, _ in op.memo.observed)
