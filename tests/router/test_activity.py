"""The router's half of scale to zero against the operator's: the last-request times the
router writes keep a service that is serving steadily awake, by the operator's own decision
(warmgate_operator.idle.decide), with the write and the watch taking their time."""

from __future__ import annotations

import heapq
import math

import pytest

from warmgate_operator.idle import Activity, decide, parse_stamp
from warmgate_router.view import activity_interval
from warmgate_router.waking import activity_stamp

T0 = 1_780_000_000.0


def sleepy(idle_seconds: int) -> dict:
    return {
        "spec": {"autoscaling": {"enabled": True, "minReplicas": 0,
                                 "scaleToZero": {"idleSeconds": idle_seconds}}}
    }  # fmt: skip


def first_sleep(
    idle_seconds: int,
    interval: float,
    stamp,
    traffic_seconds: float = 90.0,
    every: float = 0.1,
    lag: float = 0.4,
) -> float | None:
    """When the operator would scale a service to zero while a client sends a request every
    `every` seconds for `traffic_seconds` (None: never). The router writes a stamp of the
    request's moment at most every `interval` s; the operator sees it `lag` s later (the
    PATCH, the watch), reconciles on seeing it and again when decide() says the window ends."""
    events: list[tuple[float, str, float]] = []  # (when, what, the stamped moment)
    written = -math.inf
    t = 0.0
    while t < traffic_seconds:
        if t - written >= interval:
            written = t
            heapq.heappush(events, (t + lag, "annotation", parse_stamp(stamp(T0 + t)) - T0))
        t = round(t + every, 6)
    heapq.heappush(events, (0.0, "recheck", 0.0))
    seen = None
    while events:
        now, what, moment = heapq.heappop(events)
        if now > traffic_seconds:
            return None
        if what == "annotation":
            seen = moment if seen is None else max(seen, moment)
        activity = Activity(last_request=None if seen is None else T0 + seen, created=T0,
                            awake=T0 + 1.0)  # fmt: skip
        verdict = decide(idle_seconds, False, activity, T0 + now)
        if verdict.scale_to_zero:
            return now
        if verdict.recheck_after is not None:
            heapq.heappush(events, (now + verdict.recheck_after, "recheck", 0.0))
    return None


@pytest.mark.parametrize("idle_seconds", [10, 11, 30, 300])
@pytest.mark.parametrize("configured", [10.0, 60.0])
def test_steady_traffic_keeps_a_service_awake(idle_seconds: int, configured: float) -> None:
    interval = activity_interval(sleepy(idle_seconds), configured)
    assert interval <= idle_seconds / 3
    assert (
        first_sleep(idle_seconds, interval, activity_stamp, traffic_seconds=3 * idle_seconds)
        is None
    )


def test_writes_once_a_window_in_whole_seconds_put_a_serving_service_to_sleep() -> None:
    """What the router did before: a stamp in whole seconds, at most every --activity-seconds
    (10, the smallest idleSeconds): the operator saw a window end while requests flowed."""

    def whole_seconds(moment: float) -> str:
        return activity_stamp(math.floor(moment))

    assert first_sleep(10, 10.0, whole_seconds) is not None


def test_a_stamp_keeps_its_milliseconds_and_reads_back_as_written() -> None:
    moment = T0 + 12.3456
    text = activity_stamp(moment)
    assert text.endswith("Z") and text.count(".") == 1
    assert parse_stamp(text) == pytest.approx(moment, abs=1e-3)


def test_a_service_without_scale_to_zero_keeps_the_configured_interval() -> None:
    assert activity_interval(None, 10.0) == 10.0
    assert activity_interval({"spec": {"autoscaling": {"enabled": True}}}, 10.0) == 10.0
    assert activity_interval(sleepy(300), 10.0) == 10.0
    assert activity_interval(sleepy(12), 10.0) == 4.0
