"""When warmup stops repeating a shape, and the steady latency it reports for it."""

from __future__ import annotations

from warmgate_server.settle import SettleRule, settled, should_stop, steady_seconds

RULE = SettleRule(window=3, tolerance=0.1, max_runs=10, max_seconds=100)


def test_settling_ignores_the_cold_first_run() -> None:
    assert not settled([0.9, 0.1, 0.1], RULE)
    assert settled([0.9, 0.1, 0.105, 0.1], RULE)
    assert not settled([0.9, 0.1, 0.2, 0.1], RULE)
    # Only the last window counts: a slow run before it no longer holds the shape back.
    assert settled([0.9, 0.5, 0.1, 0.1, 0.1], RULE)


def test_the_steady_latency_is_the_last_windows_median_without_the_cold_run() -> None:
    assert steady_seconds([0.9, 0.1, 0.105, 0.1], RULE) == 0.1
    assert steady_seconds([0.9, 0.3, 0.2, 0.1, 0.12, 0.11], RULE) == 0.11
    # Too few runs to settle: the warm ones still, and the cold one only when it is alone.
    assert steady_seconds([0.9, 0.2], RULE) == 0.2
    assert steady_seconds([0.9], RULE) == 0.9


def test_warmup_of_a_shape_ends_settled_at_the_run_cap_or_at_the_time_cap() -> None:
    assert should_stop([0.9, 0.1, 0.1, 0.1], RULE)  # settled
    assert not should_stop([0.9, 0.1, 0.2, 0.1], RULE)
    assert should_stop([0.5, 0.1, 0.3] * 3 + [0.2], RULE)  # 10 runs, never settled
    # Over the time cap, but only once a window of warm runs exists: a contended machine
    # must not end a shape's warmup on its cold run alone.
    assert not should_stop([200.0], RULE)
    assert not should_stop([60.0, 1.0, 50.0], RULE)
    assert should_stop([60.0, 1.0, 50.0, 1.0], RULE)
    # Warm runs that alone took the time cap: a pass that long has nothing left to settle.
    assert should_stop([130.0, 120.0], RULE)
    assert not should_stop([130.0, 99.0], RULE)
    assert should_stop([130.0, 99.0, 2.0], RULE)


def test_a_cpu_warms_a_shape_with_one_cold_and_one_timed_run() -> None:
    """A CPU's first pass of a shape pays all the first-time cost there is, so warmup runs it
    twice and reports the second as its steady latency; a GPU settles as before."""
    from warmgate_server.settle import default_rule

    cpu = default_rule("cpu")
    assert not should_stop([0.5], cpu)
    assert should_stop([0.5, 0.1], cpu)
    assert steady_seconds([0.5, 0.1], cpu) == 0.1
    gpu = default_rule("cuda")
    assert not should_stop([0.5, 0.1], gpu)
    assert should_stop([0.5, 0.1, 0.1, 0.1], gpu)
