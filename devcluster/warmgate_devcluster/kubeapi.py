"""A small asyncio client for the apiserver (aiohttp, admin client certificate), and a
reflector: list, then watch from the list's resourceVersion, relisting on 410 Gone."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from warmgate_devcluster.config import ClusterConfig
from warmgate_devcluster.pki import Pki

log = logging.getLogger(__name__)

PATCH_TYPES = {
    "strategic": "application/strategic-merge-patch+json",
    "merge": "application/merge-patch+json",
    "json": "application/json-patch+json",
}


class ApiError(Exception):
    def __init__(self, status: int, body: str, method: str, path: str) -> None:
        self.status = status
        self.body = body
        try:
            self.reason = json.loads(body).get("reason", "")
        except (ValueError, AttributeError):
            self.reason = ""
        super().__init__(f"{method} {path}: {status} {body[:500]}")


class Gone(Exception):
    """The watch's resourceVersion is too old: list again."""


class KubeApi:
    def __init__(self, server: str, pki: Pki) -> None:
        self.server = server.rstrip("/")
        self._ssl = ssl.create_default_context(cafile=str(pki.ca_cert))
        self._ssl.load_cert_chain(str(pki.admin_cert), str(pki.admin_key))
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def for_cluster(cls, config: ClusterConfig) -> KubeApi:
        runtime = json.loads(config.runtime_file.read_text())
        port = runtime["ports"]["apiserver"]
        return cls(f"https://127.0.0.1:{port}", Pki(Path(config.pki_dir)))

    async def __aenter__(self) -> KubeApi:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=self._ssl, limit=64),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
        )
        return self

    async def __aexit__(self, *exc) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "use `async with KubeApi(...)`"
        return self._session

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, Any] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        seconds: float = 30.0,
    ) -> Any:
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type, "Accept": "application/json"}
        async with self.session.request(
            method,
            self.server + path,
            params=_clean(params),
            data=data,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=seconds),
        ) as resp:
            text = await resp.text()
            if resp.status >= 400:
                raise ApiError(resp.status, text, method, path)
            return json.loads(text) if text else None

    async def get(self, path: str, **params: Any) -> Any:
        return await self.request("GET", path, params=params)

    async def create(self, path: str, body: dict) -> Any:
        return await self.request("POST", path, body=body)

    async def replace(self, path: str, body: dict) -> Any:
        return await self.request("PUT", path, body=body)

    async def patch(self, path: str, body: Any, patch_type: str = "strategic") -> Any:
        return await self.request("PATCH", path, body=body, content_type=PATCH_TYPES[patch_type])

    async def delete(self, path: str, body: dict | None = None) -> Any:
        return await self.request("DELETE", path, body=body)

    async def watch(
        self, path: str, resource_version: str, params: dict[str, Any] | None = None
    ) -> AsyncIterator[tuple[str, dict]]:
        """(event type, object) pairs until the server ends the watch."""
        query = dict(params or {})
        query.update(
            watch="true",
            resourceVersion=resource_version,
            allowWatchBookmarks="true",
            timeoutSeconds=300,
        )
        async with self.session.get(
            self.server + path,
            params=_clean(query),
            timeout=aiohttp.ClientTimeout(total=None, sock_read=360),
        ) as resp:
            if resp.status == 410:
                raise Gone()
            if resp.status >= 400:
                raise ApiError(resp.status, await resp.text(), "WATCH", path)
            buffer = b""
            async for chunk in resp.content.iter_any():
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    if event["type"] == "ERROR":
                        if event["object"].get("code") == 410:
                            raise Gone()
                        raise ApiError(
                            event["object"].get("code", 500), json.dumps(event), "WATCH", path
                        )
                    yield event["type"], event["object"]


def _clean(params: dict[str, Any] | None) -> dict[str, str] | None:
    if not params:
        return None
    return {
        k: str(v).lower() if isinstance(v, bool) else str(v)
        for k, v in params.items()
        if v is not None
    }


def object_key(obj: dict) -> str:
    meta = obj["metadata"]
    return f"{meta.get('namespace', '')}/{meta['name']}"


Handler = Callable[[str, dict], Awaitable[None] | None]


class Reflector:
    """Keeps `cache` (key -> object) in step with the apiserver and calls `handler(event,
    object)` for ADDED, MODIFIED and DELETED, including the differences a relist finds."""

    def __init__(
        self,
        api: KubeApi,
        path: str,
        handler: Handler,
        params: dict[str, Any] | None = None,
        name: str = "",
    ) -> None:
        self.api = api
        self.path = path
        self.params = params or {}
        self.handler = handler
        self.name = name or path
        self.cache: dict[str, dict] = {}
        self.synced = asyncio.Event()

    async def _emit(self, event: str, obj: dict) -> None:
        result = self.handler(event, obj)
        if asyncio.iscoroutine(result):
            await result

    async def _relist(self) -> str:
        listing = await self.api.get(self.path, **self.params)
        fresh = {}
        for item in listing.get("items", []):
            fresh[object_key(item)] = item
        old = self.cache
        self.cache = fresh
        for key, obj in fresh.items():
            before = old.get(key)
            if before is None:
                await self._emit("ADDED", obj)
            elif before["metadata"].get("resourceVersion") != obj["metadata"].get(
                "resourceVersion"
            ):
                await self._emit("MODIFIED", obj)
        for key, obj in old.items():
            if key not in fresh:
                await self._emit("DELETED", obj)
        self.synced.set()
        return listing["metadata"]["resourceVersion"]

    async def run(self) -> None:
        resource_version = None
        while True:
            try:
                if resource_version is None:
                    resource_version = await self._relist()
                async for event, obj in self.api.watch(self.path, resource_version, self.params):
                    resource_version = obj.get("metadata", {}).get(
                        "resourceVersion", resource_version
                    )
                    if event == "BOOKMARK":
                        continue
                    key = object_key(obj)
                    if event == "DELETED":
                        self.cache.pop(key, None)
                    else:
                        self.cache[key] = obj
                    await self._emit(event, obj)
            except asyncio.CancelledError:
                raise
            except Gone:
                resource_version = None
            except Exception as exc:  # the apiserver went away or a handler failed: retry
                log.warning("%s: watch failed (%s); retrying", self.name, exc)
                resource_version = None
                await asyncio.sleep(1)


async def run_forever(*coroutines: Awaitable[Any]) -> None:
    """Run tasks together; the first to fail takes the others down."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            task.result()
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
