"""One container as a local process: start, probe, restart with back-off, kill like kubelet.

Each process runs in its own session (process group = pid), so signals reach the children it
forks as well. The pid (with its start time) is written to the pod's folder, so `down` can stop
anything an agent left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
import os
import re
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import aiohttp

from warmgate_devcluster import probes, procs
from warmgate_devcluster.cgroups import launch_in
from warmgate_devcluster.podstatus import ContainerView, timestamp

log = logging.getLogger(__name__)

MIN_KILL_GRACE = 2.0  # kubelet's minimum grace after preStop
BACKOFF_RESET_AFTER = 600.0  # a container that ran this long starts its back-off afresh


class PrepareError(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class LaunchSpec:
    argv: list[str]
    env: dict[str, str]
    cwd: str


class PodHost(Protocol):
    """What a container needs from its pod worker."""

    pod: dict
    pod_ip: str
    restart_backoff: tuple[float, float]
    probe_session: aiohttp.ClientSession

    cgroup: Path | None

    def prepare(self, container: dict) -> LaunchSpec: ...
    def notify(self) -> None: ...
    def log_path(self, container: str) -> Path: ...
    def pid_path(self, container: str) -> Path: ...
    def event(self, reason: str, message: str, kind: str = "Normal") -> None: ...


def _now() -> str:
    return timestamp(dt.datetime.now(dt.UTC))


_SLEEP = re.compile(r"^\s*(?:exec\s+)?sleep\s+([0-9.]+)\s*$")


def sleep_seconds(argv: list[str]) -> float | None:
    """`sleep N` (directly or via `sh -c`) as a number of seconds, else None."""
    if len(argv) == 2 and Path(argv[0]).name == "sleep":
        with contextlib.suppress(ValueError):
            return float(argv[1])
    if len(argv) == 3 and Path(argv[0]).name in ("sh", "bash", "ash") and argv[1] == "-c":
        match = _SLEEP.match(argv[2])
        if match:
            return float(match.group(1))
    return None


class ContainerRunner:
    def __init__(self, host: PodHost, spec: dict, *, init: bool = False) -> None:
        self.host = host
        self.spec = spec
        self.name = spec["name"]
        # A restartable init container ("sidecar") behaves like an ordinary container.
        self.sidecar = init and spec.get("restartPolicy") == "Always"
        self.init = init and not self.sidecar
        image = spec.get("image", "")
        self.view = ContainerView(name=self.name, image=image, image_id=f"devcluster://{image}")
        self.process: asyncio.subprocess.Process | None = None
        self.launch: LaunchSpec | None = None
        self._stop = asyncio.Event()
        self.started_event = asyncio.Event()  # set the first time `started` turns True
        self._kill_lock = asyncio.Lock()
        self._started_at = 0.0

    # ------------------------------------------------------------------ policy
    def _should_restart(self, exit_code: int) -> bool:
        policy = self.host.pod["spec"].get("restartPolicy", "Always")
        if self.init:
            return exit_code != 0 and policy != "Never"
        if policy == "Always":
            return True
        return policy == "OnFailure" and exit_code != 0

    def stop_restarts(self) -> None:
        self._stop.set()

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    # ------------------------------------------------------------------ main loop
    async def run(self) -> None:
        exponent = 0
        while not self._stop.is_set():
            try:
                self.launch = self.host.prepare(self.spec)
            except PrepareError as exc:
                self.view.state = {"waiting": {"reason": exc.reason, "message": str(exc)}}
                self.host.notify()
                await self._sleep_unless_stopped(2.0)
                continue
            terminated = await self._run_once()
            if terminated is None:  # stopped before it could start
                break
            self.view.state = {"terminated": terminated}
            self.view.started = False
            self.view.ready = False
            ran_for = time.monotonic() - self._started_at
            if self._stop.is_set() or not self._should_restart(terminated["exitCode"]):
                self.view.final = True
                self.host.notify()
                return
            if ran_for > BACKOFF_RESET_AFTER:
                exponent = 0
            base, cap = self.host.restart_backoff
            delay = min(base * (2**exponent), cap)
            exponent += 1
            self.view.last_state = {"terminated": terminated}
            self.view.state = {
                "waiting": {
                    "reason": "CrashLoopBackOff",
                    "message": f"back-off {delay:g}s restarting failed container={self.name} "
                    f"pod={self.host.pod['metadata']['name']}",
                }
            }
            self.host.event(
                "BackOff", f"Back-off restarting failed container {self.name}", "Warning"
            )
            self.host.notify()
            await self._sleep_unless_stopped(delay)
            if self._stop.is_set():
                self.view.state = {"terminated": terminated}
                self.view.final = True
                self.host.notify()
                return
            self.view.restart_count += 1
        self.view.final = True
        self.host.notify()

    async def _sleep_unless_stopped(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)

    async def _run_once(self) -> dict | None:
        launch = self.launch
        assert launch is not None
        log_path = self.host.log_path(self.name)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        started = _now()
        # A local append-only file: opening it does not block the loop in practice.
        with open(log_path, "ab") as log_file:  # noqa: ASYNC230
            log_file.write(f"--- {started} starting {launch.argv!r}\n".encode())
            log_file.flush()
            try:
                argv = launch.argv
                if self.host.cgroup is not None:
                    argv = launch_in(self.host.cgroup, argv)
                self.process = await asyncio.create_subprocess_exec(
                    *argv,
                    env=launch.env,
                    cwd=launch.cwd,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=log_file,
                    start_new_session=True,
                )
            except OSError as exc:
                self.process = None
                self._started_at = time.monotonic()
                self.host.event("Failed", f"Error: {exc}", "Warning")
                return {
                    "exitCode": 128,
                    "reason": "StartError",
                    "message": str(exc),
                    "startedAt": started,
                    "finishedAt": _now(),
                }
        pid = self.process.pid
        self._started_at = time.monotonic()
        ticks = procs.start_ticks(pid)
        pid_path = self.host.pid_path(self.name)
        pid_path.parent.mkdir(parents=True, exist_ok=True)
        pid_path.write_text(
            json.dumps(
                {
                    "name": f"{self.host.pod['metadata']['name']}/{self.name}",
                    "pid": pid,
                    "start_ticks": ticks if ticks is not None else -1,
                }
            )
        )
        has_startup = bool(self.spec.get("startupProbe")) and not self.init
        self.view.container_id = f"devcluster://{pid}"
        self.view.state = {"running": {"startedAt": started}}
        self.view.ever_started = True
        self.view.started = not has_startup
        if self.view.started:
            self.started_event.set()
        self.view.ready = False
        self.host.event("Started", f"Started container {self.name} (pid {pid})")
        self.host.notify()

        probe_task = None if self.init else asyncio.create_task(self._probe_all())
        exit_task = asyncio.create_task(self.process.wait())
        try:
            waiting = {exit_task} | ({probe_task} if probe_task else set())
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if probe_task in done and probe_task.exception() is not None:
                log.error("%s: probes failed: %r", self.name, probe_task.exception())
            elif probe_task in done and probe_task.result():
                reason, grace = probe_task.result()
                self.host.event("Killing", f"Container {self.name} {reason}, will be restarted")
                await self.kill(grace, run_pre_stop=True)
            returncode = await exit_task
        finally:
            if probe_task is not None:
                probe_task.cancel()
                with contextlib.suppress(BaseException):
                    await probe_task
        # Children that outlived the main process die with it, like in a container.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(FileNotFoundError):
            pid_path.unlink()
        terminated = {
            "startedAt": started,
            "finishedAt": _now(),
            "containerID": f"devcluster://{pid}",
        }
        if returncode < 0:
            terminated.update(exitCode=128 - returncode, signal=-returncode, reason="Error")
        else:
            terminated.update(
                exitCode=returncode, reason="Completed" if returncode == 0 else "Error"
            )
        return terminated

    # ------------------------------------------------------------------ probes
    async def _probe_once(self, probe: dict) -> probes.ProbeResult:
        settings = probes.ProbeSettings.of(probe)
        pod_ip = self.host.pod_ip
        if "httpGet" in probe:
            return await probes.http_get(
                probe["httpGet"], self.spec, pod_ip, settings.timeout, self.host.probe_session
            )
        if "tcpSocket" in probe:
            return await probes.tcp_socket(probe["tcpSocket"], self.spec, pod_ip, settings.timeout)
        if "exec" in probe:
            launch = self.launch
            return await probes.run_exec(
                list(probe["exec"].get("command") or []),
                launch.env if launch else {},
                launch.cwd if launch else None,
                settings.timeout,
            )
        return probes.ProbeResult(
            False, "unsupported probe handler (devcluster runs httpGet, tcpSocket and exec)"
        )

    async def _probe_loop(
        self,
        kind: str,
        probe: dict,
        on_result: Callable[[bool, probes.ProbeResult], Awaitable[bool]],
    ):
        """Run `probe` on its schedule; stop when on_result returns True."""
        settings = probes.ProbeSettings.of(probe)
        delay = self._started_at + settings.initial_delay - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        successes = failures = 0
        while True:
            tick = time.monotonic()
            result = await self._probe_once(probe)
            if result.success:
                successes, failures = successes + 1, 0
            else:
                successes, failures = 0, failures + 1
                self.host.event("Unhealthy", f"{kind} probe failed: {result.message}", "Warning")
            if successes >= settings.success_threshold and await on_result(True, result):
                return
            if failures >= settings.failure_threshold and await on_result(False, result):
                return
            await asyncio.sleep(max(0.0, settings.period - (time.monotonic() - tick)))

    async def _probe_all(self) -> tuple[str, float] | None:
        """Startup gates the others; returns (reason, grace) when the container must die."""
        pod_grace = float(self.host.pod["spec"].get("terminationGracePeriodSeconds", 30))
        verdict: list[tuple[str, float]] = []

        def grace_of(probe: dict) -> float:
            custom = probes.ProbeSettings.of(probe).termination_grace
            return custom if custom is not None else pod_grace

        startup = self.spec.get("startupProbe")
        if startup:

            async def on_startup(ok: bool, result: probes.ProbeResult) -> bool:
                if not ok:
                    verdict.append((f"failed startup probe: {result.message}", grace_of(startup)))
                return True

            await self._probe_loop("Startup", startup, on_startup)
            if verdict:
                return verdict[0]
            self.view.started = True
            self.started_event.set()
            self.host.notify()

        readiness = self.spec.get("readinessProbe")
        readiness_task = None
        if readiness:

            async def on_readiness(ok: bool, _result: probes.ProbeResult) -> bool:
                if self.view.ready != ok:
                    self.view.ready = ok
                    self.host.notify()
                return False

            readiness_task = asyncio.create_task(
                self._probe_loop("Readiness", readiness, on_readiness)
            )
        else:
            self.view.ready = True
            self.host.notify()
        try:
            liveness = self.spec.get("livenessProbe")
            if liveness:

                async def on_liveness(ok: bool, result: probes.ProbeResult) -> bool:
                    if not ok:
                        verdict.append(
                            (f"failed liveness probe: {result.message}", grace_of(liveness))
                        )
                    return not ok

                await self._probe_loop("Liveness", liveness, on_liveness)
                return verdict[0]
            if readiness_task is not None:
                await readiness_task
            else:
                await asyncio.Event().wait()
            return None
        finally:
            if readiness_task is not None:
                readiness_task.cancel()
                with contextlib.suppress(BaseException):
                    await readiness_task

    # ------------------------------------------------------------------ termination
    async def _pre_stop(self) -> None:
        hook = ((self.spec.get("lifecycle") or {}).get("preStop")) or {}
        if "exec" in hook:
            argv = list(hook["exec"].get("command") or [])
            seconds = sleep_seconds(argv)
            if seconds is not None:
                await asyncio.sleep(seconds)
            elif argv and self.launch is not None:
                await probes.run_exec(argv, self.launch.env, self.launch.cwd, seconds=3600)
        elif "httpGet" in hook:
            await probes.http_get(
                hook["httpGet"], self.spec, self.host.pod_ip, 3600, self.host.probe_session
            )
        elif "sleep" in hook:
            await asyncio.sleep(float(hook["sleep"].get("seconds", 0)))

    async def kill(self, grace: float, *, run_pre_stop: bool) -> None:
        """preStop (within the grace period), SIGTERM, wait, SIGKILL: the process group."""
        async with self._kill_lock:
            process = self.process
            if process is None or process.returncode is not None:
                return
            deadline = time.monotonic() + max(grace, 0.0)
            if run_pre_stop and (self.spec.get("lifecycle") or {}).get("preStop"):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._pre_stop(), max(grace, 0.0))
            remaining = max(deadline - time.monotonic(), MIN_KILL_GRACE if grace > 0 else 0.0)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), remaining)
            except TimeoutError:
                log.info("%s: no exit %.0fs after SIGTERM; SIGKILL", self.name, remaining)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signal.SIGKILL)
                await process.wait()
