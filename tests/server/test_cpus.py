"""The CPUs a server may use (its affinity, capped by its cgroup's limit) and how it shares them
among model workers, torch threads and tokenizer threads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from warmgate_server.config import parse_config
from warmgate_server.cpus import ThreadPlan, _cgroup_cpu_limit, plan_threads
from warmgate_testkit.process import CONTRACT_ROOT, SERVER_ROOT


def plan(*args: str, device: str = "cpu", cpus: int = 2) -> ThreadPlan:
    return plan_threads(parse_config(["--model", "m", *args], environ={}), device, cpus)


def test_on_a_cpu_two_single_threaded_workers_share_the_cores() -> None:
    # A lone small batch runs solo on every worker's threads.
    assert plan() == ThreadPlan(workers=2, threads=1, tokenizers=1, solo_threads=2)
    assert plan(cpus=1) == ThreadPlan(workers=1, threads=1, tokenizers=1, solo_threads=0)
    assert plan(cpus=16) == ThreadPlan(workers=2, threads=8, tokenizers=1, solo_threads=16)


def test_on_a_gpu_one_worker_and_the_spare_cpus_tokenize() -> None:
    assert plan(device="cuda", cpus=16) == ThreadPlan(workers=1, threads=16, tokenizers=4)
    assert plan("--model-workers", "2", device="cuda").solo_threads == 0  # the device's
    assert plan(device="cuda", cpus=64).tokenizers == 4  # no more than 4
    assert plan(device="cuda", cpus=2).tokenizers == 1


def test_flags_win_over_the_defaults() -> None:
    assert plan("--model-workers", "4", cpus=16) == ThreadPlan(4, 4, 1, 16)
    assert plan("--model-workers", "1", "--torch-threads", "3") == ThreadPlan(1, 3, 1, 0)
    assert plan("--tokenization-workers", "3", device="cuda", cpus=16).tokenizers == 3


def test_cgroup_cpu_limit_of_the_process_own_cgroup_v2_v1_and_none(tmp_path: Path) -> None:
    def limit(proc_cgroup: str, files: dict[str, str]) -> float | None:
        root = tmp_path / f"case{len(list(tmp_path.iterdir()))}"
        root.mkdir()
        for name, text in files.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(text + "\n")
        (root / "self-cgroup").write_text(proc_cgroup)
        return _cgroup_cpu_limit(root, root / "self-cgroup")

    assert limit("0::/pod-a\n", {"pod-a/cpu.max": "150000 100000"}) == 1.5
    assert limit("0::/\n", {"cpu.max": "max 100000"}) is None
    v1 = "4:memory:/x\n3:cpu,cpuacct:/pods/b\n"
    assert limit(v1, {"cpu/pods/b/cpu.cfs_quota_us": "400000",
                      "cpu/pods/b/cpu.cfs_period_us": "100000"}) == 4.0  # fmt: skip
    assert limit(v1, {"cpu/pods/b/cpu.cfs_quota_us": "-1",
                      "cpu/pods/b/cpu.cfs_period_us": "100000"}) is None  # fmt: skip
    assert limit("3:cpu:/gone\n", {}) is None
    assert _cgroup_cpu_limit(tmp_path, tmp_path / "no-such-file") is None


def test_a_process_pinned_to_one_cpu_counts_one() -> None:
    """`taskset -c 0` (or a kubelet's static CPU manager) leaves one CPU: the server must not
    start a torch thread per CPU of the machine."""
    script = (
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
        "from warmgate_server.cpus import usable_cpus; print(usable_cpus())"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "PYTHONPATH": os.pathsep.join((str(SERVER_ROOT), str(CONTRACT_ROOT)))},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1"]
