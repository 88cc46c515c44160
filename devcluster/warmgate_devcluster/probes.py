"""One probe attempt (httpGet, tcpSocket, exec), and the probe settings with kubelet's defaults.
Only loopback destinations are ever dialled."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import signal
import ssl
from dataclasses import dataclass

import aiohttp


@dataclass(frozen=True)
class ProbeSettings:
    initial_delay: float = 0.0
    period: float = 10.0
    timeout: float = 1.0
    success_threshold: int = 1
    failure_threshold: int = 3
    termination_grace: float | None = None

    @classmethod
    def of(cls, probe: dict) -> ProbeSettings:
        return cls(
            initial_delay=float(probe.get("initialDelaySeconds") or 0),
            period=float(probe.get("periodSeconds") or 10),
            timeout=float(probe.get("timeoutSeconds") or 1),
            success_threshold=int(probe.get("successThreshold") or 1),
            failure_threshold=int(probe.get("failureThreshold") or 3),
            termination_grace=(
                float(probe["terminationGracePeriodSeconds"])
                if probe.get("terminationGracePeriodSeconds") is not None
                else None
            ),
        )


@dataclass(frozen=True)
class ProbeResult:
    success: bool
    message: str = ""


def resolve_port(port: int | str, container: dict) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for declared in container.get("ports") or []:
        if declared.get("name") == port:
            return int(declared["containerPort"])
    raise ValueError(f"no container port named {port!r}")


def loopback_host(host: str | None, pod_ip: str) -> str:
    """The address to dial: the pod IP by default; anything outside 127.0.0.0/8 is refused."""
    host = host or pod_ip
    if host == "localhost":
        return "127.0.0.1"
    try:
        address = ipaddress.ip_address(host)
    except ValueError as exc:
        raise ValueError(
            f"probe host {host!r} is not an IP address (devcluster dials loopback addresses only)"
        ) from exc
    if not address.is_loopback:
        raise ValueError(f"probe host {host} is outside 127.0.0.0/8; devcluster does not dial it")
    return host


_INSECURE = ssl.create_default_context()
_INSECURE.check_hostname = False
_INSECURE.verify_mode = ssl.CERT_NONE


async def http_get(
    action: dict, container: dict, pod_ip: str, seconds: float, session: aiohttp.ClientSession
) -> ProbeResult:
    try:
        host = loopback_host(action.get("host"), pod_ip)
        port = resolve_port(action.get("port", 80), container)
    except ValueError as exc:
        return ProbeResult(False, str(exc))
    scheme = (action.get("scheme") or "HTTP").lower()
    path = action.get("path") or "/"
    if not path.startswith("/"):
        path = "/" + path
    headers = {"User-Agent": "kube-probe/devcluster", "Accept": "*/*"}
    for header in action.get("httpHeaders") or []:
        headers[header["name"]] = header["value"]
    url = f"{scheme}://{host}:{port}{path}"
    try:
        async with session.get(
            url,
            headers=headers,
            allow_redirects=False,
            ssl=_INSECURE if scheme == "https" else None,
            timeout=aiohttp.ClientTimeout(total=seconds),
        ) as resp:
            await resp.read()
            if 200 <= resp.status < 400:
                return ProbeResult(True)
            return ProbeResult(False, f"HTTP probe failed with statuscode: {resp.status}")
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        return ProbeResult(False, f'Get "{url}": {type(exc).__name__}: {exc}')


async def tcp_socket(action: dict, container: dict, pod_ip: str, seconds: float) -> ProbeResult:
    try:
        host = loopback_host(action.get("host"), pod_ip)
        port = resolve_port(action["port"], container)
    except ValueError as exc:
        return ProbeResult(False, str(exc))
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), seconds)
    except (OSError, TimeoutError) as exc:
        return ProbeResult(False, f"dial tcp {host}:{port}: {exc}")
    writer.close()
    with contextlib.suppress(Exception):
        await writer.wait_closed()
    return ProbeResult(True)


async def run_exec(
    argv: list[str], env: dict[str, str], cwd: str | None, seconds: float
) -> ProbeResult:
    """Run a command on the host (there is no container to enter) with the container's env."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            env=env,
            cwd=cwd,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
    except OSError as exc:
        return ProbeResult(False, f"exec {argv!r}: {exc}")
    try:
        output, _ = await asyncio.wait_for(proc.communicate(), seconds)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        return ProbeResult(False, f"command timed out after {seconds}s")
    if proc.returncode == 0:
        return ProbeResult(True)
    return ProbeResult(False, output.decode(errors="replace")[-300:])
