"""The router's HTTP side: the OpenAI route and text-embeddings-inference's routes, each request
forwarded whole to one warm pod of the EmbeddingService its model name selects.

- The name is resolved once, when the request arrives (an alias switched meanwhile moves the
  next request, never this one), and the answer says which service served it
  (X-Warmgate-Service) next to the pod's own X-Warmgate-Revision.
- Pods are the Ready endpoints of the service's EndpointSlices (the warm gate's verdict), over
  pooled keep-alive connections; the one with the fewest of this router's requests in flight
  is picked. A pod that refuses the connection is skipped for another (the request never reached
  it); a request that reached a pod is never sent twice.
- A service without a warm pod (scaled to zero, or all its pods still starting) gets its
  requests held, as long as its measured time to warm says (hold.py) and up to
  --max-held-requests; one at zero is scaled to 1 first (waking.py). A held request goes out
  the moment the first pod passes the warm gate, or gets a 503 with Retry-After (when a pod
  should be warm); one whose service should take longer than it can be held gets that 503 at
  once (refusals.py: in the route's own error format). A client that hangs up stops waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import socket
import time
from typing import Any

import orjson

from warmgate_contract.aliases import Resolution
from warmgate_contract.names import (
    ALIAS_KIND,
    MODEL_HEADER,
    ROUTER_HEADER,
    SERVICE_HEADER,
)
from warmgate_kube.client import KubeClient

from .balancer import Balancer
from .config import RouterConfig
from .hold import (
    CLIENT_TIMEOUT_HEADER,
    DEFAULT_RETRY_AFTER,
    Hold,
    Measured,
    client_timeout,
    plan_hold,
)
from .httpd import Request, Response, Routes, Server
from .metrics import CONTENT_TYPE, Metrics
from .refusals import Refused, json_answer, openai_error, tei_error
from .upstream import Failed, NotSent, Upstream
from .view import Key, View, replicas, scale_to_zero
from .waking import Waker

log = logging.getLogger("warmgate.router")

HELD_HEADER = "X-Warmgate-Held-Ms"
# Headers of a pod's answer the client gets (the rest are hop-by-hop or the router's own).
PASSED_HEADERS = ("content-type", "content-encoding", "server-timing", "retry-after")
# Headers of the client's request the pod gets (the body is the client's, unchanged in kind).
FORWARDED_HEADERS = ("Accept", "Accept-Encoding")
TEI_ROUTES = (
    "embed", "embed_all", "tokenize", "decode", "similarity", "embeddings", "invocations",
    "rerank", "predict", "embed_sparse", "embed_multi",
)  # fmt: skip


def _field_value_ok(value: str) -> bool:
    """Visible ASCII, spaces and tabs (RFC 9110, 5.5, less obs-text): nothing that could end
    the line or the head (CR, LF, NUL) or be read two ways."""
    return value.isascii() and value.replace("\t", " ").isprintable()


def forwarded_headers(request: Request) -> dict[str, str]:
    """The client's headers a pod gets (Content-Type, FORWARDED_HEADERS), each checked, never
    copied raw: a value with anything but visible ASCII, spaces and tabs is refused."""
    headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
    for header in FORWARDED_HEADERS:
        if header in request.headers:
            headers[header] = request.headers[header]
    for header, value in headers.items():
        if not _field_value_ok(value):
            raise Refused(
                400,
                f"the {header} header {value[:40]!r} has characters other than visible ASCII, "
                "spaces and tabs",
                "invalid_header",
            )
    return headers


def _expected(plan: Hold, elapsed: float = 0.0) -> str:
    """When a retry should find a warm pod, for a message: ' in N s', or ' later'."""
    if plan.expected is None or plan.expected - elapsed <= 0:
        return " later"
    return f" in {plan.retry_after(elapsed)} s"


def _waking_message(label: str, plan: Hold, measured: Measured, expected: float) -> str:
    """Why a request is answered at once: its service will not be warm within the hold."""
    state = "is waking from zero" if plan.waking else "has no warm pod yet"
    return (
        f"EmbeddingService {label} {state}: it took {measured.seconds:.0f} s to warm "
        f"({measured.field}) and about {expected:.0f} s remain, longer than this request can "
        f"be held ({plan.bound}): retry in {plan.retry_after()} s"
    )


class Router:
    def __init__(
        self, config: RouterConfig, view: View, kube: KubeClient | None, metrics: Metrics
    ) -> None:
        self.config = config
        self.view = view
        self.metrics = metrics
        self.balancer = Balancer()
        self.instance = socket.gethostname()
        """This replica's name in answers (a pod's host name is the pod's name)."""
        self.held = 0
        self.upstream = Upstream(keepalive_seconds=30.0)
        self.waker = Waker(config, view, kube, metrics)
        self.synced = asyncio.Event()
        self.draining = False
        """After SIGTERM: every answer closes its connection, so a pooled client's next
        request opens a new one through the Service, to another router replica."""
        self.stopping = False
        """At the end of the drain, before the watches stop: requests still held are answered
        503 with Retry-After (another replica holds them again), never left to the process's
        end."""

    async def close(self) -> None:
        self.waker.close()
        self.upstream.close()

    # -- names ----------------------------------------------------------------------------
    def resolve(self, model: str | None) -> tuple[str, Resolution]:
        if model is None or model == "":
            names = sorted(self.view.names.by_qualified)
            if len(names) == 1:
                model = names[0]
            else:
                raise Refused(
                    400,
                    "name the model (`model` on the OpenAI route, the "
                    f"{MODEL_HEADER} header or /models/NAME/ on the others): one of "
                    + ", ".join(self.model_ids()),
                    "model_required",
                )
        found = self.view.lookup(model)
        if isinstance(found, str):
            raise Refused(404, f"{found}; served: {', '.join(self.model_ids())}", "model_not_found")
        if not found.ok:
            raise Refused(404, found.message, "model_unresolved")
        return model, found

    def model_ids(self) -> list[str]:
        table = self.view.names
        return sorted(
            q.split("/", 1)[1] if len(table.by_bare.get(q.split("/", 1)[1], ())) == 1 else q
            for q in table.by_qualified
        )

    # -- holding --------------------------------------------------------------------------
    def hold_for(self, request: Request, key: Key) -> Hold:
        """How long this request may wait for `key`'s first warm pod (hold.py)."""
        return plan_hold(
            self.view.service(key) or {},
            self.config.hold_seconds,
            self.config.hold_ceiling,
            time.time(),
            client_timeout(request.headers.get(CLIENT_TIMEOUT_HEADER)),
        )

    async def hold(self, request: Request, key: Key, arrived: float, plan: Hold) -> float:
        """Until `key` has a Ready pod; the seconds waited. Refused when the service cannot
        get one (0 replicas and no scale to zero), when it is expected to take longer than
        the hold (`plan`, from `arrived`), past the limits, or after the hold."""
        service = self.view.service(key) or {}
        label = f"{key[0]}/{key[1]}"
        at_zero = replicas(service) == 0
        if at_zero and not scale_to_zero(service):
            raise Refused(
                503,
                f"EmbeddingService {label} has 0 replicas and does not scale from zero "
                "(autoscaling.scaleToZero): scale it up to serve",
                "no_replicas",
            )
        if at_zero:  # woken even when this request is not held: its retry finds a pod
            await self.waker.wake(key)
        if self.config.hold_seconds <= 0:
            raise Refused(
                503,
                f"EmbeddingService {label} has no warm pod yet and this router holds no "
                f"request (--hold-seconds 0): retry{_expected(plan)}",
                "no_warm_pod",
                plan.retry_after(),
            )
        if plan.measured is not None and plan.expected is not None and plan.hopeless:
            message = _waking_message(label, plan, plan.measured, plan.expected)
            raise Refused(503, message, "model_waking", plan.retry_after())
        if self.held >= self.config.max_held_requests:
            raise Refused(
                503,
                f"EmbeddingService {label} has no warm pod yet and the router holds "
                f"{self.held} requests already (--max-held-requests "
                f"{self.config.max_held_requests}): retry{_expected(plan)}",
                "no_warm_pod",
                plan.retry_after(),
            )
        deadline = arrived + plan.seconds
        started = time.monotonic()
        self.held += 1
        gauge = self.metrics.held.labels(service=label)
        gauge.inc()
        outcome = "client_gone"  # also when the server cancels this handler for a hang-up
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    outcome = "timeout"
                    break
                if await self.view.wait_ready(key, min(remaining, 0.25)):
                    outcome = "served"
                    break
                if request.gone():
                    break
                if self.stopping:
                    outcome = "router_stopping"
                    break
                if replicas(self.view.service(key) or {}) == 0:
                    await self.waker.wake(key)
        finally:
            self.held -= 1
            gauge.dec()
            waited = time.monotonic() - started
            self.metrics.hold_seconds.labels(service=label, outcome=outcome).observe(waited)
        if outcome == "served":
            return waited
        if outcome == "client_gone":
            raise Refused(499, "the client closed the connection while held", "client_gone")
        if outcome == "router_stopping":
            raise Refused(
                503,
                f"EmbeddingService {label} had no warm pod yet and this router replica is "
                f"shutting down after holding the request {waited:.0f} s: retry (another "
                "replica holds it)",
                "router_stopping",
                DEFAULT_RETRY_AFTER,
            )
        elapsed = time.monotonic() - arrived
        raise Refused(
            503,
            f"EmbeddingService {label} has had no warm pod for {waited:.0f} s (held up to "
            f"{plan.seconds:.0f} s: {plan.bound}): retry{_expected(plan, elapsed)}",
            "no_warm_pod",
            plan.retry_after(elapsed),
        )

    # -- forwarding -----------------------------------------------------------------------
    async def forward(
        self,
        request: Request,
        model: str | None,
        path: str,
        body: bytes | None,
    ) -> Response:
        arrived = time.monotonic()
        name, resolution = self.resolve(model)
        namespace = resolution.claim.namespace
        key = (namespace, resolution.service or "")
        label = f"{namespace}/{key[1]}"
        in_flight, latency = self.metrics.for_service(label)
        self.waker.note_activity(key)
        plan: Hold | None = None  # how long to hold it, once it has to be
        held = 0.0
        tried: set[str] = set()
        code = 500
        try:
            headers = forwarded_headers(request)
            while True:
                endpoints = self.view.ready(key)
                if not endpoints:
                    if plan is None:
                        plan = self.hold_for(request, key)
                    held += await self.hold(request, key, arrived, plan)
                    continue
                endpoint = self.balancer.pick(endpoints, tried)
                if endpoint is None:
                    raise Refused(
                        503,
                        f"no pod of EmbeddingService {label} accepted a connection "
                        f"(tried {len(tried)}): retry later",
                        "no_pod_reachable",
                        DEFAULT_RETRY_AFTER,
                    )
                try:
                    with self.balancer.busy(endpoint):
                        in_flight.inc()
                        try:
                            response = await self._send(
                                request.method, endpoint, path, body, headers
                            )
                        finally:
                            in_flight.dec()
                except NotSent as error:
                    # Never reached the pod (refused, unreachable, or no connection within
                    # --connect-timeout: a pod whose packets a NetworkPolicy drops, a node that
                    # went away): another pod may take it.
                    tried.add(endpoint.key)
                    self.metrics.retries.labels(service=label).inc()
                    log.info(
                        "%s: %s refused the connection (%s); trying another",
                        label,
                        endpoint.pod,
                        error,
                    )
                    continue
                except Failed as error:
                    raise Refused(
                        502,
                        f"pod {endpoint.pod} of EmbeddingService {label} failed while answering "
                        f"({error}); the request may have run, so it is not sent again",
                        "upstream_failed",
                    ) from None
                response.headers[SERVICE_HEADER] = label
                response.headers[ROUTER_HEADER] = self.instance
                if held:
                    response.headers[HELD_HEADER] = f"{held * 1000:.0f}"
                code = response.status
                return response
        except Refused as error:
            code = error.status
            raise
        finally:
            self.metrics.answered(name, label, code)
            latency.observe(time.monotonic() - arrived)

    async def _send(
        self, method: str, endpoint: Any, path: str, body: bytes | None, headers: dict[str, str]
    ) -> Response:
        answer = await self.upstream.request(
            method,
            endpoint.address,
            endpoint.port,
            path,
            body,
            headers,
            connect_timeout=self.config.connect_timeout,
            answer_timeout=self.config.request_timeout,
        )
        response = Response(answer.status, answer.body, content_type=None)
        for header, value in answer.headers:
            lower = header.lower()
            if lower in PASSED_HEADERS or lower.startswith("x-warmgate-"):
                response.headers[header] = value
        return response

    # -- routes ---------------------------------------------------------------------------
    async def openai_embeddings(self, request: Request, named: str | None = None) -> Response:
        """POST /v1/embeddings: the model named in the body. TEI's /embeddings: the model
        `named` by its path or header, which a body's `model` may repeat but not contradict
        (a request must never be served by a model other than the one it asked for)."""
        return await self._by_body(request, named, "/v1/embeddings")

    async def rerank(self, request: Request) -> Response:
        """POST /v1/rerank (the body Cohere's, Jina's and Infinity's clients send) and
        /v2/rerank (Cohere's ClientV2's, LangChain's and LlamaIndex's CohereRerank: the same
        body): the re-ranker named in the body, as /v1/embeddings, at the pod's /v1/rerank."""
        return await self._by_body(request, request.headers.get(MODEL_HEADER), "/v1/rerank")

    async def _by_body(self, request: Request, named: str | None, path: str) -> Response:
        """The model named by the body's `model` (or `named`, which it may repeat), the body
        forwarded to the pod's `path` without it; errors in OpenAI's shape."""
        try:
            try:
                body = orjson.loads(request.body)
            except orjson.JSONDecodeError as error:
                raise Refused(
                    400, f"the request body is not JSON: {error}", "invalid_json"
                ) from None
            if not isinstance(body, dict):
                raise Refused(400, "the request body must be a JSON object", "invalid_type")
            model = body.pop("model", None)
            if model is not None and not isinstance(model, str):
                raise Refused(400, "`model` must be a string", "invalid_type")
            if named is not None:
                if model not in (None, named):
                    raise Refused(
                        400,
                        f"the request names two models: {named!r} (its path or the "
                        f"{MODEL_HEADER} header) and {model!r} (the body's `model`); name one",
                        "model_mismatch",
                    )
                model = named
            # The pod serves one model under its own name: the router's name stops here.
            return await self.forward(request, model, path, orjson.dumps(body))
        except Refused as error:
            return openai_error(error)

    async def tei(self, request: Request) -> Response:
        """TEI's routes: the model named by the X-Warmgate-Model header or by the path
        (/models/NAME/embed; NAME may be namespace/name)."""
        model = request.match_info.get("model")
        route = request.path
        if model is not None:
            route = route[len("/models/") + len(model) :]
        else:
            model = request.headers.get(MODEL_HEADER)
        try:
            if route == "/embeddings":  # TEI's alias of the OpenAI route
                return await self.openai_embeddings(request, model)
            body = request.body if request.method == "POST" else None
            return await self.forward(request, model, route, body)
        except Refused as error:
            return tei_error(error)

    async def models(self, request: Request) -> Response:
        data = []
        table = self.view.names
        ids = {q: i for q, i in zip(sorted(table.by_qualified), self._ids_in_order(), strict=True)}
        for qualified, resolution in sorted(table.by_qualified.items()):
            namespace = resolution.claim.namespace
            service = self.view.service((namespace, resolution.service or "")) or {}
            spec = service.get("spec") or {}
            ready = len(self.view.ready((namespace, resolution.service or "")))
            if not resolution.ok:
                state = "unresolved"
            elif ready:
                state = "ready"
            elif replicas(service) == 0:
                state = "scaled-to-zero" if scale_to_zero(service) else "no-replicas"
            else:
                state = "starting"
            entry: dict[str, Any] = {
                "id": ids[qualified],
                "object": "model",
                "created": _epoch(resolution.claim.created),
                "owned_by": "warmgate",
                "root": (spec.get("model") or {}).get("id"),
                "kind": resolution.claim.kind,
                "service": f"{namespace}/{resolution.service}" if resolution.ok else None,
                "state": state,
                "ready_replicas": ready,
            }
            if resolution.claim.kind == ALIAS_KIND:
                entry["alias_of"] = entry["service"]
            if not resolution.ok:
                entry["message"] = resolution.message
            data.append(entry)
        return json_answer(200, {"object": "list", "data": data})

    def _ids_in_order(self) -> list[str]:
        table = self.view.names
        return [
            q.split("/", 1)[1] if len(table.by_bare.get(q.split("/", 1)[1], ())) == 1 else q
            for q in sorted(table.by_qualified)
        ]

    async def healthz(self, request: Request) -> Response:
        return json_answer(200, {"status": "ok"})

    async def ready(self, request: Request) -> Response:
        if self.draining:
            return json_answer(503, {"status": "draining"})
        if not self.synced.is_set():
            return json_answer(503, {"status": "syncing"})
        return json_answer(200, {"status": "ready", "names": len(self.view.names.by_qualified)})

    async def metrics_route(self, request: Request) -> Response:
        for key, endpoints in list(self.view.endpoints.items()):
            self.metrics.endpoints.labels(service=f"{key[0]}/{key[1]}").set(len(endpoints))
        return Response(200, self.metrics.render(), content_type=CONTENT_TYPE)


def _epoch(stamp: str) -> int:
    with contextlib.suppress(ValueError):
        return int(datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp())
    return 0


MAX_BODY_BYTES = 64 * 1024 * 1024


def build_server(router: Router) -> Server:
    """The router's routes on its HTTP server (httpd.py); while the router drains, every
    answer closes its connection, so a pooled client's next request opens a new one through
    the Service, to another replica."""
    routes = Routes()
    routes.add("GET", "/healthz", router.healthz)
    routes.add("GET", "/ready", router.ready)
    routes.add("GET", "/metrics", router.metrics_route)
    routes.add("GET", "/v1/models", router.models)
    routes.add("POST", "/v1/embeddings", router.openai_embeddings)
    routes.add("POST", "/v1/rerank", router.rerank)
    routes.add("POST", "/v2/rerank", router.rerank)  # Cohere's ClientV2: the same body
    for route in TEI_ROUTES:
        routes.add("POST", f"/{route}", router.tei)
        routes.add_pattern("POST", f"/models/(?P<model>.+)/{route}", router.tei)
    routes.add("POST", "/", router.tei)
    routes.add("GET", "/info", router.tei)
    routes.add_pattern("GET", "/models/(?P<model>.+)/info", router.tei)
    return Server(routes, max_body=MAX_BODY_BYTES, draining=lambda: router.draining)
