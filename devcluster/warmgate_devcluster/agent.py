"""The node agent: registers the Node, keeps its Lease and status fresh, watches the pods bound
to it and gives each one a PodWorker. Stands in for kubelet and the container runtime."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import ipaddress
import json
import logging
import os
import platform
import signal
import socket
import time
from pathlib import Path

import aiohttp

from warmgate_devcluster import procs
from warmgate_devcluster.cgroups import CpuCgroups, cluster_group_name
from warmgate_devcluster.config import ClusterConfig
from warmgate_devcluster.imagemap import ImageMap
from warmgate_devcluster.kubeapi import ApiError, KubeApi, Reflector, object_key
from warmgate_devcluster.podstatus import timestamp
from warmgate_devcluster.podworker import PodWorker, event_name

log = logging.getLogger(__name__)

LEASE_SECONDS = 40
LEASE_RENEW_SECONDS = 10
NODE_STATUS_SECONDS = 20
EVENT_REPEAT_SECONDS = 60.0
# Inherited variables a pod must not see: they belong to the host, not to the pod spec.
_PRIVATE_ENV_PREFIXES = ("WARMGATE_", "KUBECONFIG", "KUBERNETES_", "POD_", "PYTEST_")


class LoopbackIpam:
    """Pod IPs from a loopback block; a released address is reused last."""

    def __init__(self, cidr: str) -> None:
        network = ipaddress.ip_network(cidr, strict=False)
        self._free = [
            str(ip)
            for ip in network.hosts()
            if ip.packed[-1] not in (0, 255) and str(ip) != "127.0.0.1"
        ]
        self._used: set[str] = set()

    def allocate(self) -> str:
        for index, ip in enumerate(self._free):
            if ip not in self._used:
                self._free.append(self._free.pop(index))
                self._used.add(ip)
                return ip
        raise RuntimeError("no free pod IP left in the devcluster pod_cidr")

    def release(self, ip: str) -> None:
        self._used.discard(ip)


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_PRIVATE_ENV_PREFIXES)}
    return env


def _meminfo_bytes() -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


class NodeAgent:
    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.node = config.node_name
        self.image_map = ImageMap.from_config(config.image_map_file, config.model_cache)
        self.ipam = LoopbackIpam(config.pod_cidr)
        self.base_env = base_env()
        self.allocatable = {
            "cpu": config.node_cpu,
            "memory": config.node_memory,
            "pods": config.node_pods,
            "nvidia.com/gpu": config.node_gpus,
            "ephemeral-storage": "100Gi",
        }
        self.ca_cert = (config.pki_dir / "ca.crt").read_bytes()
        self.workers: dict[str, PodWorker] = {}
        self.api: KubeApi
        self.probe_session: aiohttp.ClientSession
        self._configmaps: Reflector | None = None
        self._secrets: Reflector | None = None
        self._stopping = asyncio.Event()
        self._event_tasks: set[asyncio.Task] = set()
        self._recent_events: dict[tuple[str, str, str], float] = {}
        self.cgroups: CpuCgroups | None = None

    # ------------------------------------------------------------------ lookups for workers
    def configmap(self, namespace: str, name: str) -> dict | None:
        return self._configmaps.cache.get(f"{namespace}/{name}") if self._configmaps else None

    def secret(self, namespace: str, name: str) -> dict | None:
        return self._secrets.cache.get(f"{namespace}/{name}") if self._secrets else None

    def worker_done(self, worker: PodWorker) -> None:
        if self.workers.get(worker.uid) is worker:
            del self.workers[worker.uid]

    def record_event(self, pod: dict, reason: str, message: str, kind: str = "Normal") -> None:
        if self._stopping.is_set():
            return
        meta = pod["metadata"]
        # Like kubelet's event aggregation, repeats (a probe failing every period while a
        # server warms up) are written once a minute, not every time.
        key = (meta["uid"], reason, message)
        moment = time.monotonic()
        if moment - self._recent_events.get(key, -EVENT_REPEAT_SECONDS) < EVENT_REPEAT_SECONDS:
            return
        self._recent_events[key] = moment
        if len(self._recent_events) > 10_000:
            self._recent_events.clear()
        now = dt.datetime.now(dt.UTC)
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": event_name(pod), "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta["uid"],
            },
            "reason": reason,
            "message": message[:1024],
            "type": kind,
            "source": {"component": "kubelet", "host": self.node},
            "reportingComponent": "kubelet",
            "reportingInstance": self.node,
            "firstTimestamp": timestamp(now),
            "lastTimestamp": timestamp(now),
            "count": 1,
        }

        async def send() -> None:
            with contextlib.suppress(Exception):
                await self.api.create(f"/api/v1/namespaces/{meta['namespace']}/events", body)

        task = asyncio.create_task(send())
        self._event_tasks.add(task)
        task.add_done_callback(self._event_tasks.discard)

    # ------------------------------------------------------------------ node and lease
    def _node_status(self, now: str) -> dict:
        memory = _meminfo_bytes()
        capacity = dict(self.allocatable)
        capacity.setdefault("memory", str(memory))
        conditions = [
            {
                "type": "Ready",
                "status": "True",
                "reason": "KubeletReady",
                "message": "devcluster node agent is posting ready status",
            },
            {
                "type": "MemoryPressure",
                "status": "False",
                "reason": "KubeletHasSufficientMemory",
                "message": "devcluster does not track memory pressure",
            },
            {
                "type": "DiskPressure",
                "status": "False",
                "reason": "KubeletHasNoDiskPressure",
                "message": "devcluster does not track disk pressure",
            },
            {
                "type": "PIDPressure",
                "status": "False",
                "reason": "KubeletHasSufficientPID",
                "message": "devcluster does not track pid pressure",
            },
        ]
        for condition in conditions:
            condition.update(lastHeartbeatTime=now, lastTransitionTime=self._started)
        uname = platform.uname()
        return {
            "status": {
                "capacity": capacity,
                "allocatable": dict(self.allocatable),
                "conditions": conditions,
                "addresses": [
                    {"type": "InternalIP", "address": "127.0.0.1"},
                    {"type": "Hostname", "address": self.node},
                ],
                "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
                "nodeInfo": {
                    "machineID": socket.gethostname(),
                    "systemUUID": self.node,
                    "bootID": self._boot,
                    "kernelVersion": uname.release,
                    "osImage": f"devcluster on {uname.system}",
                    "containerRuntimeVersion": "devcluster://0.1.0",
                    "kubeletVersion": self._version,
                    "kubeProxyVersion": "",
                    "operatingSystem": "linux",
                    "architecture": "amd64",
                },
            }
        }

    async def register(self) -> None:
        self._started = timestamp(dt.datetime.now(dt.UTC))
        self._boot = os.urandom(8).hex()
        try:
            self._version = (await self.api.get("/version"))["gitVersion"]
        except Exception:
            self._version = "v0.0.0-devcluster"
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.node,
                "labels": {
                    "kubernetes.io/hostname": self.node,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "node.kubernetes.io/instance-type": "devcluster",
                },
            },
            "spec": {"podCIDR": self.config.pod_cidr, "podCIDRs": [self.config.pod_cidr]},
        }
        try:
            node = await self.api.create("/api/v1/nodes", body)
        except ApiError as exc:
            if exc.status != 409:
                raise
            node = await self.api.get(f"/api/v1/nodes/{self.node}")
        self._node_uid = node["metadata"]["uid"]
        await self._post_node_status()
        while True:
            try:
                await self._renew_lease()
                return
            except ApiError as exc:  # kube-node-lease may not exist yet right after start
                log.info("lease not written yet: %s", exc)
                await asyncio.sleep(0.5)

    async def _post_node_status(self) -> None:
        now = timestamp(dt.datetime.now(dt.UTC))
        await self.api.patch(f"/api/v1/nodes/{self.node}/status", self._node_status(now))

    async def _renew_lease(self) -> None:
        now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{self.node}"
        try:
            await self.api.patch(
                path, {"spec": {"renewTime": now, "holderIdentity": self.node}}, "merge"
            )
        except ApiError as exc:
            if exc.status != 404:
                raise
            await self.api.create(
                "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases",
                {
                    "apiVersion": "coordination.k8s.io/v1",
                    "kind": "Lease",
                    "metadata": {
                        "name": self.node,
                        "namespace": "kube-node-lease",
                        "ownerReferences": [
                            {
                                "apiVersion": "v1",
                                "kind": "Node",
                                "name": self.node,
                                "uid": self._node_uid,
                            }
                        ],
                    },
                    "spec": {
                        "holderIdentity": self.node,
                        "leaseDurationSeconds": LEASE_SECONDS,
                        "renewTime": now,
                    },
                },
            )

    async def _heartbeats(self) -> None:
        ticks = 0
        while True:
            await asyncio.sleep(LEASE_RENEW_SECONDS)
            ticks += LEASE_RENEW_SECONDS
            try:
                await self._renew_lease()
                if ticks >= NODE_STATUS_SECONDS:
                    ticks = 0
                    await self._post_node_status()
            except Exception as exc:
                log.warning("heartbeat failed: %s", exc)

    # ------------------------------------------------------------------ watches
    async def _on_pod(self, event: str, pod: dict) -> None:
        uid = pod["metadata"]["uid"]
        worker = self.workers.get(uid)
        if event == "DELETED":
            if worker is not None:
                worker.removed()
            return
        if worker is not None:
            worker.update(pod)
            return
        if self._stopping.is_set():
            return
        if pod.get("status", {}).get("phase") in ("Succeeded", "Failed") and not pod[
            "metadata"
        ].get("deletionTimestamp"):
            return  # finished before this agent started; nothing to run
        worker = PodWorker(self, pod)
        self.workers[uid] = worker
        worker.start()

    def _on_config(self, kind: str):
        def handler(event: str, obj: dict) -> None:
            namespace, _, name = object_key(obj).partition("/")
            reference = (kind, namespace, name)
            for worker in list(self.workers.values()):
                if reference in worker.references() or worker.mounts is None:
                    worker.refresh_volumes()

        return handler

    def _cleanup_orphans(self) -> None:
        """Processes a previous agent of this state folder left behind."""
        for pid_file in self.config.pods_dir.glob("*/containers/*.pid"):
            with contextlib.suppress(ValueError, OSError, KeyError, json.JSONDecodeError):
                record = procs.ProcRecord.from_dict(json.loads(pid_file.read_text()))
                if procs.stop(record, grace=2.0):
                    log.info("stopped orphan pod process %s (pid %s)", record.name, record.pid)

    # ------------------------------------------------------------------ main
    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopping.set)
        self._cleanup_orphans()
        self.cgroups = CpuCgroups.create(
            cluster_group_name(self.config.state_dir), len(os.sched_getaffinity(0))
        )
        if self.cgroups is not None:
            log.info("pods get kubelet-style CPU cgroups under %s", self.cgroups.root)
        # Probes open a fresh connection each time, like kubelet's (no keep-alive).
        connector = aiohttp.TCPConnector(force_close=True)
        async with (
            KubeApi.for_cluster(self.config) as api,
            aiohttp.ClientSession(connector=connector) as probes,
        ):
            self.api = api
            self.probe_session = probes
            await self.register()
            self._configmaps = Reflector(
                api, "/api/v1/configmaps", self._on_config("configmap"), name="configmaps"
            )
            self._secrets = Reflector(
                api, "/api/v1/secrets", self._on_config("secret"), name="secrets"
            )
            pods = Reflector(
                api,
                "/api/v1/pods",
                self._on_pod,
                name="pods",
                params={"fieldSelector": f"spec.nodeName={self.node}"},
            )
            tasks = [
                asyncio.create_task(self._configmaps.run()),
                asyncio.create_task(self._secrets.run()),
            ]
            await self._configmaps.synced.wait()
            await self._secrets.synced.wait()
            tasks.append(asyncio.create_task(pods.run()))
            await pods.synced.wait()
            tasks.append(asyncio.create_task(self._heartbeats()))
            mark_ready(self.config, "node-agent")
            log.info("node %s ready; pod IPs from %s", self.node, self.config.pod_cidr)
            stop = asyncio.create_task(self._stopping.wait())
            done, _ = await asyncio.wait([stop, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stop and task.exception():
                    log.error("node agent task failed: %r", task.exception())
            await self.shutdown(tasks)

    async def shutdown(self, tasks: list[asyncio.Task]) -> None:
        """Stop every pod process (the cluster is going away), then the watches."""
        self._stopping.set()
        for task in tasks:
            task.cancel()
        workers = list(self.workers.values())
        await asyncio.gather(*(w.kill_all(3.0) for w in workers), return_exceptions=True)
        for worker in workers:
            if worker.task is not None:
                worker.task.cancel()
        await asyncio.gather(*(w.task for w in workers if w.task), return_exceptions=True)
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.cgroups is not None:
            self.cgroups.close()


def mark_ready(config: ClusterConfig, name: str) -> None:
    folder = config.state_dir / "ready"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(str(os.getpid()))


def main(state_dir: Path) -> None:
    config = ClusterConfig.load(state_dir)
    asyncio.run(NodeAgent(config).run())
