"""One pod on the devcluster node, from binding to removal, like kubelet's pod worker:
pod IP, volumes, init containers, containers, status reports, termination and deletion."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from warmgate_devcluster import podspec, volumes
from warmgate_devcluster.kubeapi import ApiError
from warmgate_devcluster.podstatus import (
    PodView,
    status_patch,
    timestamp,
    transition_memory,
)
from warmgate_devcluster.runtime import ContainerRunner, LaunchSpec, PrepareError

if TYPE_CHECKING:
    from warmgate_devcluster.agent import NodeAgent

log = logging.getLogger(__name__)


def grace_period(pod: dict) -> float:
    meta_grace = pod["metadata"].get("deletionGracePeriodSeconds")
    if meta_grace is not None:
        return float(meta_grace)
    return float(pod["spec"].get("terminationGracePeriodSeconds", 30))


class PodWorker:
    def __init__(self, agent: NodeAgent, pod: dict) -> None:
        self.agent = agent
        self.pod = pod
        meta = pod["metadata"]
        self.uid = meta["uid"]
        self.namespace = meta["namespace"]
        self.name = meta["name"]
        self.path = f"/api/v1/namespaces/{self.namespace}/pods/{self.name}"
        self.pod_dir = agent.config.pods_dir / self.uid
        self.logs_dir = (
            agent.config.logs_dir / "pods" / f"{self.namespace}_{self.name}_{self.uid[:8]}"
        )
        self.pod_ip = ""
        self.start_time = timestamp(dt.datetime.now(dt.UTC))
        self.network_ready = False
        self.initialized = not pod["spec"].get("initContainers")
        self.init_failed = False
        self.mounts: volumes.Materialised | None = None
        self.init_runners = [
            ContainerRunner(self, c, init=True) for c in pod["spec"].get("initContainers") or []
        ]
        self.runners = [ContainerRunner(self, c) for c in pod["spec"]["containers"]]
        self.restart_backoff = (agent.config.restart_backoff_base, agent.config.restart_backoff_max)
        self.probe_session = agent.probe_session
        self._dirty = asyncio.Event()
        self._refresh = asyncio.Event()
        self._terminate = asyncio.Event()
        self._gone = False  # the pod object no longer exists
        self._patch_lock = asyncio.Lock()
        self._last_patch: dict | None = None
        self._transitions = transition_memory(pod)
        self._token: str | None = None
        self.task: asyncio.Task | None = None
        self.cgroup: Path | None = None
        """The pod's CPU cgroup (kubelet-style shares and quota), when the agent makes them."""
        if pod["metadata"].get("deletionTimestamp"):
            self._terminate.set()

    # ------------------------------------------------------------------ events from the agent
    def update(self, pod: dict) -> None:
        """A newer version of the pod (readiness-gate conditions, deletion, labels)."""
        before = self.pod["metadata"]
        after = pod["metadata"]
        if (before.get("labels"), before.get("annotations")) != (
            after.get("labels"),
            after.get("annotations"),
        ):
            self._refresh.set()  # downwardAPI volume files follow labels and annotations
        self.pod = pod
        if pod["metadata"].get("deletionTimestamp"):
            self._terminate.set()
        self.notify()

    def removed(self) -> None:
        """The pod object is gone (force deletion): stop everything now."""
        self._gone = True
        self._terminate.set()

    def refresh_volumes(self) -> None:
        self._refresh.set()

    def references(self) -> set[tuple[str, str, str]]:
        return self.mounts.references if self.mounts else set()

    # ------------------------------------------------------------------ PodHost for runners
    def notify(self) -> None:
        self._dirty.set()

    def log_path(self, container: str) -> Path:
        return self.logs_dir / f"{container}.log"

    def pid_path(self, container: str) -> Path:
        return self.pod_dir / "containers" / f"{container}.pid"

    def event(self, reason: str, message: str, kind: str = "Normal") -> None:
        self.agent.record_event(self.pod, reason, message, kind)

    def prepare(self, container: dict) -> LaunchSpec:
        entry = self.agent.image_map.resolve(container.get("image", ""))
        if entry is None and not container.get("command"):
            raise PrepareError(
                "ErrImagePull",
                f"image {container.get('image')!r} is not in the devcluster image map and the "
                "container has no command (see docs/devcluster.md, image map)",
            )
        entry = entry or {}
        meta = self.pod["metadata"]
        base = dict(self.agent.base_env)
        base.update(entry.get("env", {}))
        base.update(
            POD_IP=self.pod_ip,
            POD_NAME=meta["name"],
            POD_NAMESPACE=meta["namespace"],
            HOSTNAME=meta["name"],
        )
        table = podspec.mount_table(container, self.mounts.paths if self.mounts else {})
        try:
            env = podspec.container_env(
                self.pod,
                container,
                pod_ip=self.pod_ip,
                host_ip="127.0.0.1",
                base=base,
                configmaps=self.agent.configmap,
                secrets=self.agent.secret,
                node_allocatable=self.agent.allocatable,
                mounts=table,
            )
        except podspec.MissingReference as exc:
            raise PrepareError("CreateContainerConfigError", str(exc)) from exc
        except ValueError as exc:
            raise PrepareError("CreateContainerConfigError", str(exc)) from exc
        argv = podspec.container_argv(container, entry, env, table)
        if not argv:
            raise PrepareError("CreateContainerError", "no command to run")
        cwd = str(self.pod_dir)
        if container.get("workingDir"):
            working = podspec.rewrite(container["workingDir"], table)
            if os.path.isdir(working):
                cwd = working
        return LaunchSpec(argv=argv, env=env, cwd=cwd)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self.task = asyncio.create_task(self.run(), name=f"pod {self.namespace}/{self.name}")

    async def run(self) -> None:
        status_task = asyncio.create_task(self._status_loop())
        try:
            await self._run()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("pod %s/%s: worker failed", self.namespace, self.name)
        finally:
            status_task.cancel()
            with contextlib.suppress(BaseException):
                await status_task
            await self.kill_all(2.0)
            if self.cgroup is not None:  # made by agent.cgroups
                self.agent.cgroups.remove(self.uid)
            self.agent.ipam.release(self.pod_ip)
            shutil.rmtree(self.pod_dir, ignore_errors=True)
            self.agent.worker_done(self)

    async def _run(self) -> None:
        if self._terminate.is_set() and not self._started_anything():
            await self._finish()
            return
        # hostNetwork pods share the node's address, as with kubelet.
        host_network = self.pod["spec"].get("hostNetwork", False)
        self.pod_ip = "127.0.0.1" if host_network else self.agent.ipam.allocate()
        (self.pod_dir / "containers").mkdir(parents=True, exist_ok=True)
        if self.agent.cgroups is not None:
            self.cgroup = self.agent.cgroups.pod(self.uid, self.pod)
        self.notify()
        await self._fetch_token()
        while not self._terminate.is_set():
            try:
                self._materialise()
                break
            except podspec.MissingReference as exc:
                for runner in self.runners:
                    runner.view.state = {
                        "waiting": {"reason": "ContainerCreating", "message": str(exc)}
                    }
                self.event("FailedMount", f"MountVolume.SetUp failed: {exc}", "Warning")
                self.notify()
                await self._wait_any(self._refresh, self._terminate, seconds=5.0)
                self._refresh.clear()
        self.network_ready = True
        self.notify()

        sidecar_tasks = []
        for runner in self.init_runners:
            if self._terminate.is_set():
                break
            task = asyncio.create_task(runner.run())
            if runner.sidecar:
                # Started, not completed, lets the next one go (kubelet: once `started`).
                sidecar_tasks.append(task)
                waits = [
                    asyncio.create_task(runner.started_event.wait()),
                    asyncio.create_task(self._terminate.wait()),
                ]
                await asyncio.wait([*waits, task], return_when=asyncio.FIRST_COMPLETED)
                for waiter in waits:
                    waiter.cancel()
                continue
            await self._wait_task_or_terminate(task, runner)
            if runner.view.exit_code != 0 or not runner.view.final:
                self.init_failed = runner.view.final and runner.view.exit_code not in (None, 0)
                break
        else:
            self.initialized = True
        self.notify()

        tasks = list(sidecar_tasks)
        if self.initialized and not self._terminate.is_set():
            tasks += [asyncio.create_task(r.run()) for r in self.runners]
        refresher = asyncio.create_task(self._refresh_loop())
        try:
            all_done = asyncio.gather(*tasks) if tasks else None
            while not self._terminate.is_set():
                waits = [asyncio.create_task(self._terminate.wait())]
                if all_done is not None and not all_done.done():
                    waits.append(all_done)
                _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for waiter in pending:
                    if waiter is not all_done:
                        waiter.cancel()
                if all_done is not None and all_done.done():
                    # Finished for good (restartPolicy); stay until the pod is deleted.
                    all_done = None
            await self._terminate_containers()
            for task in tasks:
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(task, 5)
        finally:
            refresher.cancel()
            with contextlib.suppress(BaseException):
                await refresher
        await self._finish()

    def _started_anything(self) -> bool:
        return any(r.process is not None for r in self.init_runners + self.runners)

    async def _wait_task_or_terminate(self, task: asyncio.Task, runner: ContainerRunner) -> None:
        stop = asyncio.create_task(self._terminate.wait())
        done, _ = await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done:
            runner.stop_restarts()
            await runner.kill(grace_period(self.pod), run_pre_stop=False)
            with contextlib.suppress(BaseException):
                await task
        stop.cancel()

    @staticmethod
    async def _wait_any(*events: asyncio.Event, seconds: float) -> None:
        waits = [asyncio.create_task(e.wait()) for e in events]
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waits:
                waiter.cancel()

    async def _fetch_token(self) -> None:
        """A service-account token for projected volumes (TokenRequest, bound to the pod)."""
        wants = any(
            "serviceAccountToken" in source
            for volume in self.pod["spec"].get("volumes") or []
            for source in (volume.get("projected") or {}).get("sources") or []
        )
        if not wants:
            return
        account = self.pod["spec"].get("serviceAccountName") or "default"
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "expirationSeconds": 3607,
                "boundObjectRef": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": self.name,
                    "uid": self.uid,
                },
            },
        }
        try:
            answer = await self.agent.api.create(
                f"/api/v1/namespaces/{self.namespace}/serviceaccounts/{account}/token", body
            )
            self._token = answer["status"]["token"]
        except Exception as exc:  # a token is a nicety here; the pod still runs
            log.warning("pod %s/%s: no service-account token: %s", self.namespace, self.name, exc)

    def _materialise(self) -> None:
        self.mounts = volumes.materialise(
            self.pod,
            self.pod_dir,
            pod_ip=self.pod_ip,
            configmaps=self.agent.configmap,
            secrets=self.agent.secret,
            node_allocatable=self.agent.allocatable,
            token=self._token,
            ca_cert=self.agent.ca_cert,
        )

    async def _refresh_loop(self) -> None:
        while True:
            await self._refresh.wait()
            self._refresh.clear()
            try:
                self._materialise()
            except podspec.MissingReference as exc:
                log.info("pod %s/%s: volume refresh skipped: %s", self.namespace, self.name, exc)

    # ------------------------------------------------------------------ termination
    async def _terminate_containers(self) -> None:
        grace = 2.0 if self._gone else grace_period(self.pod)
        for runner in self.init_runners + self.runners:
            runner.stop_restarts()
        running = [r for r in self.runners + self.init_runners if r.running]
        for runner in running:
            self.event("Killing", f"Stopping container {runner.name}")
        await asyncio.gather(*(r.kill(grace, run_pre_stop=not self._gone) for r in running))

    async def kill_all(self, grace: float) -> None:
        """Stop every process of this pod now (agent shutdown, worker failure)."""
        for runner in self.init_runners + self.runners:
            runner.stop_restarts()
        await asyncio.gather(
            *(
                r.kill(grace, run_pre_stop=False)
                for r in self.init_runners + self.runners
                if r.running
            )
        )

    async def _finish(self) -> None:
        """After the containers stopped: final status, then remove the pod object."""
        if self._gone:
            return
        for runner in self.runners:
            if "terminated" not in runner.view.state and not runner.view.ever_started:
                runner.view.state = {"terminated": {"exitCode": 0, "reason": "Completed"}}
            runner.view.final = True
            runner.view.ready = False
        if self.pod["metadata"].get("deletionTimestamp"):
            await self._flush_status()
            try:
                await self.agent.api.delete(
                    self.path,
                    {
                        "apiVersion": "v1",
                        "kind": "DeleteOptions",
                        "gracePeriodSeconds": 0,
                        "preconditions": {"uid": self.uid},
                    },
                )
            except ApiError as exc:
                if exc.status not in (404, 409):
                    log.warning("pod %s/%s: delete failed: %s", self.namespace, self.name, exc)

    # ------------------------------------------------------------------ status
    def view(self) -> PodView:
        return PodView(
            pod_ip=self.pod_ip,
            host_ip="127.0.0.1",
            start_time=self.start_time,
            network_ready=self.network_ready,
            initialized=self.initialized,
            init_failed=self.init_failed,
            containers=[r.view for r in self.runners],
            init_containers=[r.view for r in self.init_runners],
        )

    async def _flush_status(self) -> None:
        async with self._patch_lock:
            if self._gone:
                return
            patch = status_patch(self.pod, self.view(), dt.datetime.now(dt.UTC), self._transitions)
            if patch == self._last_patch:
                return
            try:
                await self.agent.api.patch(self.path + "/status", patch)
                self._last_patch = patch
            except ApiError as exc:
                if exc.status == 404:
                    self._gone = True
                    return
                raise

    async def _status_loop(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            await asyncio.sleep(0.02)  # let a burst of changes land in one patch
            try:
                await self._flush_status()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("pod %s/%s: status patch failed: %s", self.namespace, self.name, exc)
                await asyncio.sleep(1)
                self._dirty.set()


def event_name(pod: dict) -> str:
    return f"{pod['metadata']['name']}.{uuid.uuid4().hex[:12]}"
