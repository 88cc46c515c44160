"""Warmup that yields the node's CPUs to the pods serving beside it, so that a reload leaves
their latency alone.

A pod's CPU request is what the scheduler set aside for it; a pod without a CPU limit may run on
every idle core of the node, and a warmup runs flat out on all of them. The serving pods beside
it burst past their own requests on every request (a lone request runs on every core the pod
sees), so a warmup that takes the idle cores takes them from their passes, and their tail
latency with them. But a warmup with nothing beside it (a first start, a scale-out or a wake
from zero with requests waiting for it) should take every core it can.

So CpuPacer measures, between the warmup's passes, the CPU the node's other processes use
(/proc/stat's busy time less this process's own): while that is at least `busy_cpus`, the
warmup uses on average no more than `cpus` CPUs (the pod's request, --warmup-cpus): the CPU
time this process used is set against what `cpus` earned since, with a small credit
(`burst_seconds` of CPU) for the pass about to run, and past it the warmup sleeps until it is
even. While the node is otherwise idle, it runs unpaced. Inside a container /proc/stat is the
node's (cgroup v1 and v2 alike, without lxcfs); where it is not readable, the warmup is paced
throughout.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

_TICKS = os.sysconf("SC_CLK_TCK")


def node_busy_seconds(stat: Path = Path("/proc/stat")) -> float | None:
    """CPU seconds every CPU of the node has been busy since boot (user, nice, system, irq,
    softirq, steal), or None where /proc/stat cannot be read."""
    try:
        with stat.open() as lines:
            fields = [int(value) for value in lines.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    if len(fields) < 8:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / _TICKS


@dataclass
class CpuPacer:
    cpus: float
    """The CPUs the warmup may use on average while the node is busy (a pod's CPU request, in
    cores); 0: never paced."""
    busy_cpus: float = 0.25
    """The node's other processes using at least this many CPUs (averaged over `window`) make
    the node busy: serving pods at 20 requests a second used 0.3-0.4 here, the idle control
    plane and node agents of the devcluster under 0.15."""
    burst_seconds: float = 0.05
    """CPU seconds the warmup may run ahead of its share: enough for one small pass at once."""
    window: float = 0.2
    """Seconds over which the others' CPU is averaged (/proc/stat counts in 10 ms ticks)."""
    cpu_time: Callable[[], float] = time.process_time
    clock: Callable[[], float] = time.monotonic
    node_time: Callable[[], float | None] = node_busy_seconds
    waited_seconds: float = 0.0
    """How long the warmup slept to stay within its share (logged)."""
    busy_seconds: float = 0.0
    """How long the node was seen busy while the warmup ran (logged)."""
    others_cpu_seconds: float = 0.0
    """CPU seconds the node's other processes used over the windows measured."""
    measured_seconds: float = 0.0
    _credit: float = field(default=0.0, init=False)
    _last: tuple[float, float] | None = field(default=None, init=False)
    _sample: tuple[float, float, float] | None = field(default=None, init=False)
    _busy: bool = field(default=True, init=False)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock, init=False)

    @property
    def others_cpus(self) -> float:
        """The CPUs the node's other processes used on average over the windows measured."""
        return self.others_cpu_seconds / self.measured_seconds if self.measured_seconds else 0.0

    def _node_busy(self, now: float, used: float) -> bool:
        """Whether the node's other processes used `busy_cpus` or more over the last window;
        unknown (no /proc/stat) counts as busy."""
        node = self.node_time()
        if node is None:
            return True
        if self._sample is None:
            self._sample = (now, used, node)
            return self._busy
        then, used_then, node_then = self._sample
        if now - then >= self.window:
            others = (node - node_then - (used - used_then)) / (now - then)
            self.others_cpu_seconds += others * (now - then)
            self.measured_seconds += now - then
            self._busy = others >= self.busy_cpus
            self._sample = (now, used, node)
        return self._busy

    def delay(self) -> float:
        """Seconds to sleep before the next pass: none while the node is otherwise idle, or
        while the CPU used since the last call is within what `cpus` earned (plus the credit
        left, at most `burst_seconds`)."""
        if self.cpus <= 0:
            return 0.0
        now, used = self.clock(), self.cpu_time()
        busy = self._node_busy(now, used)
        if self._last is not None and busy:
            self.busy_seconds += now - self._last[0]
        if self._last is None or not busy:
            self._credit = self.burst_seconds
        else:
            earned = self.cpus * (now - self._last[0])
            self._credit = min(self.burst_seconds, self._credit + earned - (used - self._last[1]))
        self._last = (now, used)
        if self._credit >= 0:
            return 0.0
        return -self._credit / self.cpus

    async def admit(self) -> None:
        """Sleep as long as `delay` says (the event loop serves /live and /ready meanwhile).
        One debt is paid once: workers admitted side by side wait in turn, and the one after
        a sleep finds the debt paid."""
        async with self._lock:
            seconds = self.delay()
            if seconds > 0:
                self.waited_seconds += seconds
                await asyncio.sleep(seconds)
