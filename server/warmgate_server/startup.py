"""Bringing the server up in the background, once the app has started: find (or download) the
model and load it, start the threads its plan asks for, build the engine, warm it, then report
ready. Each step moves the lifecycle's phase; a failure fails the start with its reason."""

from __future__ import annotations

import asyncio
import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import aiohttp

from warmgate_contract.report import DOWNLOADING, LOADING, READY, UNHEALTHY, WARMING

from .config import ServerConfig
from .context import WARMUP_HEADER, Runtime
from .cpus import ThreadPlan, plan_threads
from .engine import Engine
from .errors import ModelLoadError
from .lifecycle import Lifecycle
from .loading import LoadedModel, load_model
from .memory import ProcessProbe
from .model_folder import CLASSIFY, EMBED, RERANK
from .preflight import check_loading_fits
from .schemas import EmbedRequest, dumps, openai_response
from .settle import SettleRule
from .source import ModelSource, locate, needs_download, weights_bytes, weights_digest
from .warm_state import WarmState

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 1.0


async def bring_up(
    runtime: Runtime, preloaded: LoadedModel | None, rule: SettleRule | None
) -> None:
    """Load (unless `preloaded`), build the engine, warm it and turn ready; the lifecycle
    says failed, with the reason, when a step fails."""
    config, lifecycle = runtime.config, runtime.lifecycle
    assert runtime.model_threads and runtime.tokenizer_pool is not None
    try:
        loaded = preloaded if preloaded is not None else await _load(runtime)
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
        _start_threads(runtime, threads)
        engine = await _build_engine(runtime, loaded, threads)
        runtime.engine = engine
        runtime.tasks.append(asyncio.create_task(engine.run_batcher()))
        runtime.tasks.append(asyncio.create_task(_probe_while_unhealthy(runtime, engine)))
        if lifecycle.phase != LOADING:  # drained while loading
            return
        if config.warmup:
            if not await _warm(runtime, engine, rule):
                return
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


async def _load(runtime: Runtime) -> LoadedModel:
    """In the first model thread: locate the model (downloading it when the cache lacks it),
    check that loading fits the memory limit, load it."""
    config, lifecycle = runtime.config, runtime.lifecycle
    loop = asyncio.get_running_loop()
    source = await loop.run_in_executor(runtime.model_threads[0], _locate, config, lifecycle, loop)
    if lifecycle.phase == DOWNLOADING:
        lifecycle.enter(LOADING)
    check_loading_fits(
        ProcessProbe().limit(), weights_bytes(source.folder), Path(config.runtime_memory)
    )
    state = WarmState(Path(config.warm_state) if config.warm_state else None)
    # The weights' digest (a GiB a second, one core) is read beside the load, which leaves the
    # other cores idle; a restart takes it from the warm state.
    digest = loop.run_in_executor(None, weights_digest, source.folder, state)
    try:
        loaded = await loop.run_in_executor(
            runtime.model_threads[0], load_model, config, source, state
        )
    except BaseException:
        digest.cancel()
        raise
    loaded.source = replace(source, digest=await digest)
    if state.folder is not None:
        log.info(
            "warm state %s: reused %d file digests and %d kernel measurements of an earlier start",
            state.folder,
            state.hits["sha256"],
            state.hits["linear"],
        )
    return loaded


def _start_threads(runtime: Runtime, threads: ThreadPlan) -> None:
    """The model workers' threads past the first, and the tokenizer threads the plan asks
    for."""
    lifecycle = runtime.lifecycle
    lifecycle.workers, lifecycle.torch_threads = threads.workers, threads.threads
    for worker in range(len(runtime.model_threads), threads.workers):
        runtime.model_threads.append(
            ThreadPoolExecutor(1, thread_name_prefix=f"warmgate-model-{worker}")
        )
    if threads.tokenizers > 1:  # nothing has been tokenized yet: no request is served
        assert runtime.tokenizer_pool is not None
        single = runtime.tokenizer_pool
        runtime.tokenizer_pool = ThreadPoolExecutor(
            threads.tokenizers, thread_name_prefix="warmgate-tokenizer"
        )
        single.shutdown(wait=False)
    runtime.tokenization_workers = threads.tokenizers


async def _build_engine(runtime: Runtime, loaded: LoadedModel, threads: ThreadPlan) -> Engine:
    """The engine, built in the model thread: its file reads and the tiktoken load (a third
    of a second) would otherwise hold /healthz and /ready while the pod starts."""
    config, lifecycle = runtime.config, runtime.lifecycle
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
    return engine


async def _warm(runtime: Runtime, engine: Engine, rule: SettleRule | None) -> bool:
    """Warm the model's plan, then the serving path; False when the phase left warming
    meanwhile (draining, failed)."""
    lifecycle = runtime.lifecycle
    lifecycle.enter(WARMING)
    await engine.warm(lifecycle, rule)
    if not await _warm_http_path(runtime):  # no port of its own (in-process tests)
        await _warm_serving_path(engine)
    if lifecycle.phase != WARMING:
        return False
    log.info("warmed %d shapes in %.1fs", len(lifecycle.warmed), lifecycle.warmup_seconds or 0)
    return True


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
        return locate(config.model, config.model_revision, download=False, digest=False)

    def begin() -> None:
        if lifecycle.phase == LOADING:
            lifecycle.enter(DOWNLOADING)

    def progress(done: int, total: int) -> None:
        loop.call_soon_threadsafe(
            setattr, lifecycle, "download", {"done_bytes": done, "total_bytes": total}
        )

    loop.call_soon_threadsafe(begin)
    log.info("downloading %s at %s", config.model, config.model_revision)
    return locate(config.model, config.model_revision, progress, digest=False)


async def _warm_serving_path(engine: Engine) -> None:
    """Without HTTP warmup: one unrecorded request through tokenizer thread, batcher and
    response encoding, so the first user request pays for none of their first-use costs."""
    result = await engine.embed(EmbedRequest(["warm the serving path"], True), record=False)
    for as_base64 in (False, True):
        dumps(openai_response(result.output, "warmup", result.prompt_tokens, as_base64))


# Each task's routes, through both of its APIs where it has two.
_HTTP_WARMUP: dict[str, tuple[tuple[str, dict], ...]] = {
    EMBED: (
        ("/v1/embeddings", {"input": ["warm the http path", "and its batching"]}),
        ("/v1/embeddings", {"input": "warm the http path", "encoding_format": "base64"}),
        ("/embed", {"inputs": ["warm the http path"]}),
    ),
    RERANK: (
        ("/rerank", {"query": "warm the http path", "texts": ["a", "and its batching"]}),
        ("/v1/rerank", {"query": "warm the http path", "documents": [{"text": "a"}]}),
    ),
    CLASSIFY: (
        ("/predict", {"inputs": "warm the http path"}),
        ("/predict", {"inputs": [["warm the http path", "and a pair"], ["a batch"]]}),
    ),
}


async def _warm_http_path(runtime: Runtime) -> bool:
    """Real HTTP requests to this process's own port, through both APIs and both encodings:
    tokenizer thread, batcher, and the request parsing, validation, response building and
    metrics children that a user's first request would otherwise set up. Marked with the
    warmup token, so they count nowhere. False when it could not run them all (logged, not
    fatal: the model itself is warm)."""
    if runtime.self_url is None:
        return False
    headers = {WARMUP_HEADER: runtime.warmup_token}
    task = runtime.engine.settings.task if runtime.engine is not None else EMBED
    requests = _HTTP_WARMUP[task]
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
