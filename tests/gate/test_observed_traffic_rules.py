"""Observed traffic (pure parts): which shapes go back into the warmup plan, and when the
operator writes them."""

from __future__ import annotations

from warmgate_operator.observed import merge_profiles, status_patch, traffic_settings


def profile(*items):
    return {"shapes": [{"batch_size": b, "seq_len": s, "count": c} for b, s, c in items]}


def test_counts_are_summed_across_pods_and_the_most_frequent_kept():
    merged = merge_profiles(
        [profile((1, 32, 50), (8, 64, 5)), profile((1, 32, 20), (4, 128, 30)), None], max_shapes=2
    )
    assert merged == [
        {"batch_size": 1, "seq_len": 32, "count": 70},
        {"batch_size": 4, "seq_len": 128, "count": 30},
    ]


def test_garbage_in_a_profile_is_skipped_not_fatal():
    merged = merge_profiles(
        [{"shapes": [{"batch_size": "x"}, {"seq_len": 3}, {"batch_size": 2, "seq_len": 16}]}], 8
    )
    assert merged == []  # a shape with no count was never served


def test_ties_break_on_the_smaller_shape_so_the_profile_is_stable():
    merged = merge_profiles([profile((8, 64, 3), (1, 32, 3), (4, 32, 3))], max_shapes=3)
    assert [(m["batch_size"], m["seq_len"]) for m in merged] == [(1, 32), (4, 32), (8, 64)]


def body(status=None, rv="10"):
    obj = {"metadata": {"name": "m", "namespace": "ns", "resourceVersion": rv}, "spec": {}}
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
    assert traffic_settings(body()) == (True, 16, 300.0)
    off = body()
    off["spec"] = {"warmup": {"enabled": False, "observedTraffic": {"refreshSeconds": 30}}}
    assert traffic_settings(off) == (False, 16, 30.0)
