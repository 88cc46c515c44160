"""Observed traffic (pure parts): which shapes go back into the warmup plan, and when the
operator writes them."""

from __future__ import annotations

from warmgate_operator.observed import merged_shapes, status_patch, traffic_settings
from warmgate_operator.spec import ParsedSpecs


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


async def test_the_observer_runs_one_loop_per_service_and_stops_it_on_delete():
    from warmgate_operator.observed import TrafficObserver

    bodies = {("ns", "m"): body()}
    observer = TrafficObserver(client=None, session=None, bodies=bodies.get)
    observer.observe(("ns", "m"))
    observer.observe(("ns", "m"))  # an event for a service already observed: the same loop
    assert len(observer._tasks) == 1
    observer.observe(("ns", "m"), deleted=True)
    assert observer._tasks == {}
    observer.observe(("ns", "m"))
    await observer.close()
    assert observer._tasks == {}
