"""The router's Kubernetes access: list, watch and patch with aiohttp on the event loop, with
the official client's configuration and authentication (in-cluster service account, else the
kubeconfig; a rotated token is read again as the client does).

A Reflector lists a kind once, then watches it from the listing's resourceVersion; after a gap
(410: the version is too old, or a broken stream) it lists again and hands the whole listing
over, so an object deleted during the gap is dropped, not kept.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

import aiohttp
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config

log = logging.getLogger("warmgate.router.kube")

USER_AGENT = "warmgate-router"


@dataclass(frozen=True)
class Kind:
    api_version: str
    plural: str

    def path(self, namespace: str | None, name: str | None = None, sub: str | None = None) -> str:
        path = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        if namespace is not None:
            path += f"/namespaces/{quote(namespace, safe='')}"
        path += f"/{self.plural}"
        if name is not None:
            path += "/" + quote(name, safe="")
        if sub is not None:
            path += "/" + sub
        return path


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


def _error(status: int, data: bytes) -> ApiError:
    text = data.decode(errors="replace")
    try:
        payload = json.loads(text)
        if isinstance(payload, dict) and "message" in payload:
            text = str(payload["message"])
    except ValueError:
        pass
    return ApiError(status, text)


class Kube:
    def __init__(self, configuration: k8s_client.Configuration) -> None:
        self.configuration = configuration
        self._session: aiohttp.ClientSession | None = None
        self.requests = 0

    @classmethod
    def from_environment(cls) -> Kube:
        configuration = k8s_client.Configuration()
        try:
            k8s_config.load_incluster_config(client_configuration=configuration)
        except k8s_config.ConfigException:
            k8s_config.load_kube_config(client_configuration=configuration)
        return cls(configuration)

    def _ssl(self) -> ssl.SSLContext | bool:
        c = self.configuration
        if not c.host.startswith("https"):
            return False
        context = ssl.create_default_context(cafile=c.ssl_ca_cert)
        if c.cert_file:
            context.load_cert_chain(c.cert_file, c.key_file)
        if not c.verify_ssl:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        return context

    def _headers(self, content_type: str | None = None) -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": USER_AGENT}
        for setting in self.configuration.auth_settings().values():
            if setting["in"] == "header" and setting["value"]:
                headers[setting["key"]] = setting["value"]
        if content_type:
            headers["Content-Type"] = content_type
        return headers

    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(ssl=self._ssl(), limit=32)
            self._session = aiohttp.ClientSession(connector=connector, trust_env=False)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: Sequence[tuple[str, str]] = (),
        content_type: str | None = None,
        seconds: float = 30.0,
    ) -> Any:
        url = f"{self.configuration.host}{path}"
        if query:
            url += "?" + urlencode(list(query))
        data = None if body is None else json.dumps(body).encode()
        self.requests += 1
        async with self.session().request(
            method,
            url,
            data=data,
            headers=self._headers(content_type or ("application/json" if data else None)),
            timeout=aiohttp.ClientTimeout(total=seconds),
        ) as response:
            payload = await response.read()
            if not 200 <= response.status <= 299:
                raise _error(response.status, payload)
            return json.loads(payload) if payload else None

    async def list(
        self, kind: Kind, namespace: str | None, selector: str = ""
    ) -> tuple[list[dict[str, Any]], str]:
        items: list[dict[str, Any]] = []
        token = ""
        while True:
            query = [("limit", "500")]
            if selector:
                query.append(("labelSelector", selector))
            if token:
                query.append(("continue", token))
            page = await self.request("GET", kind.path(namespace), query=query)
            items.extend(page.get("items") or [])
            meta = page.get("metadata") or {}
            token = meta.get("continue") or ""
            if not token:
                return items, str(meta.get("resourceVersion") or "")

    async def watch(
        self,
        kind: Kind,
        namespace: str | None,
        version: str,
        selector: str = "",
        seconds: int = 300,
    ) -> AsyncIterator[dict[str, Any]]:
        query = [
            ("watch", "true"),
            ("resourceVersion", version),
            ("allowWatchBookmarks", "true"),
            ("timeoutSeconds", str(seconds)),
        ]
        if selector:
            query.append(("labelSelector", selector))
        url = f"{self.configuration.host}{kind.path(namespace)}?{urlencode(query)}"
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=seconds + 30)
        self.requests += 1
        async with self.session().get(url, headers=self._headers(), timeout=timeout) as response:
            if response.status != 200:
                raise _error(response.status, await response.read())
            buffered = b""
            async for chunk in response.content.iter_any():
                buffered += chunk
                *lines, buffered = buffered.split(b"\n")
                for line in lines:
                    if line.strip():
                        yield json.loads(line)


Listing = Callable[[Kind, str | None, list[dict[str, Any]]], None]
Change = Callable[[Kind, str, dict[str, Any]], None]


class Reflector:
    """One kind in one namespace (or every one, with None): `on_listing` gets each whole
    listing (the first and every relist), `on_change` each ADDED, MODIFIED or DELETED."""

    def __init__(
        self,
        kube: Kube,
        kind: Kind,
        namespace: str | None,
        on_listing: Listing,
        on_change: Change,
        selector: str = "",
        optional: bool = False,
    ) -> None:
        self.kube = kube
        self.optional = optional
        """A kind whose CRD may be missing (the EmbeddingAlias CRD after a `helm upgrade`,
        which installs no new CRD): a 404 counts as an empty listing, tried again later."""
        self.kind = kind
        self.namespace = namespace
        self.selector = selector
        self.on_listing = on_listing
        self.on_change = on_change
        self.synced = asyncio.Event()

    def __repr__(self) -> str:
        return f"{self.kind.plural} in {self.namespace or 'every namespace'}"

    async def run(self) -> None:
        delay = 0.5
        while True:
            try:
                items, version = await self.kube.list(self.kind, self.namespace, self.selector)
                self.on_listing(self.kind, self.namespace, items)
                self.synced.set()
                delay = 0.5
                while True:
                    version = await self._watch(version)
            except asyncio.CancelledError:
                raise
            except ApiError as error:
                if error.status == 410:
                    log.info("%s: watch expired, listing again", self)
                    continue
                if error.status == 404 and self.optional:
                    log.warning("%s: not served (is its CRD installed?); none for now", self)
                    self.on_listing(self.kind, self.namespace, [])
                    self.synced.set()
                    await asyncio.sleep(30)
                    continue
                log.warning("%s: %s; listing again in %.1fs", self, error, delay)
            except (aiohttp.ClientError, TimeoutError, ValueError, OSError) as error:
                log.warning("%s: %r; listing again in %.1fs", self, error, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)

    async def _watch(self, version: str) -> str:
        """One watch request; the version to continue from. ApiError(410) when too old."""
        async for event in self.kube.watch(self.kind, self.namespace, version, self.selector):
            kind = event.get("type")
            obj = event.get("object") or {}
            if kind == "ERROR":
                raise ApiError(int(obj.get("code") or 500), str(obj.get("message") or obj))
            meta = obj.get("metadata") or {}
            version = str(meta.get("resourceVersion") or version)
            if kind in ("ADDED", "MODIFIED", "DELETED"):
                self.on_change(self.kind, kind, obj)
        return version
