"""The aiohttp application factory and its lifecycle: threads, model load, warmup, draining."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
from aiohttp import web

from warmgate_contract.report import DOWNLOADING, DRAINING, LOADING, READY, UNHEALTHY, WARMING
from warmgate_contract.shapes import plan_warmup

from . import draining, faults
from .config import ServerConfig
from .context import RUNTIME, WARMUP_HEADER, Runtime
from .cpus import plan_threads
from .engine import Engine
from .errors import MemoryExceeded, ModelLoadError
from .lifecycle import Lifecycle
from .loading import LoadedModel, load_model
from .memory import RUNTIME_FILE, Limit, ProcessProbe, loading_need
from .metrics import Metrics
from .routes import add_routes, count_requests
from .schemas import EmbedRequest, dumps, openai_response
from .source import ModelSource, locate, needs_download, weights_bytes
from .warmup import SettleRule

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 1.0


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
        pod_name=os.environ.get("POD_NAME") or socket.gethostname(),
    )
    if faults.enabled():
        runtime.faults = faults.FaultInjector()
        log.warning("%s is set: POST /debug/faults can make the model fail", faults.ENV)
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
        runtime.tasks.append(asyncio.create_task(_start(runtime, preloaded, settle_rule)))
        yield
        for task in runtime.tasks:
            task.cancel()
        await asyncio.gather(*runtime.tasks, return_exceptions=True)

    return context


async def _start(runtime: Runtime, preloaded: LoadedModel | None, rule: SettleRule | None) -> None:
    config, lifecycle = runtime.config, runtime.lifecycle
    assert runtime.model_threads and runtime.tokenizer_pool is not None
    try:
        loaded = preloaded
        if loaded is None:
            loop = asyncio.get_running_loop()
            source = await loop.run_in_executor(
                runtime.model_threads[0], _locate, config, lifecycle, loop
            )
            if lifecycle.phase == DOWNLOADING:
                lifecycle.enter(LOADING)
            check_loading_fits(ProcessProbe().limit(), weights_bytes(source.folder))
            loaded = await loop.run_in_executor(
                runtime.model_threads[0], load_model, config, source
            )
        lifecycle.commit = loaded.source.commit
        lifecycle.weights_digest = loaded.source.digest
        log.info(
            "model %s: commit %s, weights %s, from %s",
            config.model,
            loaded.source.commit or "(a plain folder)",
            loaded.source.digest,
            loaded.source.folder,
        )
        threads = plan_threads(config, loaded.device.type)
        lifecycle.workers, lifecycle.torch_threads = threads.workers, threads.threads
        for worker in range(len(runtime.model_threads), threads.workers):
            runtime.model_threads.append(
                ThreadPoolExecutor(1, thread_name_prefix=f"warmgate-model-{worker}")
            )
        if threads.tokenizers > 1:  # nothing has been tokenized yet: no request is served
            single = runtime.tokenizer_pool
            runtime.tokenizer_pool = ThreadPoolExecutor(
                threads.tokenizers, thread_name_prefix="warmgate-tokenizer"
            )
            single.shutdown(wait=False)
        runtime.tokenization_workers = threads.tokenizers
        # Built in the model thread: its file reads and the tiktoken load (a third of a second)
        # would otherwise hold /healthz and /ready while the pod starts.
        engine = await asyncio.get_running_loop().run_in_executor(
            runtime.model_threads[0],
            functools.partial(
                Engine,
                config,
                loaded,
                runtime.plan,
                runtime.metrics,
                runtime.model_threads,
                runtime.tokenizer_pool,
                on_fault=lifecycle.model_fault,
                on_success=lifecycle.model_ok,
                faults=runtime.faults,
                solo_threads=threads.solo_threads,
            ),
        )
        lifecycle.device, lifecycle.dtype = loaded.device_name, loaded.dtype_name
        lifecycle.model_settings = engine.settings.as_json()
        lifecycle.forward = engine.workers.forward_report
        log.info(
            "pooling %s (%s), normalize %s (%s)",
            engine.settings.pooling,
            engine.settings.chosen_by["pooling"],
            engine.settings.normalize,
            engine.settings.chosen_by["normalize"],
        )
        runtime.engine = engine
        runtime.tasks.append(asyncio.create_task(engine.run_batcher()))
        runtime.tasks.append(asyncio.create_task(_probe_while_unhealthy(runtime, engine)))
        if lifecycle.phase != LOADING:  # drained while loading
            return
        if config.warmup:
            lifecycle.enter(WARMING)
            await engine.warm(lifecycle, rule)
            if not await _warm_http_path(runtime):  # no port of its own (in-process tests)
                await _warm_serving_path(engine)
            if lifecycle.phase != WARMING:
                return
            log.info(
                "warmed %d shapes in %.1fs", len(lifecycle.warmed), lifecycle.warmup_seconds or 0
            )
        else:
            await engine.workers.export_onnx(engine.memory)  # --backend onnxruntime
            log.warning("warmup is off: the first request of each shape will be cold")
        lifecycle.enter(READY)
        log.info("ready")
    except asyncio.CancelledError:
        raise
    except ModelLoadError as exc:
        log.error("cannot start: %s", exc)
        lifecycle.fail(str(exc), exc.reason, exc.restartable)
    except Exception as exc:
        log.exception("startup failed")
        lifecycle.fail(f"{type(exc).__name__}: {exc}")


async def _probe_while_unhealthy(runtime: Runtime, engine: Engine) -> None:
    """While unhealthy, one small request a second through the batcher: with no traffic (the
    pod is out of the endpoints) this is what finds the model working again, or keeps it
    failing until /healthz fails and kubelet restarts the container."""
    lifecycle = runtime.lifecycle
    while True:
        await asyncio.sleep(PROBE_INTERVAL_S)
        if lifecycle.phase != UNHEALTHY:
            continue
        try:
            async with asyncio.timeout(runtime.config.forward_timeout + PROBE_INTERVAL_S):
                await engine.embed(EmbedRequest(["warmgate health probe"], True), record=False)
        except Exception as exc:
            log.warning("health probe failed: %s", exc)
        else:
            log.info("health probe succeeded: phase %s", lifecycle.phase)


def _locate(config: ServerConfig, lifecycle: Lifecycle, loop) -> ModelSource:
    """In the model thread: find the files, downloading them first when the cache lacks the
    revision; the phase says `downloading` and the report counts the bytes meanwhile."""
    if not needs_download(config.model, config.model_revision):
        return locate(config.model, config.model_revision, download=False)

    def begin() -> None:
        if lifecycle.phase == LOADING:
            lifecycle.enter(DOWNLOADING)

    def progress(done: int, total: int) -> None:
        loop.call_soon_threadsafe(
            setattr, lifecycle, "download", {"done_bytes": done, "total_bytes": total}
        )

    loop.call_soon_threadsafe(begin)
    log.info("downloading %s at %s", config.model, config.model_revision)
    return locate(config.model, config.model_revision, progress)


def check_loading_fits(limit: Limit, weights: int, runtime_file: Path = RUNTIME_FILE) -> None:
    """MemoryExceeded when the container's limit is below what loading takes (the image's
    measured runtime and the weights): said at once, before torch is imported, where it
    would otherwise be killed, restarted and killed again."""
    need = loading_need(weights, runtime_file)
    if need is None or limit.bytes is None or need[0] <= limit.bytes:
        return
    size, how = need
    raise MemoryExceeded(
        f"loading needs about {size / 2**30:.2f} GiB ({how}), above the limit of "
        f"{limit.bytes / 2**30:.2f} GiB ({limit.source}). To change it: raise "
        f"resources.limits.memory (to at least {size / 2**30 * 1.5:.2f} GiB, to warm a plan too)"
    )


async def _warm_serving_path(engine: Engine) -> None:
    """Without HTTP warmup: one unrecorded request through tokenizer thread, batcher and
    response encoding, so the first user request pays for none of their first-use costs."""
    result = await engine.embed(EmbedRequest(["warm the serving path"], True), record=False)
    for as_base64 in (False, True):
        dumps(openai_response(result.output, "warmup", result.prompt_tokens, as_base64))


async def _warm_http_path(runtime: Runtime) -> bool:
    """Real HTTP requests to this process's own port, through both APIs and both encodings:
    tokenizer thread, batcher, and the request parsing, validation, response building and
    metrics children that a user's first request would otherwise set up. Marked with the
    warmup token, so they count nowhere. False when it could not run them all (logged, not
    fatal: the model itself is warm)."""
    if runtime.self_url is None:
        return False
    headers = {WARMUP_HEADER: runtime.warmup_token}
    requests = (
        ("/v1/embeddings", {"input": ["warm the http path", "and its batching"]}),
        ("/v1/embeddings", {"input": "warm the http path", "encoding_format": "base64"}),
        ("/embed", {"inputs": ["warm the http path"]}),
    )
    timeout = aiohttp.ClientTimeout(total=30)
    try:
        async with aiohttp.ClientSession(runtime.self_url, timeout=timeout) as session:
            for path, body in requests:
                async with session.post(path, json=body, headers=headers) as response:
                    await response.read()
                    if response.status != 200:
                        log.warning("HTTP warmup %s answered %d", path, response.status)
                        return False
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        log.warning("HTTP warmup through %s failed: %s", runtime.self_url, exc)
        return False
    log.info("HTTP path warm: %d requests through %s", len(requests), runtime.self_url)
    return True


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
