"""A warmup held to the pod's CPU share (pacing.py, --warmup-cpus): the arithmetic, and a real
server process warming the real model, its CPU time read from /proc while it warms."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from warmgate_server.pacing import CpuPacer
from warmgate_testkit.process import ServerProcess, minilm_path

PLAN = ["--sequence-buckets", "32,64,128", "--warmup-batch-sizes", "1,8"]
"""examples/minilm.yaml's plan: 6 shapes."""


class Clocks:
    def __init__(self) -> None:
        self.wall = 0.0
        self.cpu = 0.0  # this process's
        self.node: float | None = 0.0  # the node's busy CPU seconds, this process's included

    def pacer(self, cpus: float) -> CpuPacer:
        return CpuPacer(
            cpus,
            busy_cpus=0.25,
            burst_seconds=0.05,
            window=0.2,
            cpu_time=lambda: self.cpu,
            clock=lambda: self.wall,
            node_time=lambda: self.node,
        )

    def run(self, seconds: float, own_cpus: float, other_cpus: float) -> None:
        self.wall += seconds
        self.cpu += own_cpus * seconds
        assert self.node is not None
        self.node += (own_cpus + other_cpus) * seconds


def test_a_pass_runs_on_the_pacers_credit_then_waits_until_its_share_earned_it() -> None:
    clocks = Clocks()
    clocks.node = None  # no /proc/stat: paced throughout
    pacer = clocks.pacer(0.5)
    assert pacer.delay() == 0.0  # the first pass runs on the credit
    clocks.wall += 0.1
    clocks.cpu += 0.2  # two threads for 0.1 s: 0.2 CPU s, of which 0.05 earned, 0.05 credit
    assert pacer.delay() == pytest.approx(0.1 / 0.5)  # 0.1 CPU s over: 0.2 s at half a CPU
    clocks.wall += 0.2  # it slept that long, using nothing
    assert pacer.delay() == 0.0
    # Idle time earns no more than the credit: a long pause does not buy a long burst.
    clocks.wall += 60.0
    assert pacer.delay() == 0.0
    clocks.cpu += 1.0
    assert pacer.delay() == pytest.approx((1.0 - 0.05) / 0.5)
    assert CpuPacer(0).delay() == 0.0  # unpaced


def test_the_warmup_is_paced_only_while_the_nodes_other_processes_are_busy() -> None:
    clocks = Clocks()
    pacer = clocks.pacer(0.5)
    assert pacer.delay() == 0.0
    for _ in range(5):  # alone on the node: two CPUs' passes, never a wait
        clocks.run(0.3, own_cpus=2.0, other_cpus=0.1)
        assert pacer.delay() == 0.0
    # Serving pods beside it start using 0.4 CPUs: from the next window on, half a CPU.
    clocks.run(0.3, own_cpus=2.0, other_cpus=0.4)
    assert pacer.delay() > 0
    waits = []
    for _ in range(5):
        clocks.run(0.3, own_cpus=2.0, other_cpus=0.4)
        waits.append(pacer.delay())
        clocks.run(waits[-1], own_cpus=0.0, other_cpus=0.4)  # the sleep
    assert all(wait == pytest.approx(0.3 * 2.0 / 0.5 - 0.3) for wait in waits[1:]), waits
    # They go quiet: unpaced again.
    clocks.run(0.3, own_cpus=2.0, other_cpus=0.0)
    pacer.delay()
    clocks.run(0.3, own_cpus=2.0, other_cpus=0.0)
    assert pacer.delay() == 0.0
    assert 0.1 < pacer.others_cpus < 0.4


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _phase(server: ServerProcess) -> str | None:
    try:
        with urllib.request.urlopen(server.url + "/ready", timeout=5) as response:
            return json.loads(response.read())["phase"]
    except urllib.error.HTTPError as error:
        return json.loads(error.read())["phase"]
    except OSError:
        return None


def warm(extra: list[str]) -> tuple[float, float, str]:
    """(CPUs used on average while warming, seconds warming, the log) of a MiniLM server."""
    args = ["--model", str(minilm_path()), "--device", "cpu", *PLAN, *extra]
    with ServerProcess(args) as server:
        server.wait_for_port(120)
        assert server.process is not None
        pid = server.process.pid
        while (phase := _phase(server)) not in ("warming", "ready", "failed"):
            time.sleep(0.005)
        assert phase == "warming", phase  # seen before the warmup ended
        started, cpu = time.monotonic(), _cpu_seconds(pid)
        while (phase := _phase(server)) == "warming":
            time.sleep(0.02)
        assert phase == "ready", server.log()[-2000:]
        seconds = time.monotonic() - started
        return (_cpu_seconds(pid) - cpu) / seconds, seconds, server.log()


@pytest.mark.slow
def test_a_warmup_beside_a_busy_core_keeps_to_its_cpu_share(report) -> None:
    """At --warmup-cpus 0.5, beside a process that keeps a core busy (a serving pod), the
    server uses about half a CPU while it warms; unpaced, beside the same, it takes more. (That
    an otherwise idle node is not paced is the unit test's above: a test machine is never
    sure to be idle.)"""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs: one CPU's warmup is under one CPU paced or not")
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        paced, paced_seconds, log = warm(["--warmup-cpus", "0.5"])
        free, free_seconds, _ = warm([])
    finally:
        burner.kill()
        burner.wait()
    report(
        f"MiniLM, examples/minilm.yaml's plan, beside a busy core: --warmup-cpus 0.5 "
        f"{paced:.2f} CPUs for {paced_seconds:.1f} s; unpaced {free:.2f} CPUs for "
        f"{free_seconds:.1f} s"
    )
    line = re.compile(r"while the node was busy \(([\d.]+)s of [\d.]+s; .*\): ([\d.]+)s spent")
    busy = line.search(log)
    assert busy is not None and float(busy.group(1)) > 0 and float(busy.group(2)) > 0, log[-2000:]
    # Each pass is paid for before the next, so the last shape's passes and the HTTP path's
    # three requests after them are not: 0.53-0.58 CPUs here.
    assert paced < 0.5 * 1.3, (paced, paced_seconds)
    assert free > paced + 0.2, (free, paced)
