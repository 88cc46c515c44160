"""When a shape's latency has settled, and the steady latency it settled at. Pure."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SettleRule:
    window: int = 3
    """Runs that must agree (the first run of a shape never counts: it is the cold one)."""
    tolerance: float = 0.10
    """Agreement: max - min of the window within this share of its median."""
    max_runs: int = 12
    max_seconds: float = 8.0
    """Stop repeating a shape after this much time (once a window exists): a contended machine
    may never settle, and warmup must end. A shape whose warm runs alone (after the cold one)
    took this long stops without a window: a pass of that length has nothing left to settle,
    and repeating it is most of a large model's warmup (a 32 x 256 pass of an e5-base-sized
    model takes about 30 s on one core)."""


def settled(seconds: Sequence[float], rule: SettleRule) -> bool:
    """True once the last `window` runs after the first agree within `tolerance`."""
    warm_runs = seconds[1:]
    if len(warm_runs) < rule.window:
        return False
    window = warm_runs[-rule.window :]
    return max(window) - min(window) <= rule.tolerance * statistics.median(window)


def should_stop(seconds: Sequence[float], rule: SettleRule) -> bool:
    if len(seconds) >= rule.max_runs or settled(seconds, rule):
        return True
    if len(seconds) > rule.window:
        return sum(seconds) >= rule.max_seconds
    return sum(seconds[1:]) >= rule.max_seconds  # long warm passes: nothing left to settle


def steady_seconds(seconds: Sequence[float], rule: SettleRule) -> float:
    """Median of the last window of warm runs (all runs when there are too few)."""
    warm_runs = list(seconds[1:]) or list(seconds)
    return statistics.median(warm_runs[-rule.window :])
