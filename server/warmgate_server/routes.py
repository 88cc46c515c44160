"""HTTP routes: schemas and status codes in, one engine call, response out."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

import numpy as np
from aiohttp import web

from warmgate_contract.names import (
    COLD_HEADER,
    POD_HEADER,
    REVISION_HEADER,
    ROLE_PATH,
    ROLE_SERVING,
    ROLE_STANDBY,
)

from . import __version__, post
from .config import ServerConfig
from .context import RUNTIME, Runtime
from .draining import CLOSE_AFTER, close_connections
from .engine import Engine, Result
from .errors import (
    InputTooLong,
    InvalidTokenIds,
    ModelFault,
    NotAPair,
    QueueFull,
    Refused,
    validation,
)
from .metrics import CONTENT_TYPE
from .model_folder import CLASSIFY, EMBED, RERANK
from .ranking import (
    PredictRequest,
    RankRequest,
    parse_cohere_rerank,
    parse_predict,
    parse_rerank,
    predict_answer,
    rerank_answer,
)
from .schemas import (
    EmbedRequest,
    Limits,
    exact_floats,
    json_pieces,
    needs,
    openai_response,
    parse_flag,
    parse_id_lists,
    parse_multi,
    parse_object,
    parse_openai,
    parse_prompt_name,
    parse_similarity,
    parse_strings,
    parse_tei,
    parse_tei_sparse,
    parse_tei_tokens,
)

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
    except asyncio.CancelledError:
        # The client went away and aiohttp cancelled its handler: no answer was written, and it
        # is no server fault (nginx's 499, "client closed request"), so not counted as a 500.
        status = 499
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
    """Liveness: the process answers, and the model has not been failing for longer than
    --fault-restart-seconds (then kubelet restarts the container)."""
    lifecycle = request.app[RUNTIME].lifecycle
    if lifecycle.live:
        return web.json_response({"status": "ok"})
    body = {"status": "unhealthy", "phase": lifecycle.phase, "error": lifecycle.error}
    return web.json_response(body, status=503)


async def ready(request: web.Request) -> web.Response:
    lifecycle = request.app[RUNTIME].lifecycle
    return web.json_response(lifecycle.report(), status=200 if lifecycle.is_ready else 503)


async def started(request: web.Request) -> web.Response:
    """The startup probe: 200 once the start has ended, warm or failed for good (then /ready
    stays 503 and says why, and kubelet does not restart the container into the same failure);
    503 while it downloads, loads or warms."""
    lifecycle = request.app[RUNTIME].lifecycle
    return web.json_response({"phase": lifecycle.phase}, status=200 if lifecycle.started else 503)


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
            "max_client_batch_size": config.max_client_batch_size,
            "auto_truncate": config.auto_truncate,
            "trust_remote_code": config.trust_remote_code,
            "openai_token_ids": config.openai_token_ids,
            # text-embeddings-inference's own names for what is reported above.
            "model_dtype": runtime.lifecycle.dtype,
            "model_type": _model_type(engine, config),
            "max_batch_requests": config.max_batch_size,
            "tokenization_workers": runtime.tokenization_workers,
            "sha": None,
            "docker_label": None,
            "max_batch_tokens": config.max_batch_tokens,
            "max_concurrent_requests": config.max_concurrent_requests,
            "sequence_buckets": list(config.sequence_buckets),
            "pad_batch": config.pad_batch,
            "packed": engine.packed if engine else None,
            "forward": engine.workers.forward_report() if engine else None,
            "workers": runtime.lifecycle.workers,
            "torch_threads": runtime.lifecycle.torch_threads,
            "planned_shapes": [shape.as_json() for shape in runtime.plan],
        }
    )


def _model_type(engine: Engine | None, config: ServerConfig) -> dict[str, object]:
    """TEI's /info model_type: {"embedding": {"pooling"}}, {"reranker": {"id2label",
    "label2id"}} or {"classifier": {...}}."""
    if engine is None or engine.settings.task == EMBED:
        return {
            "embedding": {
                "pooling": engine.settings.pooling if engine else config.pooling or "mean"
            }
        }
    labels = engine.settings.labels
    kind = "reranker" if engine.settings.task == RERANK else "classifier"
    return {
        kind: {
            "id2label": {str(index): label for index, label in enumerate(labels)},
            "label2id": {label: index for index, label in enumerate(labels)},
        }
    }


async def models(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    created = int(runtime.lifecycle.started_at.timestamp())
    entry = {
        "id": runtime.config.effective_served_name,
        "object": "model",
        "created": created,
        "owned_by": "warmgate",
        "root": runtime.config.model,
        # What the model does (embed, rerank, classify) and gives (dense, sparse, colbert),
        # once its folder has been read.
        "task": runtime.engine.settings.task if runtime.engine is not None else None,
        "outputs": list(runtime.engine.settings.outputs) if runtime.engine is not None else None,
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


async def role(request: web.Request) -> web.Response:
    """The role the operator gave this pod (spec.standbyReplicas): GET reads it, POST
    `{"role": "serving" | "standby"}` sets it. A standby pod is outside the Service; from now
    on its responses close their connections and its idle keep-alive connections are closed
    (draining.py's rules, without /ready changing), so pooled clients reconnect through the
    Service. Serving again: connections are kept as usual."""
    runtime = request.app[RUNTIME]
    if request.method == "POST":
        try:
            body = await _read_json(request, 4096)
        except Refused as error:
            return web.json_response({"error": error.message}, status=error.status)
        wanted = body.get("role") if isinstance(body, dict) else None
        if wanted not in (ROLE_SERVING, ROLE_STANDBY):
            message = f'the body must be {{"role": "{ROLE_SERVING}" or "{ROLE_STANDBY}"}}'
            return web.json_response({"error": message}, status=422)
        standby = wanted == ROLE_STANDBY
        if standby != runtime.standby:
            log.info("role: %s", wanted)
        runtime.standby = standby
        if standby and runtime.http_server is not None and runtime.standby_closer is None:
            runtime.standby_closer = asyncio.create_task(_close_while_standby(runtime))
    return web.json_response({"role": ROLE_STANDBY if runtime.standby else ROLE_SERVING})


async def _close_while_standby(runtime: Runtime) -> None:
    try:
        await close_connections(
            runtime.http_server,
            runtime.connections,
            idle=lambda: True,
            deadline=float("inf"),
            stop=lambda: not runtime.standby,
        )
    finally:
        runtime.standby_closer = None


async def _read_json(request: web.Request, limit: int) -> object:
    too_large = Refused(
        413,
        f"the request body is over the limit of {limit} bytes: send fewer or shorter texts",
        "validation",
        "payload_too_large",
    )
    if request.content_length is not None and request.content_length > limit:
        raise too_large
    seconds = request.app[RUNTIME].config.body_timeout
    try:
        async with asyncio.timeout(seconds):
            raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_large from None
    except web.RequestPayloadError as exc:
        # aiohttp could not decode the body: bytes that are not in the Content-Encoding
        # (gzip, deflate) the request names. The client's fault, so a 400, not a 500; the rest
        # of the body cannot be read either, so this connection carries no other request.
        request[CLOSE_AFTER] = True
        reason = getattr(exc.__cause__, "message", None) or str(exc)
        message = f"the body cannot be read: {reason}"
        raise Refused(400, message, "validation", "invalid_body") from None
    except TimeoutError:
        # The rest of the body is still on its way: this connection cannot carry another.
        request[CLOSE_AFTER] = True
        raise Refused(
            408,
            f"the request body did not arrive within {seconds:g}s (--body-timeout)",
            "validation",
            "body_timeout",
        ) from None
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        message = f"the body is not valid JSON: {exc}"
        raise Refused(400, message, "validation", "invalid_json") from None
    except RecursionError:
        message = "the body nests JSON too deeply to read: send a flat object"
        raise Refused(400, message, "validation", "invalid_json") from None


@dataclass(frozen=True)
class Api:
    """How an API answers: its error bodies and statuses, and what it tells a client whose
    input is too long."""

    error_body: Callable[[Refused], dict[str, object]]
    status_of: Callable[[Refused], int]
    too_long_hint: str

    def error(self, err: Refused, headers: dict[str, str]) -> web.Response:
        return web.json_response(self.error_body(err), status=self.status_of(err), headers=headers)


OPENAI = Api(Refused.openai_body, lambda err: err.openai_status, "")
TEI = Api(Refused.tei_body, lambda err: err.status, " or send truncate=true")
TEI_SIMILARITY = replace(TEI, too_long_hint=" or send parameters.truncate=true")

Parse = Callable[[object, Limits], EmbedRequest]
Render = Callable[[Runtime, EmbedRequest, Result], object]


def _failed_batch(fault: ModelFault) -> Refused:
    if fault.hung:
        return Refused(504, f"the model did not answer: {fault}", "backend", "model_timeout")
    return Refused(
        503, f"the model failed on this request ({fault}); retry", "backend", "model_fault"
    )


async def _answer(
    runtime: Runtime, engine: Engine, parsed: EmbedRequest, warmup: bool, api: Api
) -> Result:
    """The pipeline's answer to `parsed` within --request-timeout, its failures as the API's
    errors."""
    timeout = runtime.config.request_timeout
    try:
        async with asyncio.timeout(timeout):
            return await engine.embed(parsed, record=not warmup)
    except TimeoutError:
        raise Refused(
            504,
            f"no answer within {timeout:g}s (--request-timeout): the server is overloaded "
            "or its model is stuck; retry",
            "backend",
            "timeout",
        ) from None
    except ModelFault as fault:
        raise _failed_batch(fault) from None
    except InvalidTokenIds as exc:
        raise validation(str(exc), "invalid_token_ids", "input") from None
    except NotAPair as exc:
        raise validation(str(exc), "not_a_pair", "input") from None
    except InputTooLong as exc:
        raise validation(
            f"input {exc.index} has {exc.length} tokens, above the limit of {exc.limit}: "
            f"shorten it{api.too_long_hint} (the server truncates instead with --auto-truncate)",
            "input_too_long",
        ) from None
    except QueueFull:
        message = "overloaded: the queue is full; retry later"
        raise Refused(429, message, "overloaded", "overloaded") from None


async def _embed(request: web.Request, api: Api, parse: Parse, render: Render) -> web.Response:
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
    except Refused as err:
        return api.error(err, headers)
    try:
        body = await _read_json(request, runtime.config.payload_limit)
        parsed = parse(body, engine.limits)
        result = await _answer(runtime, engine, parsed, warmup, api)
        headers[COLD_HEADER] = "1" if result.cold else "0"
        pieces = await json_pieces(render(runtime, parsed, result))
        seconds = time.perf_counter() - started
        if not warmup:
            runtime.metrics.embedding_duration.labels(
                endpoint=request.path, phase="cold" if result.cold else "warm"
            ).observe(seconds)
        # The server's own share of the client's latency (the rest is network and proxies),
        # and where it went.
        headers["Server-Timing"] = result.timing.server_timing(seconds)
        if len(pieces) == 1:
            return web.Response(body=pieces[0], content_type="application/json", headers=headers)
        return await _send_pieces(request, pieces, headers)
    except Refused as err:
        return api.error(err, headers)
    except Exception as exc:
        log.exception("embedding request failed")
        err = Refused(500, f"internal error: {type(exc).__name__}", "backend", "internal_error")
        return api.error(err, headers)
    finally:
        runtime.release()


async def _send_pieces(
    request: web.Request, pieces: list[bytes], headers: dict[str, str]
) -> web.StreamResponse:
    """A large answer (schemas.json_pieces) sent piece by piece with its whole length as
    Content-Length, never joined into one buffer first."""
    response = web.StreamResponse(headers=headers)
    response.content_type = "application/json"
    response.content_length = sum(len(piece) for piece in pieces)
    await response.prepare(request)
    for piece in pieces:
        await response.write(piece)
    await response.write_eof()
    return response


def _render_openai(runtime: Runtime, parsed: EmbedRequest, result: Result) -> object:
    name = runtime.config.effective_served_name
    return openai_response(result.output, name, result.prompt_tokens, parsed.base64)


def _render_vectors(runtime: Runtime, parsed: EmbedRequest, result: Result) -> object:
    return exact_floats(result.output)


def _render_token_states(runtime: Runtime, parsed: EmbedRequest, result: Result) -> object:
    return [exact_floats(states) for states in result.output]


def _render_scores(runtime: Runtime, parsed: EmbedRequest, result: Result) -> object:
    return [float(score) for score in result.output]


async def openai_embeddings(request: web.Request) -> web.Response:
    return await _embed(request, OPENAI, parse_openai, _render_openai)


async def tei_embed(request: web.Request) -> web.Response:
    return await _embed(request, TEI, parse_tei, _render_vectors)


async def tei_embed_all(request: web.Request) -> web.Response:
    """TEI's /embed_all: every token's embedding, no pooling."""
    return await _embed(request, TEI, parse_tei_tokens, _render_token_states)


def _unused_ids(runtime: Runtime) -> np.ndarray:
    assert runtime.engine is not None and runtime.engine.runner.multi is not None
    return runtime.engine.runner.multi.unused


def _render_sparse(runtime: Runtime, parsed: EmbedRequest, result: Result) -> object:
    """TEI's /embed_sparse answer: per input its non-zero weights, [{index, value}], by id."""
    unused = _unused_ids(runtime)
    return [
        [
            {"index": index, "value": value}
            for index, value in output.lexical_weights(unused).items()
        ]
        for output in result.output
    ]


def _render_multi(runtime: Runtime, parsed: EmbedRequest, result: Result) -> object:
    """/embed_multi's answer, keyed as BGEM3FlagModel.encode's: `dense_vecs` (per input),
    `lexical_weights` (per input {token id: weight}, its ids as strings as FlagEmbedding's)
    and `colbert_vecs` (per input, a unit vector per token after the first), as asked."""
    outputs = result.output
    answer: dict[str, object] = {}
    if "dense" in parsed.parts:
        dense = np.stack([post.dense_of(output) for output in outputs])
        answer["dense_vecs"] = exact_floats(
            post.finish_vectors(dense, parsed.dimensions, parsed.normalize)
        )
    if "sparse" in parsed.parts:
        unused = _unused_ids(runtime)
        answer["lexical_weights"] = [
            {str(index): value for index, value in output.lexical_weights(unused).items()}
            for output in outputs
        ]
    if "colbert" in parsed.parts:
        answer["colbert_vecs"] = [exact_floats(output.colbert) for output in outputs]
    return answer


async def tei_embed_sparse(request: web.Request) -> web.Response:
    """TEI's /embed_sparse: bge-m3's lexical weights (its sparse head)."""
    return await _embed(request, TEI, parse_tei_sparse, _render_sparse)


async def embed_multi(request: web.Request) -> web.Response:
    """bge-m3's dense, sparse and ColBERT outputs, as asked, from one forward pass."""
    return await _embed(request, TEI, parse_multi, _render_multi)


async def tei_similarity(request: web.Request) -> web.Response:
    return await _embed(request, TEI_SIMILARITY, parse_similarity, _render_scores)


# ------------------------------------------------------------------ text-embeddings-inference
def _tei_error(err: Refused) -> web.Response:
    return web.json_response(err.tei_body(), status=err.status)


def _tokenizer_engine(runtime: Runtime):
    """The engine, for the routes that need only its tokenizer; 503 before it is loaded."""
    if runtime.engine is None:
        raise Refused(503, "the model is not loaded yet", "unhealthy", "not_ready")
    return runtime.engine


async def tei_health(request: web.Request) -> web.Response:
    """TEI's /health (and / and /ping): 200 with no body while the model serves, else 503."""
    lifecycle = request.app[RUNTIME].lifecycle
    if lifecycle.accepts_embeddings:
        return web.Response(status=200)
    return _tei_error(Refused(503, "unhealthy", "unhealthy", "not_ready"))


async def tei_tokenize(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    try:
        engine = _tokenizer_engine(runtime)
        limits = engine.limits
        fields = parse_object(await _read_json(request, runtime.config.payload_limit))
        texts = parse_strings(fields.get("inputs"), "inputs", limits.max_inputs)
        add_special = parse_flag(fields.get("add_special_tokens"), "add_special_tokens", True)
        prompt = parse_prompt_name(fields, limits.prompts)
        return web.json_response(await engine.pre.tokens(texts, add_special, prompt))
    except Refused as err:
        return _tei_error(err)


async def tei_decode(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    try:
        engine = _tokenizer_engine(runtime)
        limits = engine.limits
        fields = parse_object(await _read_json(request, runtime.config.payload_limit))
        ids = parse_id_lists(fields.get("ids"), "ids", limits.vocab.size, limits.max_inputs)
        skip = parse_flag(fields.get("skip_special_tokens"), "skip_special_tokens", True)
        return web.json_response(await engine.pre.decode(ids, skip))
    except Refused as err:
        return _tei_error(err)


async def tei_root(request: web.Request) -> web.Response:
    """POST / and /invocations, as TEI's router answers them for the model it serves
    (huggingface_hub's InferenceClient posts every task to the URL itself): a re-ranker
    re-ranks, a classifier classifies (`text_classification`); an embedder embeds, or answers
    sentence similarity when `inputs` is an object with `source_sentence`."""
    engine = request.app[RUNTIME].engine
    task = engine.settings.task if engine is not None else EMBED
    if task == RERANK:
        return await tei_rerank(request)
    if task == CLASSIFY:
        return await tei_predict(request)
    return await _embedder_root(request)


async def _embed_or_similarity(request: web.Request) -> web.Response:
    try:  # under the same body deadline and limit as every route; cached for the one it picks
        body = await _read_json(request, request.app[RUNTIME].config.payload_limit)
    except Refused as err:
        return _tei_error(err)
    if isinstance(body, dict) and isinstance(body.get("inputs"), dict):
        return await tei_similarity(request)
    return await tei_embed(request)


# What each task's model serves, and what a route of another task tells its client.
_TASK_ROUTES = {
    EMBED: "an embedding model: this server embeds text (/embed, /v1/embeddings)",
    RERANK: (
        "a re-ranker: this server ranks documents against a query (/rerank, /v1/rerank, /v2/rerank)"
    ),
    CLASSIFY: "a classifier: this server classifies texts and pairs (/predict)",
}
_KINDS = {EMBED: "an embedding", RERANK: "a re-ranker", CLASSIFY: "a classifier"}


def _for(task: str, handler: Handler, api: Api = TEI) -> Handler:
    """`handler`, for a model of `task`; a model of another answers 424 saying what it is
    (TEI's status for a route of another kind of model)."""

    async def checked(request: web.Request) -> web.Response:
        engine = request.app[RUNTIME].engine
        served = engine.settings.task if engine is not None else None
        if served is not None and served != task:
            message = f"model is not {_KINDS[task]} model: it is {_TASK_ROUTES[served]}"
            refused = Refused(424, message, "backend", "wrong_model_type")
            return api.error(refused, {COLD_HEADER: "0"})
        return await handler(request)

    return checked


def _giving(part: str, handler: Handler, api: Api = TEI) -> Handler:
    """`handler`, for a model with the `part` output (schemas.Limits.outputs); a model
    without answers 424, whatever the body, as a route of another kind of model does."""

    async def checked(request: web.Request) -> web.Response:
        engine = request.app[RUNTIME].engine
        if engine is not None:
            try:
                needs(engine.limits, (part,), request.path)
            except Refused as refused:
                return api.error(refused, {COLD_HEADER: "0"})
        return await handler(request)

    return checked


_embedder_root = _giving("dense", _embed_or_similarity)
"""POST / for an embedder: a SPLADE model, which has no dense vector, answers 424."""


def _render_rerank(runtime: Runtime, parsed: EmbedRequest, result: Result) -> object:
    assert isinstance(parsed, RankRequest) and runtime.engine is not None
    settings = runtime.engine.settings
    name = runtime.config.effective_served_name
    return rerank_answer(parsed, result.output, settings.activation, name, result.prompt_tokens)


def _render_predict(runtime: Runtime, parsed: EmbedRequest, result: Result) -> object:
    assert isinstance(parsed, PredictRequest) and runtime.engine is not None
    settings = runtime.engine.settings
    return predict_answer(parsed, result.output, settings.labels, settings.activation)


async def tei_rerank(request: web.Request) -> web.Response:
    return await _embed(request, TEI, parse_rerank, _render_rerank)


async def cohere_rerank(request: web.Request) -> web.Response:
    return await _embed(request, OPENAI, parse_cohere_rerank, _render_rerank)


async def tei_predict(request: web.Request) -> web.Response:
    return await _embed(request, TEI, parse_predict, _render_predict)


async def debug_faults(request: web.Request) -> web.Response:
    """Test-only (WARMGATE_FAULT_INJECTION=1): GET the injector's state, or POST
    {"mode": "raise"|"oom"|"hang"|"off", "count": n, "hang_seconds": s} to make the next
    forward passes (all of them, or n) raise, run out of GPU memory or hang."""
    injector = request.app[RUNTIME].faults
    assert injector is not None
    if request.method == "POST":
        try:
            fields = parse_object(await _read_json(request, 4096))
            count = fields.get("count")
            seconds = fields.get("hang_seconds")
            if count is not None and (not isinstance(count, int) or count < 1):
                raise validation("`count` must be a positive integer", "invalid_type", "count")
            if seconds is not None and (
                not isinstance(seconds, int | float) or isinstance(seconds, bool) or seconds <= 0
            ):
                raise validation("`hang_seconds` must be above 0", "invalid_type", "hang_seconds")
            injector.set(str(fields.get("mode")), count, seconds)
        except ValueError as exc:
            return web.json_response({"error": str(exc)}, status=422)
        except Refused as err:
            return _tei_error(err)
        log.warning("fault injection: %s", injector.state())
    return web.json_response(injector.state())


def add_routes(app: web.Application) -> None:
    if app[RUNTIME].faults is not None:
        app.router.add_get("/debug/faults", debug_faults)
        app.router.add_post("/debug/faults", debug_faults)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/ready", ready)
    app.router.add_get("/started", started)
    app.router.add_get(ROLE_PATH, role)
    app.router.add_post(ROLE_PATH, role)
    app.router.add_get("/info", info)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/warmup/profile", warmup_profile)
    app.router.add_post(
        "/v1/embeddings", _for(EMBED, _giving("dense", openai_embeddings, OPENAI), OPENAI)
    )
    # TEI's alias of the OpenAI route
    app.router.add_post(
        "/embeddings", _for(EMBED, _giving("dense", openai_embeddings, OPENAI), OPENAI)
    )
    app.router.add_post("/embed", _for(EMBED, _giving("dense", tei_embed)))
    app.router.add_post("/embed_all", _for(EMBED, tei_embed_all))
    # text-embeddings-inference's other entry points, as its router serves them for an
    # embedding model: health, the SageMaker/Vertex-style root and /invocations, tokenizer
    # routes and sentence similarity; the ones for other kinds of model answer 424 as TEI does.
    app.router.add_get("/health", tei_health)
    app.router.add_get("/ping", tei_health)
    app.router.add_get("/", tei_health)
    app.router.add_post("/", tei_root)
    app.router.add_post("/invocations", tei_root)
    app.router.add_post("/tokenize", tei_tokenize)
    app.router.add_post("/decode", tei_decode)
    app.router.add_post("/similarity", _for(EMBED, _giving("dense", tei_similarity)))
    app.router.add_post("/embed_sparse", _for(EMBED, _giving("sparse", tei_embed_sparse)))
    app.router.add_post("/embed_multi", _for(EMBED, embed_multi))
    app.router.add_post("/rerank", _for(RERANK, tei_rerank))
    app.router.add_post("/v1/rerank", _for(RERANK, cohere_rerank, OPENAI))
    app.router.add_post("/v2/rerank", _for(RERANK, cohere_rerank, OPENAI))  # Cohere's ClientV2
    app.router.add_post("/predict", _for(CLASSIFY, tei_predict))
