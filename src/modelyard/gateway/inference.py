"""The inference listeners: OpenAI, the Open Inference Protocol v2, KServe v1, graphs; and the
gateway's own health and metrics endpoints."""

from __future__ import annotations

import os
from urllib.parse import unquote

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from modelyard import __version__
from modelyard.errors import BadRequest, PayloadTooLarge
from modelyard.gateway.gateway import GATEWAY
from modelyard.gateway.graphs import TRACE_REQUEST_HEADER
from modelyard.protocols import oip, openai
from modelyard.serving import draining
from modelyard.types import RoutingRequest


def json_response(data: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


async def read_body(
    request: web.Request, limit: int | None = None, setting: str = "limits.max_body_bytes"
) -> bytes:
    """The whole body, refused with 413 as soon as it is known to be over `limit` (default:
    `limits.max_body_bytes`, which aiohttp itself enforces while reading a chunked body)."""
    if limit is None or limit >= request.client_max_size:
        limit = request.client_max_size
        if request.content_length is not None and request.content_length > limit:
            raise _too_large(setting, limit)
        return await request.read()
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(setting, limit)
    parts, size = [], 0
    while chunk := await request.content.readany():  # a chunked body: stop as soon as it is over
        parts.append(chunk)
        size += len(chunk)
        if size > limit:
            raise _too_large(setting, limit)
    return b"".join(parts)


def _too_large(setting: str, limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"request body is larger than {setting} ({limit} bytes)")


# --- OpenAI ---------------------------------------------------------------------------------


def openai_handler(kind: str):  # type: ignore[no-untyped-def]
    async def handle(request: web.Request) -> web.StreamResponse:
        gateway = request.app[GATEWAY]
        body = await read_body(request)
        routing = openai.routing_request(body, kind)
        return await gateway.proxy.forward(request, gateway.cluster(routing.model), routing, body)

    return handle


async def list_models(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY]
    data = [
        {"id": name, "object": "model", "created": gateway.created, "owned_by": "modelyard"}
        for name in gateway.clusters
    ]
    return json_response({"object": "list", "data": data})


# --- Open Inference Protocol v2 and KServe v1 ------------------------------------------------


def refuse_unsafe_path(request: web.Request) -> None:
    """The client's path is forwarded upstream as it came (its encoding and query intact), so a
    segment that decodes to `.`, `..` or holds a slash (`..%2F..%2Fsim%2Fstats`) would reach
    another resource on the server than the one it was routed as: refuse it."""
    path = request.raw_path.partition("?")[0]
    if "%" in path or "/." in path:
        for segment in path.split("/"):
            decoded = unquote(segment)
            if decoded in (".", "..") or "/" in decoded or "\\" in decoded:
                raise BadRequest(f"path segment {segment!r} is not allowed: it decodes to {decoded!r}")


async def oip_infer(request: web.Request) -> web.StreamResponse:
    refuse_unsafe_path(request)
    gateway = request.app[GATEWAY]
    cluster = gateway.admit(request.match_info["name"])  # the model is in the path: before the body
    body = await read_body(request)
    routing = oip.routing_request(
        cluster.name, body, request.headers, affinity_chars=cluster.config.kv_aware.prefix_chars
    )
    return await gateway.proxy.forward(request, cluster, routing, body)


async def model_get(request: web.Request) -> web.StreamResponse:
    """OIP model metadata/readiness and KServe v1 model status come from a serving endpoint."""
    refuse_unsafe_path(request)
    gateway = request.app[GATEWAY]
    cluster = gateway.cluster(request.match_info["name"])
    return await gateway.proxy.forward(request, cluster, RoutingRequest(model=cluster.name), None)


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
    service = request.app[GATEWAY].graphs
    name = request.match_info["name"]
    service.get(name)  # 404 before reading the body
    body = await read_body(request)
    want_trace = request.headers.get(TRACE_REQUEST_HEADER, "") not in ("", "0", "false")
    return await service.run(name, body, list(request.headers.items()), want_trace)


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
