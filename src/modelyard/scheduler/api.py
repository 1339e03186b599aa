"""The scheduler's REST API and gateway feed (docs/placement.md), as an aiohttp application.

Errors use the one envelope of modelyard's error tree (`{"error": {"message", "type", "code"}}`);
bodies are bounded (413 past `max_body_bytes`) and parsed as JSON or YAML with bounded nesting.
With credentials configured, every call but /healthz and /readyz is admitted first (access.py:
401 without a known credential, 403 for a read-only one that writes); a credential is never logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from modelyard.documents import DocumentError, parse_document
from modelyard.errors import (
    BadRequest,
    MalformedBody,
    ModelSpecInvalid,
    ModelyardError,
    SchedulerUnavailable,
)
from modelyard.placement import ModelSpec
from modelyard.placement.manifest import spec_from_manifest
from modelyard.scheduler.access import OPEN_PATHS, RestAccess
from modelyard.scheduler.views import model_view, servers_view
from modelyard.serving.errors import ServiceErrors
from modelyard.types import Protocol

if TYPE_CHECKING:
    from modelyard.scheduler.service import SchedulerService

log = logging.getLogger("modelyard.scheduler")
SERVICE: web.AppKey[SchedulerService] = web.AppKey("scheduler_service")
ACCESS: web.AppKey[RestAccess | None] = web.AppKey("scheduler_access")
ERRORS = ServiceErrors("scheduler", protocol=Protocol.PLAIN)  # every path: `{"error": {...}}`


def json_response(data: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


@web.middleware
async def _admit(request: web.Request, handler: Any) -> web.StreamResponse:
    access = request.app[ACCESS]
    if access is not None and request.path not in OPEN_PATHS:
        access.check(request)  # 401 or 403, rendered by ERRORS.middleware
    response: web.StreamResponse = await handler(request)
    return response


async def _read_document(request: web.Request) -> Any:
    limit = request.client_max_size
    if request.content_length is not None and request.content_length > limit:
        raise ERRORS.too_large(limit)
    body = await request.read()  # aiohttp refuses a longer chunked body with 413 itself
    if request.content_type == "application/json":
        try:  # said to be JSON: say what is wrong with it as JSON, not as the YAML it is not
            orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise MalformedBody(f"the body is not valid JSON: {exc}") from None
    try:
        return await asyncio.to_thread(parse_document, body)
    except DocumentError as exc:
        raise BadRequest(f"the body must be JSON or YAML: {exc}") from None


def spec_from_body(document: object, name: str) -> ModelSpec:
    """The body as a spec (plain or a Seldon Model); a missing name is the path's, another is a 400."""
    source = f"PUT /v1/models/{name}"
    if isinstance(document, Mapping):
        if "apiVersion" in document or "kind" in document:
            metadata = document.get("metadata")
            if metadata is None or (isinstance(metadata, Mapping) and "name" not in metadata):
                document = {**document, "metadata": {**(metadata or {}), "name": name}}
        elif "name" not in document:
            document = {**document, "name": name}
    spec = spec_from_manifest(document, source)
    if spec.name != name:
        raise ModelSpecInvalid(source, [f"name: {spec.name!r} is not the name in the path ({name!r})"])
    return spec


async def put_model(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    spec = spec_from_body(await _read_document(request), request.match_info["name"])
    with _traced(service, request, f"apply {spec.name}", spec.name):
        model, change = service.state.apply(spec, service.clock())
    service.changes.pulse()
    return json_response({**model_view(model), "change": change})


async def get_models(request: web.Request) -> web.Response:
    state = request.app[SERVICE].state
    return json_response({"models": [model_view(m) for _, m in sorted(state.models.items())]})


async def get_model(request: web.Request) -> web.Response:
    return json_response(model_view(request.app[SERVICE].state.model(request.match_info["name"])))


async def delete_model(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    name = request.match_info["name"]
    with _traced(service, request, f"delete {name}", name):
        model = service.state.delete(name, service.clock())
    service.changes.pulse()
    return json_response(model_view(model))


@contextlib.contextmanager
def _traced(service: SchedulerService, request: web.Request, name: str, model: str) -> Iterator[None]:
    """With tracing on, a span for one model change (a child of the client's traceparent), made
    the parent of the operations the change sends to agents. The change is synchronous: no await
    runs between setting `agents.cause` and clearing it."""
    tracer = service.tracer
    if tracer is None:
        yield
        return
    span = tracer.start(name, request.headers.items(), "server", {"modelyard.model": model})
    service.agents.cause = span
    try:
        yield
    except ModelyardError as error:
        span.fail(error.message, type(error).__name__)
        raise
    finally:
        service.agents.cause = None
        span.end()


async def get_servers(request: web.Request) -> web.Response:
    return json_response({"servers": servers_view(request.app[SERVICE].state)})


async def feed(request: web.Request) -> web.StreamResponse:
    """A snapshot line, then each change; a ping every few seconds. Ends when the reader is dropped
    for lagging (it reconnects for a fresh snapshot), the scheduler stops, or the credential it was
    admitted with is gone (checked again every `credential_recheck` seconds: a token removed from
    the tokens file ends the feeds it opened; the reader's reconnect is then refused)."""
    service = request.app[SERVICE]
    access = request.app[ACCESS]
    loop = asyncio.get_running_loop()
    recheck = service.config.credential_recheck
    next_check = loop.time() + recheck
    queue = service.feed.subscribe()  # in the same step as the snapshot: no change falls between
    snapshot = {"type": "snapshot", "models": service.state.feed_snapshot()}
    response = web.StreamResponse(
        headers={"Content-Type": "application/x-ndjson", "Cache-Control": "no-cache"}
    )
    try:
        await response.prepare(request)
        await response.write(orjson.dumps(snapshot) + b"\n")
        while True:
            try:
                async with asyncio.timeout(service.config.feed_ping_interval):
                    line = await queue.get()
            except TimeoutError:
                line = {"type": "ping"}
            if line is None:
                break
            if access is not None and loop.time() >= next_check:
                next_check = loop.time() + recheck
                try:
                    access.check(request)
                except ModelyardError as error:
                    log.info("ended a feed to %s: %s", request.remote or "a reader", error.message)
                    break
            await response.write(orjson.dumps(line) + b"\n")
    finally:
        service.feed.unsubscribe(queue)
    with contextlib.suppress(ConnectionResetError):
        await response.write_eof()
    return response


async def healthz(request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    state = request.app[SERVICE].state
    if not state.ready:
        waiting = ", ".join(f"{s}-{i}" for s, i in sorted(state.awaiting))
        raise SchedulerUnavailable(f"resyncing after a restart; waiting for server replicas {waiting}")
    return json_response({"status": "ready"})


async def metrics(request: web.Request) -> web.Response:
    page = generate_latest(request.app[SERVICE].metrics.registry)
    return web.Response(body=page, headers={"Content-Type": CONTENT_TYPE_LATEST})


def create_app(service: SchedulerService, access: RestAccess | None = None) -> web.Application:
    app = web.Application(
        middlewares=[ERRORS.middleware, _admit], client_max_size=service.config.max_body_bytes
    )
    app[SERVICE] = service
    app[ACCESS] = access
    app.router.add_put("/v1/models/{name}", put_model)
    app.router.add_get("/v1/models", get_models)
    app.router.add_get("/v1/models/{name}", get_model)
    app.router.add_delete("/v1/models/{name}", delete_model)
    app.router.add_get("/v1/servers", get_servers)
    app.router.add_get("/v1/feed", feed)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    return app
