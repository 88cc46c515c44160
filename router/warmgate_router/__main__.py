"""`python -m warmgate_router`: watch the names and endpoints, then serve.

On SIGTERM /ready turns 503 at once, requests keep being served for --drain-seconds (while the
Service's endpoints drop this pod), then the listener closes and requests in flight finish."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
import time
from collections.abc import Sequence

from warmgate_kube.client import KubeClient
from warmgate_kube.watch import Reflector, WatchSettings

from .config import RouterConfig, parse_args
from .metrics import Metrics
from .proxy import Router, build_server
from .view import ALIASES, SERVICES, SLICE_SELECTOR, SLICES, View

log = logging.getLogger("warmgate.router")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(config: RouterConfig) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if config.log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=config.log_level, handlers=[handler], force=True)


USER_AGENT = "warmgate-router"
WATCH = WatchSettings(backoff_initial_seconds=0.5, backoff_max_seconds=10.0)
"""A router without its names and endpoints serves nothing: it tries again sooner than the
operator does."""


def reflectors(kube: KubeClient, view: View, namespaces: Sequence[str]) -> list[Reflector]:
    scopes: Sequence[str | None] = namespaces or (None,)
    return [
        Reflector(
            kube,
            view.store(kind),
            view.take,
            namespace,
            selector,
            WATCH,
            optional=kind is ALIASES,
        )
        for namespace in scopes
        for kind, selector in ((SERVICES, ""), (ALIASES, ""), (SLICES, SLICE_SELECTOR))
    ]


async def serve(config: RouterConfig, drain_seconds: float = 5.0) -> None:
    # Two request threads: the router's only writes are a last-request stamp now and then
    # and a scale from zero.
    kube = KubeClient.from_environment(USER_AGENT, max_threads=2)
    view = View()
    metrics = Metrics()
    router = Router(config, view, kube, metrics)
    server = build_server(router)
    await server.start(config.host, config.port)
    log.info(
        "warmgate-router listening on %s:%d, namespaces %s",
        config.host,
        config.port,
        ",".join(config.namespaces) or "*",
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    watching = reflectors(kube, view, config.namespaces)
    tasks = [asyncio.create_task(r.run(), name=f"watch {r}") for r in watching]
    started = time.monotonic()

    async def synced() -> None:
        await asyncio.gather(*(r.synced.wait() for r in watching))
        router.synced.set()
        log.info("names and endpoints listed in %.2fs", time.monotonic() - started)

    tasks.append(asyncio.create_task(synced()))
    await stop.wait()
    log.info("stopping: not ready, serving for %.0fs more", drain_seconds)
    router.draining = True
    await asyncio.sleep(drain_seconds)
    # Held requests end now (the hold loop sees it within its 0.25 s poll) with a 503 and
    # Retry-After; server.shutdown() below waits for their answers to be written.
    router.stopping = True
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await server.shutdown()
    await router.close()
    await kube.aclose()


def main(argv: Sequence[str] | None = None) -> None:
    config = parse_args(argv)
    setup_logging(config)
    asyncio.run(serve(config, config.drain_seconds))


if __name__ == "__main__":
    main()
