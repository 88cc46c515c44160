"""Scale to zero's decision (idle.py): what counts as activity, when a service is idle, and
the status fields that record a wake."""

from __future__ import annotations

from typing import Any

import pytest

from warmgate_contract.names import LAST_REQUEST_ANNOTATION
from warmgate_operator.idle import (
    Activity,
    IdleDecision,
    asleep_message,
    decide,
    first_pod_created,
    parse_stamp,
    stamp,
    zero_status,
)

T0 = parse_stamp("2026-03-01T12:00:00Z")
assert T0 is not None


def at(seconds: float) -> str:
    """T0 + seconds, as the API writes times."""
    return stamp(T0 + seconds)


def body(
    request: str | None = None, status: dict[str, Any] | None = None, created: float = 0
) -> dict[str, Any]:
    annotations = {LAST_REQUEST_ANNOTATION: request} if request else {}
    return {
        "metadata": {"creationTimestamp": at(created), "annotations": annotations},
        "status": status or {},
    }


def test_stamps_in_utc_with_or_without_a_fraction_or_an_offset() -> None:
    assert parse_stamp("2026-03-01T12:00:10Z") == T0 + 10
    assert parse_stamp("2026-03-01T12:00:10.500000Z") == T0 + 10.5
    assert parse_stamp("2026-03-01T13:00:10+01:00") == T0 + 10
    for bad in (None, "", "yesterday", "2026-03-01T12:00:10", 12):
        assert parse_stamp(bad) is None


AWAKE = {"scaleToZero": {"awakeAt": at(0)}}
"""A pod has served since the creation."""


def test_activity_is_the_latest_of_request_wake_serving_and_creation() -> None:
    created = Activity.of(body())
    assert created.latest == T0 and created.starting
    requested = Activity.of(body(request=at(50), status=AWAKE))
    assert requested.latest == T0 + 50 and not requested.starting
    history = {"lastWokeAt": at(80), "awakeAt": at(95)}
    awake = Activity.of(body(request=at(50), status={"scaleToZero": history}))
    assert awake.latest == T0 + 95 and not awake.starting
    woken = Activity.of(body(request=at(50), status={"scaleToZero": {"lastWokeAt": at(80)}}))
    assert woken.latest == T0 + 80 and woken.starting
    # A garbled annotation counts for nothing rather than failing the reconcile.
    assert Activity.of(body(request="soon")).latest == T0


def test_a_starting_service_is_never_idle_unless_its_pods_fail() -> None:
    """No pod has served since the creation or the last wake: its first pod may take longer
    to load and warm than idleSeconds, while warmgate-router holds the requests that woke it.
    But pods that cannot start (an image that will not pull) keep nothing up."""
    new = Activity.of(body())
    woken = Activity.of(body(status={"scaleToZero": {"lastWokeAt": at(20)}}))
    for activity in (new, woken):
        assert activity.starting
        held = decide(10, False, activity, T0 + 10_000)
        assert (held.scale_to_zero, held.recheck_after) == (False, None)
        assert decide(10, False, activity, T0 + 10_000, failing=True).scale_to_zero
    assert not decide(10, False, woken, T0 + 25, failing=True).scale_to_zero  # 5 s since the wake


@pytest.mark.parametrize(
    ("idle_limit", "at_zero", "last_request", "now", "expected"),
    [
        (None, False, None, 10_000, IdleDecision(False, 0.0, None)),  # no scaleToZero
        (60, True, None, 10_000, IdleDecision(False, 0.0, None)),  # at zero already
        (60, False, None, 59, IdleDecision(False, 59.0, 1.0)),  # since it first served
        (60, False, None, 60, IdleDecision(True, 60.0, None)),
        (60, False, 100, 130, IdleDecision(False, 30.0, 30.0)),  # a request restarts it
        (60, False, 100, 161.5, IdleDecision(True, 61.5, None)),
        (60, False, 200, 150, IdleDecision(False, 0.0, 60.0)),  # a clock behind the router's
    ],
)
def test_the_decision(
    idle_limit: int | None,
    at_zero: bool,
    last_request: float | None,
    now: float,
    expected: IdleDecision,
) -> None:
    request = None if last_request is None else at(last_request)
    activity = Activity.of(body(request=request, status=AWAKE))
    assert decide(idle_limit, at_zero, activity, T0 + now) == expected


def test_the_status_records_the_zero_and_the_wake() -> None:
    # Not configured: nothing, whatever the previous status said.
    assert zero_status({"scaledToZeroAt": at(0)}, False, False, 1, T0) == {}
    # A new service: when its first pod serves.
    assert zero_status({}, True, False, 0, T0 + 5) == {}
    assert zero_status({}, True, False, 1, T0 + 9) == {"scaleToZero": {"awakeAt": at(9)}}
    # At zero: when first seen there, kept after.
    asleep = zero_status({}, True, True, 0, T0 + 100)
    assert asleep == {"scaledToZeroAt": at(100)}
    assert zero_status(asleep, True, True, 0, T0 + 500) == asleep
    # spec.replicas left 0: the wake's time, and no longer at zero.
    woken = zero_status(asleep, True, False, 0, T0 + 600)
    assert woken == {"scaleToZero": {"lastWokeAt": at(600)}}
    assert zero_status(woken, True, False, 0, T0 + 650) == woken  # still starting
    # Its first pod serves: the wake is over, and that moment counts as activity. How long
    # it took is what warmgate-router sizes its next hold from.
    awake = zero_status(woken, True, False, 1, T0 + 700)
    assert awake == {"scaleToZero": {"lastWokeAt": at(600), "awakeAt": at(700), "wakeSeconds": 100}}
    assert zero_status(awake, True, False, 2, T0 + 900) == awake
    assert Activity.of(body(status=awake)).latest == T0 + 700
    # Back at zero, then woken again: a new wake replaces the old one's times, and the time
    # the last one took stands until the new one is over.
    again = zero_status({**awake, "scaledToZeroAt": at(800)}, True, False, 0, T0 + 950)
    assert again == {"scaleToZero": {"lastWokeAt": at(950), "wakeSeconds": 100}}
    quicker = zero_status(again, True, False, 1, T0 + 990)
    assert quicker["scaleToZero"]["wakeSeconds"] == 40


def test_a_first_start_is_timed_from_its_first_pods_creation() -> None:
    """Before any wake, the service's first start is its time to warm: from the oldest Ready
    pod's creation to the reconcile that sees it serve. Only when this reconcile sees it go
    from no serving pod to one: a service that served before scaleToZero was set has pods
    whose age says nothing of how long they took to warm."""
    starting = {"servingReplicas": 0}
    first = zero_status(starting, True, False, 1, T0 + 95, first_pod_created=T0 + 10)
    assert first == {"scaleToZero": {"awakeAt": at(95), "wakeSeconds": 85}}
    long_serving = {"servingReplicas": 2}
    added = zero_status(long_serving, True, False, 2, T0 + 9_000, first_pod_created=T0 + 10)
    assert added == {"scaleToZero": {"awakeAt": at(9_000)}}
    assert zero_status({}, True, False, 1, T0 + 95, first_pod_created=T0 + 10) == {
        "scaleToZero": {"awakeAt": at(95)}
    }


def test_the_first_pod_created_is_the_oldest_ready_one() -> None:
    def pod(created: float, ready: bool = True, deleting: bool = False) -> dict[str, Any]:
        meta: dict[str, Any] = {"creationTimestamp": at(created)}
        if deleting:
            meta["deletionTimestamp"] = at(created + 1)
        condition = {"type": "Ready", "status": "True" if ready else "False"}
        return {"metadata": meta, "status": {"conditions": [condition]}}

    pods = [pod(30), pod(5, ready=False), pod(1, deleting=True), pod(20)]
    assert first_pod_created(pods) == T0 + 20
    assert first_pod_created([pod(5, ready=False)]) is None


def test_the_ready_message_at_zero_is_stable_and_says_how_it_wakes() -> None:
    activity = Activity.of(body(request=at(40)))
    previous = {"scaledToZeroAt": at(100)}
    message = asleep_message(previous, activity, T0 + 5_000)
    assert message == (
        "scaled to zero after 60 s without requests; a request through warmgate-router "
        "scales it back to 1"
    )
    assert asleep_message(previous, activity, T0 + 9_000) == message
    # The reconcile that first sees zero counts to its own time.
    assert "after 20 s" in asleep_message({}, activity, T0 + 60)
