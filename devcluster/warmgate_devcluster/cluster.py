"""Bringing a devcluster up and down: the control plane and a real node (containerd, kubelet,
kube-proxy in a network namespace of their own), recorded by pid in the state folder, plus
metrics-server as a pod behind the aggregation layer."""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml
from kubernetes.client import ApiClient
from kubernetes.config import ConfigException

from warmgate_devcluster import cgroups, images, kubeapi, models, preflight, procs
from warmgate_devcluster import controlplane as cp
from warmgate_devcluster import node as nodecfg
from warmgate_devcluster.binaries import find_bin_dir, find_node_bin_dir
from warmgate_devcluster.config import PACKAGE_DIR, ClusterConfig
from warmgate_devcluster.pki import (
    ADMIN,
    APISERVER_KUBELET_CLIENT,
    KUBE_PROXY,
    Pki,
    create_pki,
    kubelet_identity,
)

# Start order; `down` stops them in reverse.
CONTROL_PLANE = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
NODE = ("containerd", "kubelet", "kube-proxy")
# Beside the cluster, as a company's own services would be: a model hub (the Hugging Face hub's
# file protocol, `hubmirror`) that pods download models from.
SERVICES = ("model-hub",)
COMPONENTS = CONTROL_PLANE + NODE + SERVICES
# Files and folders `up` owns inside the state folder (wiped before a fresh start).
RUN_ROOT = Path("/run")
RUN_MARKER = "cluster.json"
_OWNED = ("pki", "etcd", "logs", "node", "certs", "kubeconfig", "runtime.json", "cluster.json")
MAX_PODS = 110


@dataclass(frozen=True)
class ComponentHealth:
    name: str
    pid: int | None
    running: bool
    healthy: bool
    detail: str


class DevCluster:
    """One local cluster, described by its configuration and its state folder."""

    def __init__(self, config: ClusterConfig | None = None) -> None:
        self.config = config or ClusterConfig.from_env()
        self.pki = Pki(self.config.pki_dir)
        self.network = self.config.network
        self.paths = nodecfg.NodePaths(
            self.config.state_dir, self.config.run_dir, self.config.containerd_dir
        )
        self._children: dict[str, subprocess.Popen] = {}
        # The client of this cluster's own checks, with the kubeconfig text it was made from
        # (each `up` writes a new one: new ports, new certificates).
        self._checks_client: tuple[str, ApiClient] | None = None

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
    def node_bin_dir(self) -> Path | None:
        value = self.runtime().get("node_bin_dir")
        return Path(value) if value else None

    @property
    def ports(self) -> cp.Ports | None:
        value = self.runtime().get("ports")
        return cp.Ports(**value) if value else None

    @property
    def node_ip(self) -> str:
        """The node's InternalIP: NodePorts answer here."""
        return self.network.node_ip

    @contextlib.contextmanager
    def _try_lock(self) -> Iterator[bool]:
        """The state folder's lock if nobody holds it; True when there is no folder to lock."""
        if not self.state_dir.is_dir():
            yield True
            return
        with open(self.state_dir / ".lock", "w") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            try:
                yield True
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

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
        return self._apiserver_ready() and self._node_ready()

    def up(self, *, log: Callable[[str], None] = print) -> bool:
        """Start everything; False (and nothing touched) when it is already up and healthy."""
        with self._lock():
            if self.is_up():
                log(f"devcluster already running (state {self.state_dir})")
                return False
            preflight.check()
            reap_abandoned(log=log)
            self._stop_all(log=lambda *_: None)
            started = time.monotonic()
            bin_dir = find_bin_dir()
            node_bin = find_node_bin_dir()
            self._wipe()
            try:
                self._start(bin_dir, node_bin, log)
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
        shutil.rmtree(self.paths.run_dir, ignore_errors=True)

    def _start(self, bin_dir: Path, node_bin: Path, log: Callable[[str], None]) -> None:
        cfg, network, paths = self.config, self.network, self.paths
        cfg.state_dir.mkdir(parents=True, exist_ok=True)
        cfg.logs_dir.mkdir(parents=True, exist_ok=True)
        cfg.config_file.write_text(cfg.to_json())
        # The run folder names the cluster it belongs to, so that a later `up` can find and
        # tear down what this one leaves if its processes are ever killed without `down`.
        paths.run_dir.mkdir(parents=True, exist_ok=True)
        (paths.run_dir / RUN_MARKER).write_text(cfg.to_json())
        network.create()
        kubelet_user = kubelet_identity(cfg.node_name)
        pki = create_pki(
            cfg.pki_dir,
            serving_ips=[network.host_ip, network.kubernetes_service_ip],
            clients=[ADMIN, KUBE_PROXY, kubelet_user, APISERVER_KUBELET_CLIENT],
        )
        ports = cp.Ports(*procs.free_ports(5), apiserver_host=network.host_ip)
        runtime = {
            "bin_dir": str(bin_dir),
            "node_bin_dir": str(node_bin),
            "ports": ports.__dict__,
            "procs": {},
        }
        self._write_runtime(runtime)

        control_plane_group = None
        if cfg.control_plane_cpu_shares:
            control_plane_group = cgroups.control_plane_group(
                cfg.control_plane_group, cfg.control_plane_cpu_shares
            )
        node_group = cgroups.control_plane_group(cfg.node_group, 1024)
        cgroups.create_root(cfg.cluster_name)

        def launch(name: str, argv: list[str], env: dict[str, str] | None = None):
            group = control_plane_group if name not in NODE else node_group
            if group is not None:
                argv = cgroups.launch_in(group, argv)
            record, child = procs.spawn(
                name, argv, cfg.logs_dir / f"{name}.log", env=env, cwd=cfg.state_dir
            )
            self._children[name] = child
            runtime["procs"][name] = record.to_dict()
            self._write_runtime(runtime)
            return record

        def wait(check: Callable[[], bool], what: str, record: procs.ProcRecord) -> None:
            cp.wait_until(check, what, cfg.start_timeout, alive=lambda: procs.is_running(record))

        etcd = launch("etcd", cp.etcd_argv(bin_dir, cfg.state_dir / "etcd", ports))
        wait(
            lambda: cp.http_get(f"http://127.0.0.1:{ports.etcd_client}/health")[0] == 200,
            "etcd",
            etcd,
        )
        certs = cfg.state_dir / "certs"
        self._audit_policy.write_text(cp.AUDIT_POLICY)
        apiserver = launch("kube-apiserver", self._apiserver_argv(bin_dir, ports))
        server = ports.apiserver_url
        cfg.kubeconfig.write_text(cp.kubeconfig_yaml(server, pki))
        cfg.kubeconfig.chmod(0o600)
        wait(self._apiserver_ready, "kube-apiserver /readyz", apiserver)
        kcm = launch(
            "kube-controller-manager",
            cp.controller_manager_argv(
                bin_dir, pki, cfg.kubeconfig, certs / "kcm", ports, cfg.service_cidr
            ),
        )
        scheduler = launch(
            "kube-scheduler", cp.scheduler_argv(bin_dir, cfg.kubeconfig, certs / "sched", ports)
        )
        hub = self._start_hub(launch, runtime)

        # The node: containerd first (images go in before kubelet looks for its sandbox image).
        for folder in (
            paths.cni_conf_dir,
            paths.cni_state_dir,
            paths.kubelet_root,
            paths.pod_logs,
            paths.run_dir,
            paths.containerd_root,
        ):
            folder.mkdir(parents=True, exist_ok=True)
        paths.containerd_config.write_text(
            nodecfg.containerd_toml(paths, node_bin, images.PAUSE.name)
        )
        (paths.cni_conf_dir / f"10-{nodecfg.CNI_NETWORK}.conflist").write_text(
            nodecfg.cni_conflist(network, paths)
        )
        node_env = dict(os.environ, PATH=f"{node_bin}:{os.environ.get('PATH', '')}")
        containerd = launch(
            "containerd", nodecfg.containerd_argv(node_bin, network, paths), env=node_env
        )
        wait(self._containerd_ready, "containerd", containerd)
        self._forget_old_containers()
        wanted = images.SYSTEM_IMAGES + (images.APP_IMAGES if cfg.app_images else ())
        took = images.import_images(
            paths.containerd_socket, wanted, cfg.logs_dir / "images.log", say=log
        )
        for name, seconds in took.items():
            log(f"imported {name} into the node in {seconds:.0f}s")

        paths.kubelet_kubeconfig.write_text(cp.kubeconfig_yaml(server, pki, kubelet_user))
        paths.kube_proxy_kubeconfig.write_text(cp.kubeconfig_yaml(server, pki, KUBE_PROXY))
        paths.kubelet_config.write_text(
            nodecfg.kubelet_yaml(network, paths, pki, f"/{cfg.cluster_name}", MAX_PODS)
        )
        paths.kube_proxy_config.write_text(nodecfg.kube_proxy_yaml(network, paths, cfg.node_name))
        kubelet = launch(
            "kubelet",
            nodecfg.kubelet_argv(bin_dir / "kubelet", network, paths, cfg.node_name),
            env=node_env,
        )
        kube_proxy = launch(
            "kube-proxy",
            nodecfg.kube_proxy_argv(bin_dir / "kube-proxy", network, paths),
            env=node_env,
        )
        insecure = cp.insecure_ssl_context()
        for record, port in ((kcm, ports.controller_manager), (scheduler, ports.scheduler)):
            wait(
                lambda port=port: (
                    cp.http_get(f"https://127.0.0.1:{port}/healthz", insecure)[0] == 200
                ),
                f"{record.name} /healthz",
                record,
            )
        wait(self._kube_proxy_healthy, "kube-proxy /healthz", kube_proxy)
        wait(self._node_ready, f"node {cfg.node_name} Ready", kubelet)
        wait(self._hub_ready, "model hub", hub)
        self._install_addons()
        # Pods look names up from their first instruction (kopf connects to
        # kubernetes.default.svc): the cluster DNS answers before `up` returns.
        wait(
            lambda: self._rolled_out("kube-system", "coredns"),
            "deployment/coredns rolled out",
            kubelet,
        )

    @property
    def _audit_policy(self) -> Path:
        return self.config.state_dir / "audit-policy.yaml"

    def _apiserver_argv(self, bin_dir: Path, ports: cp.Ports) -> list[str]:
        cfg = self.config
        return cp.apiserver_argv(
            bin_dir,
            self.pki,
            cfg.state_dir / "certs" / "apiserver",
            ports,
            cfg.service_cidr,
            cfg.node_port_range,
            self._audit_policy,
            cfg.audit_log,
        )

    def restart_apiserver(self, *, compact_etcd: bool = True) -> None:
        """Stop kube-apiserver and start it again with the same flags. Every watch breaks,
        and the new server's watch cache begins at etcd's current revision, which a write made
        while no apiserver ran keeps newer than any version a client holds (with
        `compact_etcd`, etcd forgets every older one too): a client that watches again from
        a version it had before gets a 410 and must list again. For the tests of relists."""
        with self._lock():
            runtime, cfg = self.runtime(), self.config
            bin_dir, ports = self.bin_dir, self.ports
            assert bin_dir is not None and ports is not None, "the cluster is not up"
            procs.stop(self.records()["kube-apiserver"], grace=10.0)
            child = self._children.pop("kube-apiserver", None)
            if child is not None:
                with contextlib.suppress(Exception):
                    child.wait(timeout=1)
            # One write while no apiserver runs: etcd's revision is then newer than any version a
            # client can hold (a client whose last event was etcd's last write would otherwise
            # watch on from it without a 410, as the new cache begins at that very revision).
            # Outside /registry, so the apiserver never reads it.
            etcd = f"http://127.0.0.1:{ports.etcd_client}/v3/kv"
            key, value = b"/warmgate-devcluster/apiserver-restarted", b"1"
            put = _etcd_post(
                f"{etcd}/put",
                {"key": base64.b64encode(key).decode(), "value": base64.b64encode(value).decode()},
            )
            if compact_etcd:
                revision = put["header"]["revision"]
                _etcd_post(f"{etcd}/compaction", {"revision": revision, "physical": True})
            argv = self._apiserver_argv(bin_dir, ports)
            group = cgroups.V1_CPU / cfg.control_plane_group
            if cfg.control_plane_cpu_shares and group.is_dir():
                argv = cgroups.launch_in(group, argv)
            record, child = procs.spawn(
                "kube-apiserver", argv, cfg.logs_dir / "kube-apiserver.log", cwd=cfg.state_dir
            )
            self._children["kube-apiserver"] = child
            runtime["procs"]["kube-apiserver"] = record.to_dict()
            self._write_runtime(runtime)
            cp.wait_until(
                self._apiserver_ready,
                "kube-apiserver /readyz after its restart",
                cfg.start_timeout,
                alive=lambda: procs.is_running(record),
            )

    def _start_hub(self, launch, runtime: dict) -> procs.ProcRecord:
        """The model hub on this machine's end of the node link (pods reach it there), seeded
        with the test model's revisions."""
        (port,) = procs.free_ports(1)
        runtime["hub_endpoint"] = f"http://{self.network.host_ip}:{port}"
        runtime["hub_revisions"] = models.seed_hub()
        self._write_runtime(runtime)
        argv = [sys.executable, "-m", "warmgate_devcluster.hubmirror", "--root"]
        argv += [str(models.hub_root()), "--host", self.network.host_ip, "--port", str(port)]
        return launch("model-hub", argv)

    @property
    def hub_endpoint(self) -> str | None:
        """The devcluster's model hub (HF_ENDPOINT for its pods)."""
        return self.runtime().get("hub_endpoint")

    @property
    def hub_revisions(self) -> dict[str, str]:
        """{revision: commit} of the test model on the hub."""
        return dict(self.runtime().get("hub_revisions") or {})

    def _hub_ready(self) -> bool:
        endpoint = self.hub_endpoint
        if not endpoint:
            return False
        url = f"{endpoint}/api/models/{models.MINILM_ID}/revision/main"
        return cp.http_get(url)[0] == 200

    def _containerd_ready(self) -> bool:
        if not self.paths.containerd_socket.exists():
            return False
        result = subprocess.run(
            images.ctr_argv(self.paths.containerd_socket, "version"),
            capture_output=True,
            timeout=10,
        )
        return result.returncode == 0

    def _forget_old_containers(self) -> None:
        """containerd's root is kept between runs for its images; the containers and sandboxes
        of an earlier run (their processes are gone) are removed before kubelet starts."""
        socket = self.paths.containerd_socket
        listed = subprocess.run(
            images.ctr_argv(socket, "containers", "ls", "-q"), capture_output=True, text=True
        )
        for container in listed.stdout.split():
            subprocess.run(
                images.ctr_argv(socket, "containers", "rm", container), capture_output=True
            )

    def _install_addons(self) -> None:
        """The add-ons every cluster has: DNS (CoreDNS) and the resource metrics API
        (metrics-server), from the manifests beside this module."""
        addons = {
            "coredns.yaml": {
                "{image}": images.COREDNS.name,
                "{dns_ip}": self.network.dns_service_ip,
            },
            "metrics-server.yaml": {"{image}": images.METRICS_SERVER.name},
        }
        for file, values in addons.items():
            manifest = (PACKAGE_DIR / file).read_text()
            for token, value in values.items():
                manifest = manifest.replace(token, value)
            self.kubectl("apply", "-f", "-", input=manifest)

    # ----------------------------------------------------------------- health
    def _checks_api(self) -> ApiClient | None:
        """The admin client for this cluster's own checks (None before a kubeconfig exists):
        no retries, so a poll while the apiserver starts fails at once and quietly."""
        try:
            text = self.kubeconfig.read_text()
        except FileNotFoundError:
            return None
        if self._checks_client is None or self._checks_client[0] != text:
            self._close_checks_api()
            try:
                api = kubeapi.load_client(self.kubeconfig, retries=False)
            except (ConfigException, yaml.YAMLError):
                return None  # read while `up` was writing it: the next poll reads it whole
            self._checks_client = (text, api)
        return self._checks_client[1]

    def _close_checks_api(self) -> None:
        if self._checks_client is not None:
            self._checks_client[1].close()
            self._checks_client = None

    def _api_status(self, path: str) -> int | None:
        """The status of a GET of `path` (None when nothing answered)."""
        api = self._checks_api()
        if api is None:
            return None
        try:
            return kubeapi.request(api, "GET", path, timeout=3.0)[0]
        except kubeapi.UNANSWERED:
            return None

    def _api_read(self, path: str) -> dict | None:
        """The object at `path`, None when it is missing or nothing answered."""
        api = self._checks_api()
        if api is None:
            return None
        try:
            return kubeapi.read(api, path, timeout=3.0)
        except (kubeapi.ApiError, *kubeapi.UNANSWERED):
            return None

    def _rolled_out(self, namespace: str, name: str) -> bool:
        """A Deployment's rollout is complete, by `kubectl rollout status`'s rules."""
        path = kubeapi.resource_path("apps/v1", "deployments", namespace, name)
        deployment = self._api_read(path)
        if deployment is None:
            return False
        wanted = deployment["spec"].get("replicas", 1)
        status = deployment.get("status") or {}
        updated = status.get("updatedReplicas", 0)
        return (
            status.get("observedGeneration", 0) >= deployment["metadata"]["generation"]
            and updated >= wanted
            and status.get("replicas", 0) <= updated
            and status.get("availableReplicas", 0) >= updated
        )

    def _apiserver_ready(self) -> bool:
        return self._api_status("/readyz") == 200

    def _kube_proxy_healthy(self) -> bool:
        return cp.http_get(f"http://{self.network.node_ip}:10256/healthz")[0] == 200

    def _node_ready(self) -> bool:
        node = self._api_read(kubeapi.resource_path("v1", "nodes", name=self.config.node_name))
        return kubeapi.condition(node, "Ready").get("status") == "True"

    def metrics_available(self) -> bool:
        """metrics-server answers through the aggregation layer (`kubectl top` works)."""
        return self._api_status("/apis/metrics.k8s.io/v1beta1/nodes") == 200

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
                    code = self._api_status("/readyz")
                    healthy, detail = code == 200, f"/readyz {code} on {ports.apiserver_url}"
                elif name in ("kube-controller-manager", "kube-scheduler"):
                    port = ports.controller_manager if name.endswith("manager") else ports.scheduler
                    code, _ = cp.http_get(f"https://127.0.0.1:{port}/healthz", insecure)
                    healthy, detail = code == 200, f"/healthz {code}"
                elif name == "containerd":
                    healthy = self._containerd_ready()
                    detail = str(self.paths.containerd_socket)
                elif name == "kube-proxy":
                    healthy = self._kube_proxy_healthy()
                    detail = f"/healthz on {self.network.node_ip}:10256"
                elif name == "model-hub":
                    healthy = self._hub_ready()
                    detail = f"{self.hub_endpoint} ({models.MINILM_ID})"
                else:
                    healthy = self._node_ready()
                    state = "Ready" if healthy else "not Ready"
                    detail = f"node {self.config.node_name} ({self.network.node_ip}) {state}"
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
        cfg = self.config

        def stop(name: str, grace: float) -> None:
            nonlocal stopped_any
            record = records.get(name)
            if record is None:
                return
            if procs.stop(record, grace=grace):
                stopped_any = True
                log(f"stopped {name} (pid {record.pid})")
            child = self._children.pop(name, None)
            if child is not None:
                with contextlib.suppress(Exception):
                    child.wait(timeout=1)

        # The node first, so kubelet restarts nothing while its containers are stopped.
        for name in reversed(NODE):
            stop(name, 10.0)
        # Containers and shims, by pid, from the cgroups they run in.
        killed = cgroups.kill_tree(cfg.cluster_name) + cgroups.kill_tree(cfg.node_group)
        if killed:
            stopped_any = True
            log(f"stopped {killed} container and shim processes")
        unmounted = unmount_under(self.state_dir, self.paths.run_dir, self.paths.containerd_root)
        if unmounted:
            log(f"unmounted {unmounted} pod and container mounts")
        self.network.remove()
        for name in reversed(CONTROL_PLANE + SERVICES):
            stop(name, 10.0)
        for group in (cfg.cluster_name, cfg.node_group, cfg.control_plane_group):
            cgroups.remove_tree(group)
        shutil.rmtree(self.paths.run_dir, ignore_errors=True)
        self._close_checks_api()
        runtime = self.runtime()
        if runtime.get("procs"):
            runtime["procs"] = {}
            self._write_runtime(runtime)
        return stopped_any

    def all_pids(self) -> list[int]:
        """Every pid this cluster runs: its components, containers and shims."""
        pids = {r.pid for r in self.records().values() if procs.is_running(r)}
        pids |= cgroups.pids_in_tree(self.config.cluster_name)
        pids |= cgroups.pids_in_tree(self.config.node_group)
        return sorted(pids)

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

    def api_client(self) -> ApiClient:
        """A client for the admin user, at the library's defaults; the caller closes it."""
        return kubeapi.load_client(self.kubeconfig)


def reap_abandoned(*, log: Callable[[str], None] = print) -> list[Path]:
    """Tear down every cluster on this machine whose processes are all gone but whose network
    namespace, mounts, cgroups or run folder remain: a test session or `make up` killed
    without `down`, or a machine restarted under them. Left there, they hold the addresses the
    next cluster wants. A cluster busy starting or stopping (its state lock held) or with any
    process running is left alone. Returns the state folders of the clusters torn down."""
    reaped = []
    for run_dir in sorted(RUN_ROOT.glob("warmgate-devcluster-*")):
        try:
            config = ClusterConfig.from_dict(json.loads((run_dir / RUN_MARKER).read_text()))
        except (OSError, ValueError, TypeError):
            continue
        if config.run_dir != run_dir:
            continue
        cluster = DevCluster(config)
        with cluster._try_lock() as held:
            if not held or cluster.all_pids():
                continue
            cluster._stop_all(log=lambda *_: None)
        log(f"removed the remains of an abandoned devcluster (state {config.state_dir})")
        reaped.append(config.state_dir)
    return reaped


def mounts_under(*folders: Path) -> list[str]:
    """Mount points at or below any of `folders`, deepest first."""
    roots = [str(folder.resolve()) for folder in folders]
    found = []
    with open("/proc/self/mountinfo") as handle:
        for line in handle:
            point = line.split()[4].replace("\\040", " ")
            if any(point == root or point.startswith(root + "/") for root in roots):
                found.append(point)
    return sorted(set(found), key=lambda p: p.count("/"), reverse=True)


def unmount_under(*folders: Path) -> int:
    """Lazily unmount what kubelet, containerd and its shims mounted below `folders` (volumes,
    container root filesystems, network namespace files)."""
    count = 0
    for point in mounts_under(*folders):
        result = subprocess.run(["umount", "-l", point], capture_output=True)
        count += result.returncode == 0
    return count


def _etcd_post(url: str, body: dict) -> dict:
    """One call to etcd's JSON gateway (its v3 API over HTTP), on this machine."""
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())
