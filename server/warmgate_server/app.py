"""The aiohttp application factory (`create_app`): the app, its routes and middlewares, and one
cleanup context per resource (the threads; the background bring-up, startup.py), and draining."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from warmgate_contract.report import DRAINING
from warmgate_contract.shapes import plan_warmup

from . import draining, faults
from .config import ServerConfig
from .context import RUNTIME, Runtime
from .lifecycle import Lifecycle
from .loading import LoadedModel
from .metrics import Metrics
from .routes import add_routes, count_requests
from .settle import SettleRule
from .startup import bring_up

log = logging.getLogger(__name__)


def create_app(
    config: ServerConfig,
    *,
    preloaded: LoadedModel | None = None,
    settle_rule: SettleRule | None = None,
) -> web.Application:
    """Build the app. Loading and warmup start in the background once it starts up.

    `preloaded` lets several apps in one process (tests) share one model in memory; each app
    still tracks its own executed shapes and warms its own plan.
    """
    plan = plan_warmup(
        config.warmup_batch_sizes,
        config.sequence_buckets,
        config.max_batch_tokens,
        config.max_batch_size,
        config.profile_shapes,
    )
    for shape in plan.ignored_profile_shapes:
        log.warning("warmup profile shape %s cannot occur with this configuration", shape.key)
    metrics = Metrics()
    lifecycle = Lifecycle(
        model_id=config.model,
        revision=config.model_revision,
        served_name=config.effective_served_name,
        device=config.device,
        dtype=config.dtype,
        planned=plan.shapes,
        on_phase=metrics.set_phase,
        fault_threshold=config.fault_threshold,
        fault_restart_seconds=config.fault_restart_seconds,
    )
    runtime = Runtime(
        config=config,
        lifecycle=lifecycle,
        metrics=metrics,
        plan=plan.shapes,
        pod_name=config.pod_name or socket.gethostname(),
    )
    if config.fault_injection:
        runtime.faults = faults.FaultInjector()
        log.warning("--fault-injection is on: POST /debug/faults can make the model fail")
    app = web.Application(
        client_max_size=config.payload_limit,
        middlewares=[
            count_requests,
            draining.middleware(
                runtime.connections, lambda: lifecycle.phase == DRAINING or runtime.standby
            ),
        ],
    )
    app[RUNTIME] = runtime
    app.cleanup_ctx.append(_threads)
    app.cleanup_ctx.append(_bring_up(preloaded, settle_rule))
    add_routes(app)
    return app


async def _threads(app: web.Application) -> AsyncIterator[None]:
    """The first model thread (it loads the model; the other workers' threads start once the
    thread plan is known) and one tokenizer thread."""
    runtime = app[RUNTIME]
    runtime.model_threads = [ThreadPoolExecutor(1, thread_name_prefix="warmgate-model-0")]
    runtime.tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="warmgate-tokenizer")
    yield
    # A forward pass in progress cannot be interrupted; do not wait for it here.
    for executor in runtime.model_threads:
        executor.shutdown(wait=False, cancel_futures=True)
    runtime.tokenizer_pool.shutdown(wait=False, cancel_futures=True)


def _bring_up(preloaded: LoadedModel | None, settle_rule: SettleRule | None):
    async def context(app: web.Application) -> AsyncIterator[None]:
        runtime = app[RUNTIME]
        runtime.tasks.append(asyncio.create_task(bring_up(runtime, preloaded, settle_rule)))
        yield
        for task in runtime.tasks:
            task.cancel()
        await asyncio.gather(*runtime.tasks, return_exceptions=True)

    return context


async def drain(app: web.Application, seconds: float, server: web.Server | None = None) -> bool:
    """Turn /ready 503 now; then, for at most `seconds`, finish in-flight and queued work and
    let `server`'s keep-alive connections close (draining.py)."""
    runtime = app[RUNTIME]
    runtime.lifecycle.begin_drain()
    deadline = time.monotonic() + seconds
    return await draining.close_connections(
        server, runtime.connections, lambda: runtime.idle, deadline
    )


__all__ = ["DRAINING", "create_app", "drain"]
