"""Which pod serves and which stands by (roles.assign, count) and the scale-out record
(reconcile.track_scale_out): pure functions, every combination of serving, standby, surge,
terminating and not-yet-Ready pods."""

from __future__ import annotations

from typing import Any

import pytest

from warmgate_operator.reconcile import track_scale_out
from warmgate_operator.roles import Member, assign, count, managed, role_patch

SERVING, STANDBY = "serving", "standby"


def member(
    name: str,
    role: str | None = None,
    ready: bool = True,
    current: bool = True,
    since: float = 0.0,
) -> Member:
    return Member(name, f"uid-{name}", role, ready, current, since)


def pod(
    name: str,
    role: str | None = None,
    ready: str = "True",
    spec_hash: str = "new",
    since: str = "2026-12-02T10:00:00Z",
    terminating: bool = False,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "uid": f"uid-{name}",
        "labels": {"warmgate.dev/role": role} if role else {},
        "annotations": {"warmgate.dev/spec-hash": spec_hash},
    }
    if terminating:
        meta["deletionTimestamp"] = "2026-12-02T10:05:00Z"
    return {
        "metadata": meta,
        "status": {
            "conditions": [{"type": "Ready", "status": ready, "lastTransitionTime": since}],
            "containerStatuses": [{"name": "server", "restartCount": 1}],
        },
    }


def test_a_scale_out_promotes_the_standby_pod_and_keeps_the_serving_ones() -> None:
    pods = [
        member("a", SERVING, since=1),
        member("b", SERVING, since=2),
        member("c", STANDBY, since=3),
    ]
    assert assign(pods, serving=3) == {"a": SERVING, "b": SERVING, "c": SERVING}
    # Before the scale-out nothing moves.
    assert assign(pods, serving=2) == {"a": SERVING, "b": SERVING, "c": STANDBY}


def test_a_new_pod_joins_the_pool_and_never_displaces_a_serving_pod() -> None:
    pods = [member("a", SERVING, since=5), member("b", SERVING, since=6), member("new", since=1)]
    assert assign(pods, serving=2)["new"] == STANDBY


def test_a_scale_in_demotes_the_most_recently_ready_serving_pod() -> None:
    pods = [
        member("a", SERVING, since=1),
        member("b", SERVING, since=2),
        member("c", SERVING, since=3),
        member("d", STANDBY, since=0),
    ]
    assert assign(pods, serving=2) == {"a": SERVING, "b": SERVING, "c": STANDBY, "d": STANDBY}


def test_a_rollout_puts_new_pods_in_front_of_old_serving_ones() -> None:
    pods = [
        member("old-1", SERVING, current=False, since=1),
        member("old-2", SERVING, current=False, since=2),
        member("old-3", STANDBY, current=False, since=3),
        member("new-1", since=10),
    ]
    roles = assign(pods, serving=2)
    assert roles["new-1"] == SERVING
    assert [name for name, role in roles.items() if role == SERVING] == ["new-1", "old-1"]
    assert roles["old-3"] == STANDBY


def test_pods_that_are_not_ready_get_no_role_and_are_not_counted() -> None:
    pods = [
        member("a", SERVING, since=1),
        member("restarting", SERVING, ready=False, since=0),
        member("starting", ready=False),
        member("c", STANDBY, since=2),
    ]
    roles = assign(pods, serving=2)
    assert roles == {"a": SERVING, "c": SERVING}
    assert count(pods, pool=True).serving == 1  # c's label is still standby until written


def test_counts_with_and_without_a_pool() -> None:
    pods = [
        member("a", SERVING),
        member("b", STANDBY),
        member("old", STANDBY, current=False),
        member("down", SERVING, ready=False),
    ]
    assert count(pods, pool=True) == count(pods[:3], pool=True)
    assert (count(pods, pool=True).serving, count(pods, pool=True).standby) == (1, 1)
    # Without a pool the Service selects every Ready pod: all serve, whatever the label.
    assert (count(pods, pool=False).serving, count(pods, pool=False).standby) == (3, 0)


def test_roles_are_managed_with_a_pool_or_while_a_pod_still_has_one() -> None:
    assert managed([member("a")], pool=True)
    assert not managed([member("a"), member("b")], pool=False)
    assert managed([member("a"), member("b", STANDBY)], pool=False)


def test_member_reads_ready_terminating_template_and_restarts_from_the_pod() -> None:
    fresh = Member.of(pod("a", STANDBY), "new")
    assert (fresh.role, fresh.ready, fresh.current, fresh.restarts) == (STANDBY, True, True, 1)
    assert fresh.process == "uid-a/1"
    assert not Member.of(pod("b", ready="False"), "new").ready
    assert not Member.of(pod("c", terminating=True), "new").ready
    assert not Member.of(pod("d", spec_hash="old"), "new").current


def test_the_role_patch_sets_label_and_deletion_cost_with_a_precondition() -> None:
    patch = role_patch(STANDBY, "42")
    assert patch == {
        "metadata": {
            "labels": {"warmgate.dev/role": STANDBY},
            "annotations": {"controller.kubernetes.io/pod-deletion-cost": "0"},
            "resourceVersion": "42",
        }
    }
    cost = role_patch(SERVING, None)["metadata"]["annotations"]
    assert int(cost["controller.kubernetes.io/pod-deletion-cost"]) > 0


def test_a_scale_out_is_timed_from_the_decision_to_the_capacity() -> None:
    steady = {"desiredServingReplicas": 2, "standbyReplicas": 1, "servingReplicas": 2}
    started = track_scale_out(steady, 3, {"servingReplicas": 2}, now=100.0)
    assert started["desiredServingReplicas"] == 3
    pending = started["scaleOut"]
    assert (pending["fromReplicas"], pending["toReplicas"], pending["standbyPromoted"]) == (
        2,
        3,
        True,
    )
    assert "lastScaleOut" not in started
    # Still two serving: the scale-out stays pending, same decision time.
    waiting = track_scale_out({**steady, **started}, 3, {"servingReplicas": 2}, now=100.4)
    assert waiting["scaleOut"] == pending
    done = track_scale_out({**steady, **waiting}, 3, {"servingReplicas": 3}, now=100.75)
    assert "scaleOut" not in done
    assert done["lastScaleOut"]["seconds"] == pytest.approx(0.75, abs=0.002)
    assert done["lastScaleOut"]["capacityAt"].startswith("1970-01-01T00:01:40.7")
    # The record stays until the next scale-out.
    later = track_scale_out({**steady, **done}, 3, {"servingReplicas": 3}, now=200.0)
    assert later["lastScaleOut"] == done["lastScaleOut"]


def test_a_scale_out_bigger_than_the_pool_says_so_and_a_first_status_decides_nothing() -> None:
    short = {"desiredServingReplicas": 2, "standbyReplicas": 1}
    assert not track_scale_out(short, 4, {}, now=1.0)["scaleOut"]["standbyPromoted"]
    assert track_scale_out({}, 4, {"servingReplicas": 0}, now=1.0) == {"desiredServingReplicas": 4}
    # A scale-in while one is pending: done once as many serve as are now wanted.
    pending = track_scale_out(short, 4, {"servingReplicas": 2}, now=1.0)
    shrunk = track_scale_out({**short, **pending}, 2, {"servingReplicas": 2}, now=2.0)
    assert shrunk["lastScaleOut"]["seconds"] == pytest.approx(1.0)


def test_a_promotion_in_the_reconcile_that_saw_the_decision_is_timed_from_its_start() -> None:
    steady = {"desiredServingReplicas": 2, "standbyReplicas": 1}
    done = track_scale_out(steady, 3, {"servingReplicas": 3}, now=100.04, seen=100.0)
    assert done["lastScaleOut"]["seconds"] == pytest.approx(0.04, abs=0.002)
    assert done["lastScaleOut"]["decidedAt"].startswith("1970-01-01T00:01:40.0")
