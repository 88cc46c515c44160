"""The operator's HTTP calls to server pods (the warm gate's `/ready` and verification request,
the traffic observer's `/warmup/profile`): bounded in time, in bytes read and in calls in
flight whatever the number of pods, and counted by path and result."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from .metrics import Metrics

ERRORS = (aiohttp.ClientError, TimeoutError, OSError)
"""What a call to a pod raises when it got no usable answer."""


async def read_capped(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """The body, or aiohttp.ClientPayloadError once it runs past `limit` bytes."""
    chunks, size = [], 0
    async for chunk in response.content.iter_chunked(65536):
        size += len(chunk)
        if size > limit:
            raise aiohttp.ClientPayloadError(f"answer over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


_TIMED: dict[str, Callable[[list[str]], tuple[str, dict[str, Any]]]] = {
    "embed": lambda inputs: ("/embed", {"inputs": inputs}),
    "sparse": lambda inputs: ("/embed_sparse", {"inputs": inputs}),
    "rerank": lambda inputs: ("/rerank", {"query": inputs[0], "texts": inputs, "truncate": True}),
    "classify": lambda inputs: (
        "/predict",
        {"inputs": [[text] for text in inputs], "truncate": True},
    ),
}
"""The verification request of each task (gate.Verdict.verification: the server's
model_settings.task, or sparse for a SPLADE model); a pair is twice the text, so within the
input limit only truncated."""


class PodClient:
    """Plain HTTP to a pod's IP and port; one pooled session, opened on first use (in the
    event loop that uses it)."""

    def __init__(
        self,
        metrics: Metrics,
        timeout_seconds: float = 5.0,
        max_bytes: int = 1 << 20,
        max_concurrent_calls: int = 32,
    ) -> None:
        self._metrics = metrics
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        self._max_bytes = max_bytes
        self._slots = asyncio.Semaphore(max_concurrent_calls)
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(trust_env=False, timeout=self._timeout)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def get_json(self, host: str, port: int, path: str) -> tuple[int, Any]:
        """GET `path`: (status, parsed JSON, or None when the body is not JSON). Raises one of
        ERRORS when no whole answer came."""
        return await self._call("GET", host, port, path)

    async def post_json(self, host: str, port: int, path: str, body: Any) -> tuple[int, Any]:
        """POST `body` as JSON to `path`; as `get_json`."""
        return await self._call("POST", host, port, path, body)

    async def _call(
        self, method: str, host: str, port: int, path: str, body: Any = None
    ) -> tuple[int, Any]:
        async with self._slots:
            try:
                async with self._client().request(
                    method, f"http://{host}:{port}{path}", json=body
                ) as response:
                    raw = await read_capped(response, self._max_bytes)
                    status = response.status
            except ERRORS as error:
                self._count(path, type(error).__name__)
                raise
        self._count(path, str(status))
        try:
            return status, json.loads(raw) if raw else None
        except (ValueError, UnicodeDecodeError, RecursionError):
            return status, None

    async def time_request(
        self, host: str, port: int, inputs: list[str], task: str = "embed"
    ) -> float:
        """Milliseconds for one request of `inputs` to the route of the server's `task`
        (/embed; a re-ranker's /rerank, `inputs` the documents and the first the query; a
        classifier's /predict, each input alone); raises one of ERRORS when it fails (a
        status outside 2xx included)."""
        path, body = _TIMED.get(task, _TIMED["embed"])(inputs)
        async with self._slots:
            started = time.perf_counter()
            try:
                async with self._client().post(
                    f"http://{host}:{port}{path}", json=body
                ) as response:
                    await read_capped(response, self._max_bytes)
                    self._count(path, str(response.status))
                    response.raise_for_status()
            except ERRORS as error:
                if not isinstance(error, aiohttp.ClientResponseError):
                    self._count(path, type(error).__name__)
                raise
            return (time.perf_counter() - started) * 1000.0

    def _count(self, path: str, result: str) -> None:
        self._metrics.pod_calls.labels(path=path, result=result).inc()
