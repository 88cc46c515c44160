"""How long the router holds a request for a service with no warm pod (hold.py), from the
status the operator writes: each status here is made by the operator's own idle.zero_status,
so the field names and what they mean cannot drift apart. The holds themselves, over HTTP with
real pods and the OpenAI SDK, are in test_proxy.py."""

from __future__ import annotations

from typing import Any

import pytest

from warmgate_operator.idle import parse_stamp, zero_status
from warmgate_router.hold import (
    CLIENT_TIMEOUT_HEADER,
    DEFAULT_RETRY_AFTER,
    client_timeout,
    plan_hold,
    time_to_warm,
)

T0 = parse_stamp("2026-03-01T12:00:00Z")
assert T0 is not None
HOLD, CEILING = 120.0, 600.0


def service(replicas: int, status: dict[str, Any]) -> dict[str, Any]:
    autoscaling = {"enabled": True, "minReplicas": 0, "scaleToZero": {"idleSeconds": 300}}
    return {"spec": {"replicas": replicas, "autoscaling": autoscaling}, "status": status}


def woken_once(wake_seconds: float) -> dict[str, Any]:
    """The status after one wake of `wake_seconds`, then back at zero, as the operator
    records them."""
    asleep = zero_status({}, True, True, 0, T0)
    woken = zero_status(asleep, True, False, 0, T0 + 100)
    awake = zero_status(woken, True, False, 1, T0 + 100 + wake_seconds)
    return zero_status(awake, True, True, 0, T0 + 5_000)


def test_a_service_not_measured_yet_is_held_the_configured_time() -> None:
    hold = plan_hold(service(0, {}), HOLD, CEILING, T0)
    assert (hold.seconds, hold.expected, hold.hopeless) == (HOLD, None, False)
    assert hold.retry_after() == DEFAULT_RETRY_AFTER


def test_a_big_model_is_held_its_measured_wake_with_room_to_spare() -> None:
    """A 300 s wake measured last time: 1.5 x 300 + 30 s, well past the default 120."""
    status = woken_once(300)
    assert status["scaleToZero"]["wakeSeconds"] == 300
    hold = plan_hold(service(0, status), HOLD, CEILING, T0 + 9_000)
    assert hold.seconds == pytest.approx(480) and hold.expected == 300 and not hold.hopeless
    assert hold.waking and "300 s to warm" in hold.bound


def test_a_quick_model_keeps_at_least_the_configured_hold() -> None:
    """A short hold never serves sooner (a held request goes the moment a pod is warm); it
    only turns a wake slower than the last one into 503s."""
    hold = plan_hold(service(0, woken_once(8)), HOLD, CEILING, T0 + 9_000)
    assert hold.seconds == HOLD and hold.expected == 8 and not hold.hopeless


def test_past_the_ceiling_the_answer_is_at_once_with_when_to_retry() -> None:
    hold = plan_hold(service(0, woken_once(900)), HOLD, CEILING, T0 + 9_000)
    assert hold.seconds == CEILING and hold.hopeless
    assert hold.bound == "--max-hold-seconds 600"
    assert hold.retry_after() == 900


def test_a_wake_under_way_counts_what_it_has_taken_already() -> None:
    """A request that arrives 200 s into a 300 s wake (lastWokeAt, no awakeAt yet) expects a
    pod in 100 s, and is held to 1.5 x 300 + 30 s from the wake's start."""
    woken = zero_status(woken_once(300), True, False, 0, T0 + 6_000)
    assert woken["scaleToZero"]["wakeSeconds"] == 300  # the last wake's, until this one ends
    hold = plan_hold(service(1, woken), HOLD, CEILING, T0 + 6_200)
    assert hold.expected == pytest.approx(100) and hold.seconds == pytest.approx(280)
    assert hold.retry_after() == 100 and hold.retry_after(elapsed=60) == 40
    # Later than the last one: nothing left to expect, held at least --hold-seconds.
    late = plan_hold(service(1, woken), HOLD, CEILING, T0 + 6_500)
    assert late.expected == 0 and late.seconds == HOLD
    assert late.retry_after() == DEFAULT_RETRY_AFTER


def test_a_client_that_says_how_long_it_waits_is_answered_before_it_gives_up() -> None:
    timeout = client_timeout("60.0")
    assert timeout == 60.0
    quick = plan_hold(service(0, woken_once(20)), HOLD, CEILING, T0 + 9_000, timeout)
    assert quick.seconds == 59 and not quick.hopeless  # held, answered 1 s before it leaves
    slow = plan_hold(service(0, woken_once(300)), HOLD, CEILING, T0 + 9_000, timeout)
    assert slow.hopeless and slow.retry_after() == 300
    assert CLIENT_TIMEOUT_HEADER in slow.bound
    for garbled in ("soon", "-1", "nan", "inf"):
        assert client_timeout(garbled) is None


def test_a_service_that_never_woke_uses_its_first_start_then_its_pods_start() -> None:
    first = zero_status({"servingReplicas": 0}, True, False, 1, T0 + 95, first_pod_created=T0)
    measured = time_to_warm(service(1, first))
    assert measured is not None and measured.seconds == 95
    assert measured.field == "status.scaleToZero.wakeSeconds"
    started = time_to_warm({"status": {"startupSeconds": 70}})
    assert started is not None and started.seconds == 70
    assert started.field == "status.startupSeconds"
    hold = plan_hold({"spec": {"replicas": 2}, "status": {"startupSeconds": 70}}, HOLD, CEILING, T0)
    assert hold.seconds == pytest.approx(135) and not hold.waking
    assert time_to_warm({"status": {"startupSeconds": "70"}}) is None


def test_no_holding_holds_nothing_even_when_measured() -> None:
    hold = plan_hold(service(0, woken_once(300)), 0.0, CEILING, T0 + 9_000)
    assert hold.seconds == 0 and hold.retry_after() == 300
