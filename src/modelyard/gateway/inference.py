"""The inference listeners: OpenAI, the Open Inference Protocol v2, KServe v1, graphs; and the
gateway's own health and metrics endpoints."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from urllib.parse import unquote

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from modelyard import __version__
from modelyard.errors import BadRequest, ModelyardError
from modelyard.gateway.admission import CREDENTIAL_FIELDS, Admission
from modelyard.gateway.gateway import GATEWAY, Gateway
from modelyard.gateway.graphs import TRACE_REQUEST_HEADER
from modelyard.gateway.ledger import CLIENT_CLOSED
from modelyard.protocols import oip, openai
from modelyard.serving import draining
from modelyard.serving.errors import REQUEST_ID, ServiceErrors
from modelyard.serving.h1 import H1Request, Handler
from modelyard.serving.reply import AiohttpReply, Inbound, Reply
from modelyard.types import RoutingRequest

# The gateway's errors: the error middleware's, and the lean listener's (`lean_handler`).
ERRORS = ServiceErrors("gateway", body_limit="limits.max_body_bytes", request_ids=True)


def json_response(data: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


async def read_body(request: Inbound) -> bytes:
    """The whole body, refused with 413 as soon as it is known to be over `limits.max_body_bytes`
    (which the server itself enforces while reading a chunked body)."""
    limit = request.client_max_size
    if request.content_length is not None and request.content_length > limit:
        raise ERRORS.too_large(limit)
    return await request.read()


async def read_limited_body(request: web.Request, limit: int, setting: str) -> bytes:
    """The whole body, refused with 413 as soon as it is over `limit` (named by `setting`)."""
    if limit >= request.client_max_size:
        return await read_body(request)
    if request.content_length is not None and request.content_length > limit:
        raise ERRORS.too_large(limit, setting)
    parts, size = [], 0
    while chunk := await request.content.readany():  # a chunked body: stop as soon as it is over
        parts.append(chunk)
        size += len(chunk)
        if size > limit:
            raise ERRORS.too_large(limit, setting)
    return b"".join(parts)


# --- the proxied routes: served by aiohttp or by the lean HTTP/1.1 connection -----------------

ProxiedRoute = Callable[[Gateway, Inbound, Reply], Awaitable[None]]


def openai_route(kind: str) -> ProxiedRoute:
    async def handle(gateway: Gateway, request: Inbound, reply: Reply) -> None:
        admission = gateway.admission  # (auth.enabled: the key before the body, the model after)
        caller = admission.caller(request.headers) if admission is not None else None
        # (the lean connection's body is here already: no coroutine to get it)
        body = request.body if type(request) is H1Request else await read_body(request)
        routing = openai.routing_request(body, kind)
        if caller is None:
            await gateway.proxy.forward(request, reply, gateway.cluster(routing.model), routing, body)
            return
        assert admission is not None
        Admission.allow(caller, routing.model)
        cluster = gateway.cluster(routing.model)  # (a model that is not there is not counted)
        permit = await admission.take(caller)
        # A stream's tokens are in its usage event, sent only when asked for: asked for here when
        # the client did not, and then not relayed to it.
        ask_usage = routing.stream and kind != "embeddings" and not openai.asks_usage(routing.fields)
        if ask_usage and routing.fields is not None:
            body = openai.with_usage_asked(routing.fields)
            permit.strip_usage = True
        try:
            await gateway.proxy.forward(request, reply, cluster, routing, body, permit)
        except BaseException as exc:
            admission.quotas_end(permit, exc)
            raise
        admission.quotas_end(permit)

    return handle


def refuse_unsafe_path(request: Inbound) -> None:
    """The client's path is forwarded upstream as it came (its encoding and query intact), so a
    segment that decodes to `.`, `..` or holds a slash (`..%2F..%2Fsim%2Fstats`) would reach
    another resource on the server than the one it was routed as: refuse it."""
    path = request.raw_path.partition("?")[0]
    if "%" in path or "/." in path:
        for segment in path.split("/"):
            decoded = unquote(segment)
            if decoded in (".", "..") or "/" in decoded or "\\" in decoded:
                raise BadRequest(f"path segment {segment!r} is not allowed: it decodes to {decoded!r}")


async def oip_infer(gateway: Gateway, request: Inbound, reply: Reply) -> None:
    refuse_unsafe_path(request)
    caller = None
    if gateway.admission is not None:  # (before saying whether the model exists)
        caller = gateway.admission.admit(request.headers, request.match_info["name"])
    cluster = gateway.admit(request.match_info["name"], caller)  # the model is in the path: before the body
    body = await read_body(request)
    routing = oip.routing_request(
        cluster.name, body, request.headers, affinity_chars=cluster.config.kv_aware.prefix_chars
    )
    if gateway.admission is None or caller is None:
        await gateway.proxy.forward(request, reply, cluster, routing, body)
        return
    permit = await gateway.admission.take(caller)
    try:
        await gateway.proxy.forward(request, reply, cluster, routing, body, permit)
    except BaseException as exc:
        gateway.admission.quotas_end(permit, exc)
        raise
    gateway.admission.quotas_end(permit)


async def model_get(gateway: Gateway, request: Inbound, reply: Reply) -> None:
    """OIP model metadata/readiness and KServe v1 model status come from a serving endpoint."""
    refuse_unsafe_path(request)
    if gateway.admission is not None:
        gateway.admission.admit(request.headers, request.match_info["name"])
    cluster = gateway.cluster(request.match_info["name"])
    # (no fallbacks: a model's metadata and readiness are its own, not a fallback's)
    await gateway.proxy.forward(
        request, reply, cluster, RoutingRequest(model=cluster.name), None, fallbacks=False
    )


def aiohttp_view(route: ProxiedRoute) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """A proxied route as an aiohttp handler (errors go on to the error middleware)."""

    async def view(request: web.Request) -> web.StreamResponse:
        reply = AiohttpReply(request)
        started = time.perf_counter()
        gateway = request.app[GATEWAY]
        try:
            await route(gateway, request, reply)
        except (asyncio.CancelledError, ConnectionError):
            if not reply.request_id and gone_mid_body(request):
                refused(gateway, request, CLIENT_CLOSED, started)
            raise
        except Exception as exc:  # a ModelyardError, or a bug: its answer and log line carry the id
            if reply.request_id:
                request[REQUEST_ID] = reply.request_id
            else:
                status = exc.status if isinstance(exc, ModelyardError | web.HTTPException) else 500
                request[REQUEST_ID] = refused(gateway, request, status, started, _model_named(request, exc))
            raise
        assert reply.response is not None
        return reply.response

    return view


def lean_handler(gateway: Gateway, route: ProxiedRoute) -> Handler:
    """A proxied route for the lean connection, which has no middleware: errors are answered
    here as the error middleware answers them."""

    async def handle(request: H1Request, reply: Reply) -> None:
        started = time.perf_counter()
        try:
            await route(gateway, request, reply)
        except ModelyardError as exc:
            if reply.started:
                raise
            # (refused before routing: the line is written here, else the attempt loop wrote it)
            request_id = reply.request_id or refused(
                gateway, request, exc.status, started, _model_named(request, exc)
            )
            error = exc
        except (asyncio.CancelledError, ConnectionError):
            raise  # the client went away: nothing to answer
        except Exception:
            if reply.started:
                raise
            request_id = reply.request_id or refused(gateway, request, 500, started)
            error = ERRORS.internal_error(request.method, request.path, request_id)
        else:
            return
        headers, body = ERRORS.answer(request.path, error, request_id)
        reply.whole(error.status, headers, body)

    return handle


def abandoned(gateway: Gateway) -> Callable[[H1Request, float], None]:
    """For the lean listener: the access line of a request whose client left while its body was
    read, `seconds` after its head was."""

    def log_line(request: H1Request, seconds: float) -> None:
        refused(gateway, request, CLIENT_CLOSED, time.perf_counter() - seconds)

    return log_line


def gone_mid_body(request: web.Request) -> bool:
    """Whether the client left while aiohttp read the request's body: its connection is lost and
    the body did not end. (A stop cancels the handler too, with the connection still open; a client
    gone later, during the affinity lookup, had sent its whole body.)"""
    return request.transport is None and not request.content.is_eof()


def refused(gateway: Gateway, request: Inbound, status: int, started: float, model: str = "") -> str:
    """The access line and the routing-log record of a request refused before routing (an unknown
    model, a model not placed, a malformed or too large body, a client gone while its body was
    read): no route or backend, and `model` only when the request named one. A routed request's
    line and record are the attempt loop's. Returns the request's id, for its answer: the client's
    X-Request-Id, else one made as for a routed request."""
    request_id = request.headers.get("X-Request-Id") or gateway.proxy.new_request_id()
    seconds = time.perf_counter() - started
    gateway.metrics.routing_log.record_refused(model, status, seconds, request_id)
    if gateway.access is not None:
        gateway.access.refused(request_id, request.method, request.raw_path, status, seconds)
    return request_id


def _model_named(request: Inbound, error: BaseException) -> str:
    """The model a refused request asked for: the error's (the name in an OpenAI body is read
    only by the route), else the path's (`/v2/models/{name}/...`), else none."""
    model = getattr(error, "model", None)
    if isinstance(model, str) and model:
        return model
    return request.match_info.get("name", "")


async def list_models(request: web.Request) -> web.Response:
    """The models; with auth on, those the caller's key may use."""
    gateway = request.app[GATEWAY]
    caller = gateway.admission.caller(request.headers) if gateway.admission is not None else None
    data = [
        {"id": name, "object": "model", "created": gateway.created, "owned_by": "modelyard"}
        for name in gateway.clusters
        if caller is None or caller.may_use(name)
    ]
    return json_response({"object": "list", "data": data})


async def oip_server_metadata(request: web.Request) -> web.Response:
    return json_response({"name": "modelyard", "version": __version__, "extensions": []})


async def oip_live(request: web.Request) -> web.Response:
    return json_response({"live": True})


async def oip_ready(request: web.Request) -> web.Response:
    ready = not draining(request) and all(c.ready for c in request.app[GATEWAY].clusters.values())
    return json_response({"ready": ready}, 200 if ready else 503)


# --- graphs ------------------------------------------------------------------------------------


async def run_graph(request: web.Request) -> web.Response:
    """Run a graph; `X-Modelyard-Trace: 1` adds `X-Modelyard-Graph-Trace` (every step, its status and ms)."""
    gateway = request.app[GATEWAY]
    service = gateway.graphs
    name = request.match_info["name"]
    started = time.perf_counter()
    permit = None
    try:
        caller = None
        if gateway.admission is not None:  # (a key may use a graph by its name)
            caller = gateway.admission.admit(request.headers, name)
        service.get(name)  # 404 before reading the body
        body = await read_body(request)
        if caller is not None:  # one graph run is one request of the caller's (its steps are the gateway's)
            assert gateway.admission is not None
            permit = await gateway.admission.take(caller)
    except (ModelyardError, web.HTTPException) as exc:  # the graph's run writes its own access line
        request[REQUEST_ID] = refused(gateway, request, exc.status, started)
        raise
    except (asyncio.CancelledError, ConnectionError):
        if gone_mid_body(request):
            refused(gateway, request, CLIENT_CLOSED, started)
        raise
    want_trace = request.headers.get(TRACE_REQUEST_HEADER, "") not in ("", "0", "false")
    headers = list(request.headers.items())
    if permit is None:
        return await service.run(name, body, headers, want_trace)
    # the caller's key is the gateway's business: not propagated to the steps' services
    headers = [(k, v) for k, v in headers if k.lower().encode() not in CREDENTIAL_FIELDS]
    assert gateway.admission is not None
    try:
        response = await service.run(name, body, headers, want_trace)
    except BaseException as exc:
        gateway.admission.quotas_end(permit, exc)
        raise
    permit.code = response.status
    gateway.admission.quotas_end(permit)
    for field, value in permit.fields:
        response.headers[field.decode()] = value.decode()
    return response


# --- the gateway's own endpoints -------------------------------------------------------------


async def healthz(request: web.Request) -> web.Response:
    siblings = request.app[GATEWAY].siblings
    if siblings is None:
        return json_response({"status": "ok"})
    return json_response({"status": "ok", "worker": siblings.index, "pid": os.getpid()})


async def readyz(request: web.Request) -> web.Response:
    """503 while draining or while a configured model has no healthy endpoint. The scheduler's feed
    and its placed models are reported but never make the gateway unready: without the feed the
    last endpoints keep serving, and a placed model's replicas are the scheduler's to replace;
    taking every gateway out because the scheduler restarts or one replica died would turn a blip
    into an outage for every other model."""
    gateway = request.app[GATEWAY]
    placed = gateway.placed.models
    not_ready = [c.name for c in list(gateway.clusters.values()) if not c.ready and c.name not in placed]
    drain = draining(request)  # shutting down: load balancers should stop sending
    ready = not not_ready and not drain
    body: dict[str, object] = {
        "ready": ready,
        "draining": drain,
        "models_without_healthy_endpoints": not_ready,
    }
    follower = gateway.follower
    if follower is not None:
        body["placement"] = {
            "scheduler": gateway.config.placement.scheduler,
            "connected": follower.connected,
            "synced": follower.synced,
            "last_error": follower.last_error,
            **gateway.placed.view(),
        }
    return json_response(body, 200 if ready else 503)


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[GATEWAY].metrics.exposition)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
