"""Observed traffic (pure parts): which shapes go back into the warmup plan, and when the
operator writes them."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from warmgate_contract.names import SERVICE_LABEL
from warmgate_contract.report import ReadyReport
from warmgate_kube.client import ApiError
from warmgate_kube.kinds import EMBEDDING_SERVICE, POD
from warmgate_operator.metrics import Metrics
from warmgate_operator.observed import (
    TrafficObserver,
    merged_shapes,
    slowest_warmup,
    status_patch,
    traffic_settings,
)
from warmgate_operator.podclient import PodClient
from warmgate_operator.runtime import CHILD_KINDS
from warmgate_operator.spec import ParsedSpecs
from warmgate_operator.watch import Cache


def profile(*items):
    return {"shapes": [{"batch_size": b, "seq_len": s, "count": c} for b, s, c in items]}


def test_counts_are_summed_across_pods_and_the_most_frequent_kept():
    merged = merged_shapes(
        [profile((1, 32, 50), (8, 64, 5)), profile((1, 32, 20), (4, 128, 30)), None], max_shapes=2
    )
    assert merged == [
        {"batch_size": 1, "seq_len": 32, "count": 70},
        {"batch_size": 4, "seq_len": 128, "count": 30},
    ]


def test_a_profile_that_breaks_the_contract_is_left_out_not_fatal():
    garbage = {"shapes": [{"batch_size": "x"}, {"seq_len": 3}, {"batch_size": 2, "seq_len": 16}]}
    merged = merged_shapes([garbage, profile((2, 16, 4)), "not json"], 8)
    assert merged == [{"batch_size": 2, "seq_len": 16, "count": 4}]
    assert merged_shapes([profile((2, 16, 0))], 8) == []  # a shape never served


def test_ties_break_on_the_smaller_shape_so_the_profile_is_stable():
    merged = merged_shapes([profile((8, 64, 3), (1, 32, 3), (4, 32, 3))], max_shapes=3)
    assert [(m["batch_size"], m["seq_len"]) for m in merged] == [(1, 32), (4, 32), (8, 64)]


def report(phase="ready", warmup_seconds=None):
    """A `/ready` body as the server writes it (the contract's own rendering)."""
    return ReadyReport(
        phase=phase,
        model_id="m",
        revision="main",
        served_name="m",
        device="cpu",
        dtype="float32",
        planned=(),
        warmed=(),
        warmup_seconds=warmup_seconds,
    ).to_json()


def test_the_slowest_warmup_is_read_from_reports_that_follow_the_contract():
    assert slowest_warmup([report(warmup_seconds=4.0), report(warmup_seconds=6.25), None]) == 6.25
    # Still warming (no time yet), or not a report at all: left out, not fatal.
    broken = {"warmup_seconds": 99.0}  # no phase, no model: not a /ready report
    wrong_phase = {**report(warmup_seconds=50.0), "phase": "sleeping"}
    assert slowest_warmup([report("warming"), broken, wrong_phase, report(warmup_seconds=2)]) == 2
    assert slowest_warmup([broken, "not json", ["a", "list"]]) is None


def body(status=None, rv="10"):
    obj = {
        "metadata": {"name": "m", "namespace": "ns", "resourceVersion": rv},
        "spec": {"model": {"id": "m"}},
    }
    if status is not None:
        obj["status"] = status
    return obj


def test_no_write_when_nothing_changed():
    shapes = [{"batch_size": 1, "seq_len": 32, "count": 7}]
    assert status_patch(body({"observedShapes": shapes, "warmupSeconds": 3.5}), shapes, 3.5) is None


def test_a_change_is_written_guarded_by_the_resource_version():
    shapes = [{"batch_size": 1, "seq_len": 32, "count": 7}]
    patch = status_patch(body({"observedShapes": []}), shapes, 2.0)
    assert patch[0] == {"op": "test", "path": "/metadata/resourceVersion", "value": "10"}
    assert {"op": "add", "path": "/status/observedShapes", "value": shapes} in patch
    assert {"op": "add", "path": "/status/warmupSeconds", "value": 2.0} in patch


def test_nothing_is_written_before_the_reconcile_created_a_status():
    assert status_patch(body(None), [{"batch_size": 1, "seq_len": 32, "count": 1}], 1.0) is None


def test_settings_default_like_the_crd_and_follow_warmup_enabled():
    specs = ParsedSpecs()
    assert traffic_settings(specs.of(body())) == (True, 16, 300.0)
    off = body()
    off["spec"]["warmup"] = {"enabled": False, "observedTraffic": {"refreshSeconds": 30}}
    assert traffic_settings(ParsedSpecs().of(off)) == (False, 16, 30.0)
    assert traffic_settings(None)[0] is False  # a spec that does not parse


def observer_of(api, service, pods=(), port=8080) -> TrafficObserver:
    """An observer whose watch cache holds `service` (named m) and `pods`."""
    cache = Cache(EMBEDDING_SERVICE, CHILD_KINDS, SERVICE_LABEL)
    cache.services.replace(None, [service])
    cache.children[POD].replace(None, list(pods))
    return TrafficObserver(api, PodClient(Metrics()), cache, ParsedSpecs(), port=port)


async def close(observer: TrafficObserver) -> None:
    await observer.close()
    await observer._pods.close()


async def test_the_observer_runs_one_loop_per_service_and_stops_it_on_delete():
    observer = observer_of(None, body())
    observer.observe(("ns", "m"))
    observer.observe(("ns", "m"))  # an event for a service already observed: the same loop
    assert len(observer._tasks) == 1
    observer.observe(("ns", "m"), deleted=True)
    assert observer._tasks == {}
    observer.observe(("ns", "m"))
    await observer.close()
    assert observer._tasks == {}


# ------------------------------------------------------ collection, with pods that misbehave
class Api:
    """The status patch; `failures` are raised by the next patches."""

    def __init__(self, failures=()):
        self.failures, self.patches = list(failures), []

    async def json_patch(self, kind, namespace, name, operations, subresource=None):
        if self.failures:
            raise self.failures.pop(0)
        self.patches.append(operations)


def pod(address, ready=True):
    condition = {"type": "Ready", "status": "True" if ready else "False"}
    return {
        "metadata": {
            "name": f"m-{address}",
            "namespace": "ns",
            "uid": address,
            "labels": {SERVICE_LABEL: "m"},
        },
        "status": {"podIP": address, "conditions": [condition]},
    }


@pytest.fixture
async def pods():
    """Four server pods on their own loopback addresses (one port): one answers as the
    contract says, one with a body far too big and a report that is not JSON, one that drops
    the connection, one with a report that is JSON but not the contract's."""

    async def good_profile(request):
        return web.json_response(profile((1, 32, 10), (4, 64, 3)))

    async def good_report(request):
        return web.json_response(report(warmup_seconds=4.0))

    async def off_contract_report(request):
        return web.json_response({"phase": "ready", "warmup_seconds": 99.0})

    async def huge(request):
        response = web.StreamResponse()
        await response.prepare(request)
        for _ in range(40):
            await response.write(b"[" * 65536)
        return response

    async def garbage(request):
        return web.Response(text="<html>not json</html>")

    async def hang_up(request):
        request.transport.close()
        await asyncio.sleep(1)
        return web.Response()

    behaviours = [
        (good_profile, good_report),
        (huge, garbage),
        (hang_up, hang_up),
        (good_profile, off_contract_report),
    ]
    runners, port = [], 0
    for index, (on_profile, on_ready) in enumerate(behaviours):
        app = web.Application()
        app.router.add_get("/warmup/profile", on_profile)
        app.router.add_get("/ready", on_ready)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, f"127.0.0.{index + 2}", port)
        await site.start()
        port = port or runner.addresses[0][1]
        runners.append(runner)
    yield port
    for runner in runners:
        await runner.cleanup()


async def test_a_round_counts_the_pods_that_answer_and_survives_the_rest(pods) -> None:
    addresses = ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5")
    api = Api()
    others = [pod(address) for address in addresses] + [pod("127.0.0.6", False)]
    observer = observer_of(api, body(status={}), others, port=pods)
    assert await observer.collect(("ns", "m")) is True
    await close(observer)
    (operations,) = api.patches
    written = {op["path"]: op["value"] for op in operations if op["op"] == "add"}
    assert written["/status/observedShapes"] == profile((1, 32, 20), (4, 64, 6))["shapes"]
    # The off-contract report's 99 s is not taken for a warmup time.
    assert written["/status/warmupSeconds"] == 4.0


@pytest.mark.parametrize(
    ("failure", "outcome"),
    [(ApiError(409, "Conflict", "modified"), False), (ApiError(404, "NotFound", "gone"), False)],
)
async def test_a_status_write_that_lost_a_race_waits_for_the_next_round(
    pods, failure, outcome
) -> None:
    api = Api(failures=[failure])
    observer = observer_of(api, body(status={}), [pod("127.0.0.2")], port=pods)
    assert await observer.collect(("ns", "m")) is outcome
    assert await observer.collect(("ns", "m")) is True  # the next round writes
    await close(observer)


async def test_an_api_error_does_not_end_the_loop(pods, monkeypatch) -> None:
    """A 500 or a dropped connection from the API fails one round; the loop goes on."""
    monkeypatch.setattr("warmgate_operator.observed.MIN_REFRESH_SECONDS", 0.01)
    failures = [ApiError(500, "InternalError", "etcd"), ApiError(0, "", "reset")]
    api = Api(failures=failures)
    service = body(status={})
    service["spec"]["warmup"] = {"observedTraffic": {"refreshSeconds": 1}}
    observer = observer_of(api, service, [pod("127.0.0.2")], port=pods)
    observer.observe(("ns", "m"))
    for _ in range(500):
        if api.patches:
            break
        await asyncio.sleep(0.01)
    await close(observer)
    assert api.patches and not api.failures
