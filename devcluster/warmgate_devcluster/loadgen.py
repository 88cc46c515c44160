"""A constant-rate HTTP load generator that records who answered each request.

Used by the end-to-end tests and `make bench-rollout`: it sends embedding requests at a fixed
rate (open loop: a slow answer does not slow the sender, as with real users), and keeps, per
request, the status, latency, and the server's `X-Warmgate-Revision`, `X-Warmgate-Cold` and
`X-Warmgate-Pod` headers. Only targets on this machine are accepted: loopback, or an address
inside the networks the caller names (a devcluster's node and pod networks).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import statistics
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp

from warmgate_contract.names import COLD_HEADER, POD_HEADER, REVISION_HEADER


@dataclass(frozen=True)
class Sample:
    started: float  # seconds since the load began
    latency_ms: float
    status: int  # 0 when the connection failed
    revision: str | None
    cold: bool | None
    pod: str | None
    error: str | None = None
    server_timing: dict[str, float] | None = None
    """Every Server-Timing metric with a duration, in ms (warmgate-server: tokenize, queue,
    model, model-cpu and embed, the total)."""
    vector: tuple[float, ...] | None = None
    """The first embedding's first components: which weights answered."""

    @property
    def ok(self) -> bool:
        return self.status == 200

    @property
    def server_ms(self) -> float | None:
        """The server's own time for the request, when it sent Server-Timing: the rest of
        `latency_ms` is the network path (client, proxy) and waiting to be scheduled."""
        return total_ms(self.server_timing)


def first_vector(body: bytes, size: int = 16) -> tuple[float, ...] | None:
    """The first `size` components of the first embedding of an OpenAI (`data[0].embedding`)
    or text-embeddings-inference (`[[...]]`) answer; None for anything else."""
    try:
        document = json.loads(body)
        vector = document["data"][0]["embedding"] if isinstance(document, dict) else document[0]
        return tuple(float(value) for value in vector[:size])
    except (ValueError, KeyError, IndexError, TypeError):
        return None


def server_timings(header: str | None) -> dict[str, float] | None:
    """The metrics of a Server-Timing header that carry a duration ("embed;dur=12.5" ->
    {"embed": 12.5}); None when there are none or a duration is not a number."""
    found: dict[str, float] = {}
    for metric in (header or "").split(","):
        name, *params = metric.strip().split(";")
        for param in params:
            key, _, value = param.strip().partition("=")
            if key == "dur":
                try:
                    found[name.strip()] = float(value)
                except ValueError:
                    return None
    return found or None


def total_ms(timings: dict[str, float] | None) -> float | None:
    """The server's total time: its `embed` metric (warmgate-server's whole request) when there
    is one, else the sum of every duration; None without any."""
    if timings is None:
        return None
    return timings["embed"] if "embed" in timings else sum(timings.values())


@dataclass
class LoadReport:
    samples: list[Sample] = field(default_factory=list)

    @property
    def failed(self) -> list[Sample]:
        return [s for s in self.samples if not s.ok]

    @property
    def cold(self) -> list[Sample]:
        return [s for s in self.samples if s.cold]

    def revisions_in_order(self) -> list[str]:
        """Distinct revisions in the order they first answered."""
        seen: list[str] = []
        for sample in sorted(self.samples, key=lambda s: s.started):
            if sample.revision and sample.revision not in seen:
                seen.append(sample.revision)
        return seen

    def between(self, start: float, end: float) -> list[Sample]:
        return [s for s in self.samples if start <= s.started < end]

    @staticmethod
    def percentile(samples: Iterable[Sample], q: float) -> float | None:
        latencies = sorted(s.latency_ms for s in samples if s.ok)
        if not latencies:
            return None
        if len(latencies) == 1:
            return latencies[0]
        return statistics.quantiles(latencies, n=100, method="inclusive")[int(q) - 1]


def check_local_target(url: str, networks: Iterable[str] = ()) -> None:
    """Refuse a target outside loopback and `networks`: load never leaves this machine."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return
    address = ipaddress.ip_address(host)
    if address.is_loopback or any(address in ipaddress.ip_network(n) for n in networks):
        return
    raise ValueError(
        f"load may only target loopback or {', '.join(networks) or 'no other network'}, not {host}"
    )


class ConstantRateLoad:
    """Send `rate` requests a second to `url` until stopped (or `max_seconds` pass).

    Runs its own event loop in a thread so that synchronous tests can drive it:
    `with ConstantRateLoad(url, rate=20) as load: ...; report = load.report`.
    """

    def __init__(
        self,
        url: str,
        rate: float = 20.0,
        payload: dict | None = None,
        timeout_seconds: float = 30.0,
        max_seconds: float = 900.0,
        networks: Iterable[str] = (),
    ) -> None:
        check_local_target(url, networks)
        self.url = url
        self.rate = rate
        self.payload = payload or {"input": "warm models answer fast", "model": None}
        if self.payload.get("model") is None:
            self.payload = {k: v for k, v in self.payload.items() if k != "model"}
        self.timeout_seconds = timeout_seconds
        self.max_seconds = max_seconds
        self.report = LoadReport()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self.started_wall = 0.0

    def elapsed(self) -> float:
        return time.monotonic() - self._t0

    def __enter__(self) -> ConstantRateLoad:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self._t0 = time.monotonic()
        # Wall clock at the start, to set samples beside Kubernetes' timestamps.
        self.started_wall = time.time()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self._thread.start()

    def stop(self) -> LoadReport:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_seconds + 10)
        return self.report

    async def _one(self, session: aiohttp.ClientSession, started: float) -> None:
        begin = time.perf_counter()
        try:
            async with session.post(self.url, json=self.payload) as response:
                body = await response.read()
                cold = response.headers.get(COLD_HEADER)
                sample = Sample(
                    started=started,
                    latency_ms=(time.perf_counter() - begin) * 1000.0,
                    status=response.status,
                    revision=response.headers.get(REVISION_HEADER),
                    cold=None if cold is None else cold == "1",
                    pod=response.headers.get(POD_HEADER),
                    server_timing=server_timings(response.headers.get("Server-Timing")),
                    vector=first_vector(body) if response.status == 200 else None,
                )
        except (aiohttp.ClientError, TimeoutError, OSError) as error:
            sample = Sample(
                started=started,
                latency_ms=(time.perf_counter() - begin) * 1000.0,
                status=0,
                revision=None,
                cold=None,
                pod=None,
                error=f"{type(error).__name__}: {error}",
            )
        self.report.samples.append(sample)

    async def _main(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.timeout_seconds)
        # A fresh connection per request, like many independent clients behind the Service:
        # a kept-alive connection would pin one backend and hide a rollout's switch-over.
        connector = aiohttp.TCPConnector(force_close=True)
        tasks: set[asyncio.Task] = set()
        async with aiohttp.ClientSession(
            timeout=timeout, connector=connector, trust_env=False
        ) as session:
            interval = 1.0 / self.rate
            next_at = time.monotonic()
            while not self._stop.is_set() and self.elapsed() < self.max_seconds:
                now = time.monotonic()
                if now < next_at:
                    await asyncio.sleep(next_at - now)
                    continue
                task = asyncio.create_task(self._one(session, self.elapsed()))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                next_at += interval
            if tasks:
                with contextlib.suppress(Exception):
                    await asyncio.gather(*tasks)
