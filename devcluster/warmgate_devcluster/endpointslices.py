"""devcluster's EndpointSlice controller, in place of kube-controller-manager's.

Why: devcluster pods have loopback IPs (127.0.x.y), and the apiserver's validation refuses
loopback addresses in IPv4/IPv6 EndpointSlices and in Endpoints ("may not be in the loopback
range"), so the stock controller cannot write a single slice. This one follows the same rules
(selector, pod readiness, terminating pods as ready=false/serving/terminating, named target
ports, owner reference to the Service, the `kubernetes.io/service-name` label) and writes the
slices with `addressType: FQDN`, whose addresses are validated as DNS names: "127.0.16.3" is
one. Readers should use `endpoints[].addresses[0]` as an IPv4 address, as the service proxy does.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from warmgate_devcluster.config import ClusterConfig
from warmgate_devcluster.kubeapi import ApiError, KubeApi, Reflector

log = logging.getLogger(__name__)

MANAGED_BY = "endpointslice-controller.devcluster.warmgate.dev"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
MANAGED_BY_LABEL = "endpointslice.kubernetes.io/managed-by"


def _selected(pod: dict, selector: dict[str, str]) -> bool:
    labels = pod["metadata"].get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


def _pod_ready(pod: dict) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def _target_port(service_port: dict, pod: dict) -> int | None:
    target = service_port.get("targetPort", service_port["port"])
    if isinstance(target, int) or str(target).isdigit():
        return int(target)
    protocol = service_port.get("protocol", "TCP")
    for container in pod["spec"].get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == target and port.get("protocol", "TCP") == protocol:
                return int(port["containerPort"])
    return None


def desired_slices(service: dict, pods: list[dict]) -> list[dict]:
    """The slices a Service should have: one per distinct set of resolved ports. Pure."""
    meta = service["metadata"]
    spec = service.get("spec") or {}
    selector = spec.get("selector")
    publish_not_ready = bool(spec.get("publishNotReadyAddresses"))
    groups: dict[tuple, list[dict]] = {}
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        status = pod.get("status") or {}
        if pod["metadata"].get("namespace") != meta["namespace"] or not _selected(pod, selector):
            continue
        if status.get("phase") in ("Succeeded", "Failed") or not status.get("podIP"):
            continue
        ports = []
        for service_port in spec.get("ports") or []:
            number = _target_port(service_port, pod)
            if number is None:
                continue
            port = {
                "name": service_port.get("name", ""),
                "port": number,
                "protocol": service_port.get("protocol", "TCP"),
            }
            if service_port.get("appProtocol"):
                port["appProtocol"] = service_port["appProtocol"]
            ports.append(port)
        terminating = pod["metadata"].get("deletionTimestamp") is not None
        ready = _pod_ready(pod)
        endpoint = {
            "addresses": [status["podIP"]],
            "conditions": {
                "ready": publish_not_ready or (ready and not terminating),
                "serving": publish_not_ready or ready,
                "terminating": terminating,
            },
            "targetRef": {
                "kind": "Pod",
                "namespace": meta["namespace"],
                "name": pod["metadata"]["name"],
                "uid": pod["metadata"]["uid"],
            },
        }
        if pod["spec"].get("nodeName"):
            endpoint["nodeName"] = pod["spec"]["nodeName"]
        key = tuple(sorted((p["name"], p["port"], p["protocol"]) for p in ports))
        groups.setdefault(key, []).append((ports, endpoint))
    labels = {
        k: v
        for k, v in (meta.get("labels") or {}).items()
        if k not in (SERVICE_NAME_LABEL, MANAGED_BY_LABEL)
    }
    labels.update({SERVICE_NAME_LABEL: meta["name"], MANAGED_BY_LABEL: MANAGED_BY})
    owner = {
        "apiVersion": "v1",
        "kind": "Service",
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }
    slices = []
    if not groups:
        groups[()] = []  # like the stock controller: an empty slice for a Service with no pods
    for members in groups.values():
        ports = members[0][0] if members else []
        slices.append(
            {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "generateName": f"{meta['name']}-",
                    "namespace": meta["namespace"],
                    "labels": labels,
                    "ownerReferences": [owner],
                },
                "addressType": "FQDN",
                "endpoints": [endpoint for _, endpoint in members],
                "ports": ports,
            }
        )
    return slices


def _port_key(slice_: dict) -> tuple:
    return tuple(
        sorted(
            (p.get("name", ""), p.get("port"), p.get("protocol", "TCP"))
            for p in slice_.get("ports") or []
        )
    )


def _normal_endpoint(endpoint: dict) -> tuple:
    conditions = endpoint.get("conditions") or {}
    ref = endpoint.get("targetRef") or {}
    return (
        tuple(endpoint.get("addresses") or []),
        conditions.get("ready"),
        conditions.get("serving"),
        conditions.get("terminating"),
        ref.get("name"),
        ref.get("uid"),
        endpoint.get("nodeName"),
    )


def _normal_ports(ports: list[dict] | None) -> list[tuple]:
    return [
        (p.get("name") or "", p.get("port"), p.get("protocol") or "TCP", p.get("appProtocol"))
        for p in ports or []
    ]


def _same(existing: dict, desired: dict) -> bool:
    return (
        [_normal_endpoint(e) for e in existing.get("endpoints") or []]
        == [_normal_endpoint(e) for e in desired["endpoints"]]
        and _normal_ports(existing.get("ports")) == _normal_ports(desired["ports"])
        and (existing["metadata"].get("labels") or {}) == desired["metadata"]["labels"]
    )


class EndpointSliceController:
    def __init__(self, api: KubeApi) -> None:
        self.api = api
        self.services = Reflector(api, "/api/v1/services", self._on_service, name="services")
        self.pods = Reflector(api, "/api/v1/pods", self._on_pod, name="pods")
        self.slices = Reflector(
            api,
            "/apis/discovery.k8s.io/v1/endpointslices",
            self._on_slice,
            params={"labelSelector": f"{MANAGED_BY_LABEL}={MANAGED_BY}"},
            name="endpointslices",
        )
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._queued: set[str] = set()

    def _enqueue(self, key: str) -> None:
        if key not in self._queued:
            self._queued.add(key)
            self._queue.put_nowait(key)

    def _on_service(self, _event: str, service: dict) -> None:
        meta = service["metadata"]
        self._enqueue(f"{meta['namespace']}/{meta['name']}")

    def _on_pod(self, _event: str, pod: dict) -> None:
        namespace = pod["metadata"]["namespace"]
        for key, service in list(self.services.cache.items()):
            selector = (service.get("spec") or {}).get("selector")
            if key.startswith(namespace + "/") and selector and _selected(pod, selector):
                self._enqueue(key)

    def _on_slice(self, _event: str, slice_: dict) -> None:
        name = (slice_["metadata"].get("labels") or {}).get(SERVICE_NAME_LABEL)
        if name:
            self._enqueue(f"{slice_['metadata']['namespace']}/{name}")

    async def reconcile(self, key: str) -> None:
        namespace, _, name = key.partition("/")
        service = self.services.cache.get(key)
        existing = [
            s
            for s in self.slices.cache.values()
            if s["metadata"]["namespace"] == namespace
            and (s["metadata"].get("labels") or {}).get(SERVICE_NAME_LABEL) == name
        ]
        base = f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
        spec = (service or {}).get("spec") or {}
        if service is None or not spec.get("selector") or spec.get("type") == "ExternalName":
            for slice_ in existing:
                await self._delete(base, slice_)
            return
        pods = [p for p in self.pods.cache.values() if p["metadata"]["namespace"] == namespace]
        unmatched = {_port_key(s): s for s in existing}
        for desired in desired_slices(service, pods):
            current = unmatched.pop(_port_key(desired), None)
            if current is None:
                written = await self.api.create(base, desired)
            elif not _same(current, desired):
                body = dict(desired)
                body["metadata"] = {**current["metadata"], "labels": desired["metadata"]["labels"]}
                written = await self.api.replace(f"{base}/{current['metadata']['name']}", body)
            else:
                continue
            # Remember our own write now: the watch may deliver it after the next reconcile.
            self.slices.cache[f"{namespace}/{written['metadata']['name']}"] = written
        for slice_ in unmatched.values():
            await self._delete(base, slice_)

    async def _delete(self, base: str, slice_: dict) -> None:
        try:
            await self.api.delete(f"{base}/{slice_['metadata']['name']}")
        except ApiError as exc:
            if exc.status != 404:
                raise
        self.slices.cache.pop(
            f"{slice_['metadata']['namespace']}/{slice_['metadata']['name']}", None
        )

    async def _worker(self) -> None:
        while True:
            key = await self._queue.get()
            self._queued.discard(key)
            try:
                await self.reconcile(key)
            except ApiError as exc:
                if exc.status != 409:  # 409: our cache was stale; the watch will requeue it
                    log.warning("endpointslices for %s: %s", key, exc)
                await asyncio.sleep(0.2)
                self._enqueue(key)

    async def run(self, config: ClusterConfig) -> None:
        from warmgate_devcluster.agent import mark_ready

        tasks = [asyncio.create_task(r.run()) for r in (self.slices, self.pods, self.services)]
        for reflector in (self.slices, self.pods, self.services):
            await reflector.synced.wait()
        tasks.append(asyncio.create_task(self._worker()))
        mark_ready(config, "endpointslices")
        await asyncio.gather(*tasks)


async def _main(config: ClusterConfig) -> None:
    async with KubeApi.for_cluster(config) as api:
        await EndpointSliceController(api).run(config)


def main(state_dir: Path) -> None:
    asyncio.run(_main(ClusterConfig.load(state_dir)))
