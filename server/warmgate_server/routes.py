"""HTTP routes: schemas and status codes in, one engine call, response out."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable

import numpy as np
from aiohttp import web

from warmgate_contract.names import COLD_HEADER, POD_HEADER, REVISION_HEADER

from . import __version__
from .context import RUNTIME, Runtime
from .engine import finish_vectors
from .errors import ApiError, InputTooLong, QueueFull, validation
from .metrics import CONTENT_TYPE
from .schemas import EmbedRequest, Limits, dumps, openai_response, parse_openai, parse_tei

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def count_requests(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every request counted and timed by endpoint and status."""
    started = time.perf_counter()
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as exc:
        status = exc.status
        raise
    finally:
        resource = request.match_info.route.resource
        endpoint = resource.canonical if resource is not None else "unmatched"
        runtime = request.app[RUNTIME]
        if not runtime.is_warmup(request):  # the server's own warmup requests are not traffic
            metrics = runtime.metrics
            metrics.http_requests.labels(endpoint=endpoint, status=str(status)).inc()
            metrics.http_duration.labels(endpoint=endpoint, status=str(status)).observe(
                time.perf_counter() - started
            )


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    lifecycle = request.app[RUNTIME].lifecycle
    return web.json_response(lifecycle.report(), status=200 if lifecycle.is_ready else 503)


async def info(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    config, engine = runtime.config, runtime.engine
    return web.json_response(
        {
            "model_id": config.model,
            "model_revision": config.model_revision,
            # text-embeddings-inference's name for the commit the weights are from.
            "model_sha": runtime.lifecycle.commit,
            "weights_digest": runtime.lifecycle.weights_digest,
            "served_model_name": config.effective_served_name,
            "version": __version__,
            "phase": runtime.lifecycle.phase,
            "device": runtime.lifecycle.device,
            "dtype": runtime.lifecycle.dtype,
            "pooling": engine.settings.pooling if engine else config.pooling,
            "normalize": engine.settings.normalize if engine else config.normalize,
            "model_settings": engine.settings.as_json() if engine else None,
            "hidden_size": engine.hidden_size if engine else None,
            "max_input_length": engine.max_input_length if engine else None,
            "max_client_batch_size": config.max_batch_size,
            "max_batch_tokens": config.max_batch_tokens,
            "max_concurrent_requests": config.max_concurrent_requests,
            "sequence_buckets": list(config.sequence_buckets),
            "pad_batch": config.pad_batch,
            "packed": engine.packed if engine else None,
            "workers": runtime.lifecycle.workers,
            "torch_threads": runtime.lifecycle.torch_threads,
            "planned_shapes": [shape.as_json() for shape in runtime.plan],
        }
    )


async def models(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    created = int(runtime.lifecycle.started_at.timestamp())
    entry = {
        "id": runtime.config.effective_served_name,
        "object": "model",
        "created": created,
        "owned_by": "warmgate",
        "root": runtime.config.model,
    }
    return web.json_response({"object": "list", "data": [entry]})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[RUNTIME].metrics.render()
    response = web.Response(body=body)
    response.headers["Content-Type"] = CONTENT_TYPE
    return response


async def warmup_profile(request: web.Request) -> web.Response:
    engine = request.app[RUNTIME].engine
    return web.json_response(engine.profile() if engine else {"shapes": []})


async def _read_json(request: web.Request, limit: int) -> object:
    too_large = ApiError(
        413,
        f"the request body is over the limit of {limit} bytes: send fewer or shorter texts",
        "validation",
        "payload_too_large",
    )
    if request.content_length is not None and request.content_length > limit:
        raise too_large
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_large from None
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        message = f"the body is not valid JSON: {exc}"
        raise ApiError(400, message, "validation", "invalid_json") from None


def _limits(runtime: Runtime) -> Limits:
    config = runtime.config
    assert runtime.engine is not None
    return Limits(
        max_inputs=config.max_batch_size,
        hidden_size=runtime.engine.hidden_size,
        model_names={config.effective_served_name, config.model},
        default_normalize=runtime.engine.settings.normalize,
    )


async def _embed(
    request: web.Request,
    parse: Callable[[object, Limits], EmbedRequest],
    render: Callable[[Runtime, EmbedRequest, object], object],
    error_body: Callable[[ApiError], dict[str, object]],
) -> web.Response:
    runtime = request.app[RUNTIME]
    started = time.perf_counter()
    headers = {
        REVISION_HEADER: runtime.config.model_revision,
        POD_HEADER: runtime.pod_name,
        COLD_HEADER: "0",
    }
    warmup = runtime.is_warmup(request)
    try:
        engine = runtime.admit(warmup)
    except ApiError as err:
        return web.json_response(error_body(err), status=err.status, headers=headers)
    try:
        parsed = parse(await _read_json(request, runtime.config.payload_limit), _limits(runtime))
        try:
            result = await engine.embed(
                parsed.texts, parsed.truncate, parsed.truncate_left, record=not warmup
            )
        except InputTooLong as exc:
            raise validation(
                f"input {exc.index} has {exc.length} tokens, above the limit of {exc.limit}: "
                "shorten it" + (" or send truncate=true" if parse is parse_tei else ""),
                "input_too_long",
            ) from None
        except QueueFull:
            message = "overloaded: the queue is full; retry later"
            raise ApiError(429, message, "overloaded", "overloaded") from None
        vectors = finish_vectors(result.vectors, parsed.dimensions, parsed.normalize)
        headers[COLD_HEADER] = "1" if result.cold else "0"
        encoded = dumps(render(runtime, parsed, (vectors, result.prompt_tokens)))
        seconds = time.perf_counter() - started
        if not warmup:
            runtime.metrics.embedding_duration.labels(
                endpoint=request.path, phase="cold" if result.cold else "warm"
            ).observe(seconds)
        # The server's own share of the client's latency (the rest is network and proxies),
        # and where it went.
        headers["Server-Timing"] = result.timing.server_timing(seconds)
        return web.Response(body=encoded, content_type="application/json", headers=headers)
    except ApiError as err:
        return web.json_response(error_body(err), status=err.status, headers=headers)
    except Exception as exc:
        log.exception("embedding request failed")
        err = ApiError(500, f"internal error: {type(exc).__name__}", "backend", "internal_error")
        return web.json_response(error_body(err), status=500, headers=headers)
    finally:
        runtime.release()


def _render_openai(runtime: Runtime, parsed: EmbedRequest, result: object) -> object:
    vectors, prompt_tokens = result  # type: ignore[misc]
    return openai_response(
        vectors, runtime.config.effective_served_name, prompt_tokens, parsed.base64
    )


def _render_tei(runtime: Runtime, parsed: EmbedRequest, result: object) -> object:
    vectors, _prompt_tokens = result  # type: ignore[misc]
    return np.ascontiguousarray(vectors, dtype=np.float32)


async def openai_embeddings(request: web.Request) -> web.Response:
    return await _embed(request, parse_openai, _render_openai, ApiError.openai_body)


async def tei_embed(request: web.Request) -> web.Response:
    return await _embed(request, parse_tei, _render_tei, ApiError.tei_body)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/ready", ready)
    app.router.add_get("/info", info)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/warmup/profile", warmup_profile)
    app.router.add_post("/v1/embeddings", openai_embeddings)
    app.router.add_post("/embed", tei_embed)
