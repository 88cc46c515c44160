"""Bringing a whole devcluster up and down (its own, not the session's): idempotent `up`,
component health, and nothing left behind: no process (checked by pid), no network
namespace or link, no mount, no cgroup."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dc_helpers import pod_manifest, script_configmap, server_container, wait_for

from warmgate_devcluster import cgroups, procs
from warmgate_devcluster.cluster import COMPONENTS, CONTROL_PLANE, NODE, DevCluster, mounts_under
from warmgate_devcluster.pytest_plugin import isolated_config, reserve_slot

pytestmark = pytest.mark.cluster


def cpu_group(pid: int) -> str:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _hierarchy, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return path.lstrip("/")
    raise AssertionError(f"pid {pid} is in no cpu cgroup")


def test_up_status_down_leave_nothing_behind(tmp_path):
    slot = reserve_slot()  # not the session cluster's network nor anyone else's
    # The cluster's own images only: this test needs no model server.
    cluster = DevCluster(isolated_config(tmp_path / "state", slot, app_images=False))
    config = cluster.config
    started = time.monotonic()
    try:
        assert cluster.up(log=lambda *_: None) is True
        start_seconds = time.monotonic() - started
        assert cluster.up(log=lambda *_: None) is False  # already running: left alone
        health = {item.name: item for item in cluster.status()}
        assert set(health) == set(COMPONENTS)
        assert all(item.running and item.healthy for item in health.values()), health
        # The control plane shares the machine at a small weight; the node does not.
        control_plane = cgroups.V1_CPU / config.control_plane_group
        assert (control_plane / "cpu.shares").read_text().strip() == "256"
        assert {cpu_group(health[name].pid) for name in CONTROL_PLANE} == {
            config.control_plane_group
        }
        assert {cpu_group(health[name].pid) for name in NODE} == {config.node_group}

        # A running pod, so that tear-down has a container, a shim and mounts to remove too.
        cluster.kubectl("apply", "-f", "-", input=json.dumps(script_configmap()))
        cluster.kubectl(
            "apply", "-f", "-", input=json.dumps(pod_manifest("left", server_container()))
        )

        def running() -> bool:
            pod = json.loads(cluster.kubectl("get", "pod", "left", "-o", "json").stdout)
            return bool(pod["status"].get("containerStatuses", [{}])[0].get("ready"))

        wait_for(running, "the pod to run", 90)
        pids = cluster.all_pids()
        assert len(pids) > len(COMPONENTS) + 2  # + shims and containers (pause, the server)
        assert all(procs.pid_running(pid) for pid in pids)
        assert mounts_under(cluster.state_dir, config.run_dir)
    finally:
        cluster.down(log=lambda *_: None)
        slot.release()
    assert not [pid for pid in pids if procs.pid_running(pid)]
    assert not cluster.network.netns_path.exists()
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert cluster.network.host_link not in links
    assert not mounts_under(cluster.state_dir, config.run_dir, config.containerd_dir)
    for name in (config.cluster_name, config.node_group, config.control_plane_group):
        assert not (cgroups.V1_CPU / name).exists(), name
    assert cluster.down(log=lambda *_: None) is False
    print(f"devcluster start: {start_seconds:.1f}s")


def test_cli_status_and_kubeconfig(tmp_path):
    run = [sys.executable, "-m", "warmgate_devcluster", "--state-dir", str(tmp_path)]
    result = subprocess.run([*run, "kubeconfig"], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == str(tmp_path / "kubeconfig")
    result = subprocess.run([*run, "status"], capture_output=True, text=True)
    assert result.returncode == 1 and "not running" in result.stdout
