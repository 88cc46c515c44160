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


CPU_RULE = SettleRule(window=1, max_runs=2)
"""On a CPU a shape's first pass pays every first-time cost it has (the allocator's growth, the
thread team's first use, oneDNN's primitive for its row count; the row counts a planned shape
does not reach are made apart, linear.warm), so a shape runs twice: once cold, once timed, and
the timed run is the steady latency /ready reports and the warm gate times its verification
request against (a short sample, not the first real traffic: the gate needs it before any
traffic comes). Repeating until the latency settled (the GPU's rule) was 109 of 112.5 s to
/ready for an XLM-R of multilingual-e5-base's shape, and bought 2 s off one shape's first
request (issue 40)."""

GPU_RULE = SettleRule()
"""On a GPU each pass is milliseconds, so settling costs little, and cuBLAS's heuristics, the
caching allocator's pools and CUDA graph replay are not measured here to warm in one run."""


def default_rule(device_type: str) -> SettleRule:
    return GPU_RULE if device_type == "cuda" else CPU_RULE


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
