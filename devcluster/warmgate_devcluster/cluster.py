"""Bringing a devcluster up and down: control plane, node agent, EndpointSlice controller and
service proxy as background processes recorded in the state folder."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from warmgate_devcluster import cgroups, procs
from warmgate_devcluster import controlplane as cp
from warmgate_devcluster.binaries import find_bin_dir
from warmgate_devcluster.config import PACKAGE_DIR, ClusterConfig
from warmgate_devcluster.models import seed_default_models
from warmgate_devcluster.pki import Pki, create_pki

# Start order; `down` stops them in reverse.
CONTROL_PLANE = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
AGENTS = ("endpointslices", "service-proxy", "node-agent")
COMPONENTS = CONTROL_PLANE + AGENTS
# Files and folders `up` owns inside the state folder (wiped before a fresh start).
_OWNED = (
    "pki",
    "etcd",
    "logs",
    "pods",
    "ready",
    "certs",
    "kubeconfig",
    "runtime.json",
    "cluster.json",
)


@dataclass(frozen=True)
class ComponentHealth:
    name: str
    pid: int | None
    running: bool
    healthy: bool
    detail: str


def agent_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for the Python agents: this package importable, output unbuffered."""
    env = dict(os.environ if base is None else base)
    package_parent = str(PACKAGE_DIR.parent)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    paths = [str(Path(p).resolve()) for p in paths]  # the agents run in another folder
    if package_parent not in paths:
        paths.insert(0, package_parent)
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("KUBECONFIG", None)
    return env


class DevCluster:
    """One local cluster, described by its configuration and its state folder."""

    def __init__(self, config: ClusterConfig | None = None) -> None:
        self.config = config or ClusterConfig.from_env()
        self.pki = Pki(self.config.pki_dir)
        self._children: dict[str, subprocess.Popen] = {}

    # ----------------------------------------------------------------- paths and records
    @property
    def state_dir(self) -> Path:
        return self.config.state_dir

    @property
    def kubeconfig(self) -> Path:
        return self.config.kubeconfig

    def runtime(self) -> dict:
        try:
            return json.loads(self.config.runtime_file.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def _write_runtime(self, runtime: dict) -> None:
        tmp = self.config.runtime_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(runtime, indent=2, sort_keys=True))
        tmp.replace(self.config.runtime_file)

    def records(self) -> dict[str, procs.ProcRecord]:
        return {
            name: procs.ProcRecord.from_dict(rec)
            for name, rec in self.runtime().get("procs", {}).items()
        }

    @property
    def bin_dir(self) -> Path | None:
        value = self.runtime().get("bin_dir")
        return Path(value) if value else None

    @property
    def ports(self) -> cp.Ports | None:
        value = self.runtime().get("ports")
        return cp.Ports(**value) if value else None

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with open(self.state_dir / ".lock", "w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    # ----------------------------------------------------------------- up
    def is_up(self) -> bool:
        records = self.records()
        if set(records) != set(COMPONENTS):
            return False
        if not all(procs.is_running(r) for r in records.values()):
            return False
        return self._apiserver_ready()

    def up(self, *, log=print) -> bool:
        """Start everything; False (and nothing touched) when it is already up and healthy."""
        with self._lock():
            if self.is_up():
                log(f"devcluster already running (state {self.state_dir})")
                return False
            self._stop_all(log=lambda *_: None)
            started = time.monotonic()
            bin_dir = find_bin_dir()
            self._wipe()
            try:
                self._start(bin_dir, log)
            except BaseException:
                log(
                    "devcluster failed to start; stopping what started. Logs: "
                    f"{self.config.logs_dir}"
                )
                self._stop_all(log=lambda *_: None)
                raise
            log(f"devcluster up in {time.monotonic() - started:.1f}s")
            return True

    def _wipe(self) -> None:
        for name in _OWNED:
            path = self.state_dir / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()

    def _start(self, bin_dir: Path, log) -> None:
        if self.config.model_cache is None:
            # Server pods resolve hub ids (sentence-transformers/all-MiniLM-L6-v2) offline from
            # a Hugging Face cache seeded from the installed model packages.
            self.config = dataclasses.replace(
                self.config, model_cache=self.config.state_dir / "hf-home"
            )
            seed_default_models(self.config.model_cache)
        cfg = self.config
        cfg.state_dir.mkdir(parents=True, exist_ok=True)
        cfg.logs_dir.mkdir(parents=True, exist_ok=True)
        cfg.config_file.write_text(cfg.to_json())
        pki = create_pki(cfg.pki_dir)
        ports = cp.Ports(*procs.free_ports(5))
        runtime = {"bin_dir": str(bin_dir), "ports": ports.__dict__, "procs": {}}
        self._write_runtime(runtime)

        group = None
        if cfg.control_plane_cpu_shares:
            group = cgroups.control_plane_group(
                cgroups.control_plane_group_name(cfg.state_dir), cfg.control_plane_cpu_shares
            )

        def launch(name: str, argv: list[str], env: dict[str, str] | None = None):
            if name in CONTROL_PLANE and group is not None:
                argv = cgroups.launch_in(group, argv)
            record, child = procs.spawn(
                name, argv, cfg.logs_dir / f"{name}.log", env=env, cwd=cfg.state_dir
            )
            self._children[name] = child
            runtime["procs"][name] = record.to_dict()
            self._write_runtime(runtime)
            return record

        timeout = cfg.start_timeout
        etcd = launch("etcd", cp.etcd_argv(bin_dir, cfg.state_dir / "etcd", ports))
        cp.wait_until(
            lambda: cp.http_get(f"http://127.0.0.1:{ports.etcd_client}/health")[0] == 200,
            "etcd",
            timeout,
            alive=lambda: procs.is_running(etcd),
        )
        certs = cfg.state_dir / "certs"
        apiserver = launch(
            "kube-apiserver",
            cp.apiserver_argv(bin_dir, pki, certs / "apiserver", ports, cfg.node_port_range),
        )
        cp.wait_until(
            self._apiserver_ready,
            "kube-apiserver /readyz",
            timeout,
            alive=lambda: procs.is_running(apiserver),
        )
        cfg.kubeconfig.write_text(cp.kubeconfig_yaml(ports.apiserver_url, pki))
        cfg.kubeconfig.chmod(0o600)
        kcm = launch(
            "kube-controller-manager",
            cp.controller_manager_argv(bin_dir, pki, cfg.kubeconfig, certs / "kcm", ports),
        )
        scheduler = launch(
            "kube-scheduler", cp.scheduler_argv(bin_dir, cfg.kubeconfig, certs / "sched", ports)
        )
        env = agent_env()
        agents = {
            name: launch(
                name,
                [
                    sys.executable,
                    "-m",
                    "warmgate_devcluster",
                    "--state-dir",
                    str(cfg.state_dir),
                    f"_{name}",
                ],
                env=env,
            )
            for name in AGENTS
        }
        insecure = cp.insecure_ssl_context()
        for record, port in ((kcm, ports.controller_manager), (scheduler, ports.scheduler)):
            cp.wait_until(
                lambda port=port: (
                    cp.http_get(f"https://127.0.0.1:{port}/healthz", insecure)[0] == 200
                ),
                f"{record.name} /healthz",
                timeout,
                alive=lambda record=record: procs.is_running(record),
            )
        for name, record in agents.items():
            cp.wait_until(
                lambda name=name: (cfg.state_dir / "ready" / name).exists(),
                f"{name} ready",
                timeout,
                alive=lambda record=record: procs.is_running(record),
            )
        cp.wait_until(
            self._node_ready,
            f"node {cfg.node_name} Ready",
            timeout,
            alive=lambda: procs.is_running(agents["node-agent"]),
        )

    # ----------------------------------------------------------------- health
    def _api_get(self, path: str):
        ports = self.ports
        if ports is None or not self.pki.exists():
            return None, "not started"
        return cp.http_get(ports.apiserver_url + path, cp.admin_ssl_context(self.pki))

    def _apiserver_ready(self) -> bool:
        return self._api_get("/readyz")[0] == 200

    def _node_ready(self) -> bool:
        status, body = self._api_get(f"/api/v1/nodes/{self.config.node_name}")
        if status != 200:
            return False
        conditions = json.loads(body).get("status", {}).get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    def status(self) -> list[ComponentHealth]:
        records = self.records()
        ports = self.ports
        insecure = cp.insecure_ssl_context()
        result = []
        for name in COMPONENTS:
            record = records.get(name)
            running = record is not None and procs.is_running(record)
            healthy, detail = False, "not running"
            if running:
                if name == "etcd":
                    code, _ = cp.http_get(f"http://127.0.0.1:{ports.etcd_client}/health")
                    healthy, detail = code == 200, f"/health {code}"
                elif name == "kube-apiserver":
                    code, _ = self._api_get("/readyz")
                    healthy, detail = code == 200, f"/readyz {code} on {ports.apiserver_url}"
                elif name in ("kube-controller-manager", "kube-scheduler"):
                    port = ports.controller_manager if name.endswith("manager") else ports.scheduler
                    code, _ = cp.http_get(f"https://127.0.0.1:{port}/healthz", insecure)
                    healthy, detail = code == 200, f"/healthz {code}"
                elif name == "node-agent":
                    healthy = self._node_ready()
                    state = "Ready" if healthy else "not Ready"
                    detail = f"node {self.config.node_name} {state}"
                else:
                    healthy = (self.state_dir / "ready" / name).exists()
                    detail = "synced" if healthy else "starting"
            result.append(
                ComponentHealth(name, record.pid if record else None, running, healthy, detail)
            )
        return result

    # ----------------------------------------------------------------- down
    def down(self, *, log=print) -> bool:
        """Stop every process of this cluster, pods included. True if anything was running."""
        with self._lock():
            return self._stop_all(log=log)

    def _stop_all(self, *, log) -> bool:
        stopped_any = False
        records = self.records()
        for name in reversed(COMPONENTS):
            record = records.get(name)
            if record is None:
                continue
            # The node agent stops its pods on SIGTERM; give it time to do so.
            grace = 20.0 if name == "node-agent" else 10.0
            if procs.stop(record, grace=grace):
                stopped_any = True
                log(f"stopped {name} (pid {record.pid})")
            child = self._children.pop(name, None)
            if child is not None:
                with contextlib.suppress(Exception):
                    child.wait(timeout=1)
        for record in self.leftover_pod_processes():
            stopped_any = True
            procs.stop(record, grace=2.0)
            log(f"stopped leftover pod process {record.name} (pid {record.pid})")
        cgroups.remove_group(cgroups.V1_CPU / cgroups.control_plane_group_name(self.state_dir))
        runtime = self.runtime()
        if runtime.get("procs"):
            runtime["procs"] = {}
            self._write_runtime(runtime)
        return stopped_any

    def leftover_pod_processes(self) -> list[procs.ProcRecord]:
        """Container processes recorded by the node agent that still run."""
        found = []
        for pid_file in self.config.pods_dir.glob("*/containers/*.pid"):
            with contextlib.suppress(ValueError, OSError, KeyError, json.JSONDecodeError):
                record = procs.ProcRecord.from_dict(json.loads(pid_file.read_text()))
                if procs.is_running(record):
                    found.append(record)
        return found

    def all_pids(self) -> list[int]:
        """Every pid this cluster recorded (control plane, agents, pod processes)."""
        pids = [r.pid for r in self.records().values()]
        for pid_file in self.config.pods_dir.glob("*/containers/*.pid"):
            with contextlib.suppress(ValueError, OSError, KeyError, json.JSONDecodeError):
                pids.append(int(json.loads(pid_file.read_text())["pid"]))
        return pids

    # ----------------------------------------------------------------- clients
    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 120.0
    ) -> subprocess.CompletedProcess:
        bin_dir = self.bin_dir or find_bin_dir()
        env = dict(os.environ, KUBECONFIG=str(self.kubeconfig))
        return subprocess.run(
            [str(bin_dir / "kubectl"), *args],
            env=env,
            input=input,
            capture_output=True,
            text=True,
            check=check,
            timeout=timeout,
        )

    def api_client(self):
        """A kubernetes.client.ApiClient for the admin user."""
        from kubernetes import client, config

        configuration = client.Configuration()
        config.load_kube_config(
            config_file=str(self.kubeconfig), client_configuration=configuration
        )
        return client.ApiClient(configuration)
