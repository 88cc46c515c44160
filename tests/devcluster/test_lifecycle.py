"""Bringing a whole devcluster up and down (its own, not the session's): idempotent `up`,
component health, and no process left behind, checked by pid."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from dc_helpers import CGROUPS_WRITABLE, cpu_cgroup, pod_manifest, server_container, wait_for

from warmgate_devcluster import procs
from warmgate_devcluster.cgroups import V1_CPU, control_plane_group_name
from warmgate_devcluster.cluster import AGENTS, COMPONENTS, CONTROL_PLANE, DevCluster, agent_env
from warmgate_devcluster.pytest_plugin import isolated_config, reserve_slot

pytestmark = pytest.mark.cluster


def test_up_status_down_leave_no_process(tmp_path):
    slot = reserve_slot()  # not the session cluster's block nor anyone else's
    cluster = DevCluster(isolated_config(tmp_path / "state", slot))
    started = time.monotonic()
    try:
        assert cluster.up(log=lambda *_: None) is True
        start_seconds = time.monotonic() - started
        assert cluster.up(log=lambda *_: None) is False  # already running: left alone
        health = {item.name: item for item in cluster.status()}
        assert set(health) == set(COMPONENTS)
        assert all(item.running and item.healthy for item in health.values()), health
        group = V1_CPU / control_plane_group_name(cluster.state_dir)
        if CGROUPS_WRITABLE:
            # The control plane shares the node at a small weight; the agents (kubelet's and
            # kube-proxy's stand-ins, on the request path) do not.
            assert (group / "cpu.shares").read_text().strip() == "256"
            assert {cpu_cgroup(health[name].pid) for name in CONTROL_PLANE} == {group}
            assert all(cpu_cgroup(health[name].pid) != group for name in AGENTS)

        # A pod process, so that tear-down has one to stop as well.
        manifest = pod_manifest("leftover", server_container())
        cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))
        wait_for(lambda: cluster.leftover_pod_processes(), "the pod's process")
        pids = cluster.all_pids()
        assert len(pids) == len(COMPONENTS) + 1
        assert all(procs.pid_running(pid) for pid in pids)
    finally:
        cluster.down(log=lambda *_: None)
        slot.release()
    assert not [pid for pid in pids if procs.pid_running(pid)]
    assert cluster.leftover_pod_processes() == []
    assert not group.exists()
    assert cluster.down(log=lambda *_: None) is False
    print(f"devcluster start: {start_seconds:.1f}s")


def test_cli_status_and_kubeconfig(tmp_path):
    env = agent_env()
    run = [sys.executable, "-m", "warmgate_devcluster", "--state-dir", str(tmp_path)]
    result = subprocess.run(
        [*run, "kubeconfig"], env=env, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == str(tmp_path / "kubeconfig")
    result = subprocess.run([*run, "status"], env=env, capture_output=True, text=True)
    assert result.returncode == 1 and "not running" in result.stdout
