"""The service proxy: what kube-proxy does for NodePort Services, on 127.0.0.1.

For every TCP port of a NodePort (or LoadBalancer) Service it listens on 127.0.0.1:<nodePort>
and forwards each connection to the next ready endpoint (round robin) of the Service's
EndpointSlices, as they are at that moment (the slices are watched). With no ready endpoint the
connection is closed at once. Only loopback endpoint addresses are ever dialled.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import logging
from pathlib import Path

from warmgate_devcluster.config import ClusterConfig
from warmgate_devcluster.kubeapi import KubeApi, Reflector

log = logging.getLogger(__name__)

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
CONNECT_TIMEOUT = 3.0


def listeners_for(services: list[dict]) -> dict[int, tuple[str, str]]:
    """nodePort -> (service key, service port name). Pure."""
    wanted: dict[int, tuple[str, str]] = {}
    for service in services:
        spec = service.get("spec") or {}
        if spec.get("type") not in ("NodePort", "LoadBalancer"):
            continue
        meta = service["metadata"]
        for port in spec.get("ports") or []:
            if port.get("nodePort") and port.get("protocol", "TCP") == "TCP":
                wanted[int(port["nodePort"])] = (
                    f"{meta['namespace']}/{meta['name']}",
                    port.get("name") or "",
                )
    return wanted


def ready_endpoints(slices: list[dict], service_key: str, port_name: str) -> list[tuple[str, int]]:
    """(loopback IP, port) of the ready endpoints for one Service port. Pure."""
    namespace, _, name = service_key.partition("/")
    found = []
    for slice_ in slices:
        meta = slice_["metadata"]
        if (
            meta.get("namespace") != namespace
            or (meta.get("labels") or {}).get(SERVICE_NAME_LABEL) != name
        ):
            continue
        port = next(
            (p for p in slice_.get("ports") or [] if (p.get("name") or "") == port_name), None
        )
        if port is None or port.get("port") is None:
            continue
        for endpoint in slice_.get("endpoints") or []:
            # The API says an unset `ready` means ready.
            if (endpoint.get("conditions") or {}).get("ready") is False:
                continue
            for address in endpoint.get("addresses") or []:
                try:
                    ip = ipaddress.ip_address(address)
                except ValueError:
                    continue
                if ip.version == 4 and ip.is_loopback:
                    found.append((address, int(port["port"])))
                    break
    return sorted(set(found))


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        pass


class ServiceProxy:
    def __init__(self, api: KubeApi) -> None:
        self.services = Reflector(api, "/api/v1/services", self._changed, name="services")
        self.slices = Reflector(
            api, "/apis/discovery.k8s.io/v1/endpointslices", _ignore, name="endpointslices"
        )
        self.listeners: dict[int, tuple[tuple[str, str], asyncio.AbstractServer]] = {}
        self._counters: dict[tuple[str, str], itertools.count] = {}
        self._sync_lock = asyncio.Lock()

    async def _changed(self, _event: str, _service: dict) -> None:
        if self.services.synced.is_set():
            await self.sync_listeners()

    async def sync_listeners(self) -> None:
        async with self._sync_lock:
            wanted = listeners_for(list(self.services.cache.values()))
            for port, (target, server) in list(self.listeners.items()):
                if wanted.get(port) != target:
                    server.close()
                    del self.listeners[port]
                    log.info("closed 127.0.0.1:%d (%s)", port, target[0])
            for port, target in wanted.items():
                if port in self.listeners:
                    continue
                try:
                    server = await asyncio.start_server(
                        lambda r, w, target=target: self._handle(r, w, target),
                        "127.0.0.1",
                        port,
                        reuse_address=True,
                    )
                except OSError as exc:
                    log.warning(
                        "cannot listen on 127.0.0.1:%d for %s: %s (retrying)", port, target[0], exc
                    )
                    continue
                self.listeners[port] = (target, server)
                log.info("listening on 127.0.0.1:%d for %s port %r", port, *target)

    async def _handle(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, target: tuple[str, str]
    ) -> None:
        endpoints = ready_endpoints(list(self.slices.cache.values()), *target)
        upstream = None
        if endpoints:
            counter = self._counters.setdefault(target, itertools.count())
            start = next(counter)
            for offset in range(len(endpoints)):
                host, port = endpoints[(start + offset) % len(endpoints)]
                try:
                    upstream = await asyncio.wait_for(
                        asyncio.open_connection(host, port), CONNECT_TIMEOUT
                    )
                    break
                except (OSError, TimeoutError) as exc:
                    log.info("%s: endpoint %s:%d refused: %s", target[0], host, port, exc)
        if upstream is None:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
            return
        up_reader, up_writer = upstream
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                w.close()
                with contextlib.suppress(Exception):
                    await w.wait_closed()

    async def _retry_binds(self) -> None:
        while True:
            await asyncio.sleep(2)
            await self.sync_listeners()

    async def run(self, config: ClusterConfig) -> None:
        from warmgate_devcluster.agent import mark_ready

        tasks = [asyncio.create_task(self.slices.run()), asyncio.create_task(self.services.run())]
        await self.slices.synced.wait()
        await self.services.synced.wait()
        await self.sync_listeners()
        tasks.append(asyncio.create_task(self._retry_binds()))
        mark_ready(config, "service-proxy")
        await asyncio.gather(*tasks)


def _ignore(_event: str, _obj: dict) -> None:  # slices are read when a connection comes
    return None


async def _main(config: ClusterConfig) -> None:
    async with KubeApi.for_cluster(config) as api:
        await ServiceProxy(api).run(config)


def main(state_dir: Path) -> None:
    asyncio.run(_main(ClusterConfig.load(state_dir)))
