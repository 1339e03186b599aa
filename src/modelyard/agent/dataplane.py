"""The agent's data plane: requests reach the inference server through the agent, so it knows which
models are in use (compat §7.7: Seldon's agent proxies for the same reason).

Inference paths only are forwarded (`inference_route`), and for the models the agent holds:

    GET  /v2, /v2/health/live, /v2/health/ready
    GET  /v2/models/{m}[/versions/{v}][/ready]                         OIP v2 metadata, readiness
    POST /v2/models/{m}[/versions/{v}]/{infer,generate,generate_stream,explain}
    GET  /v1/models/{m};  POST /v1/models/{m}:predict, :explain        KServe v1
    POST /v1/chat/completions, /v1/completions, /v1/embeddings         OpenAI (the body's `model`)

Anything else (the server's repository API, `/v2/repository/models/{m}/load` and `/unload`, which
would let anyone who reaches the port unload models the scheduler placed; Triton's shared-memory,
trace and logging settings; the server's own metrics) answers 404 here, in the protocol's envelope,
and never reaches the server; so does a path segment that decodes to `.`, `..` or holds a slash, and
a model the agent does not hold. A request forwarded goes as it came (method, path, query, headers,
body); answers come back as they are, a server-sent event stream chunk by chunk. A request for a
model the agent holds is counted against it while it runs (in flight: the model is not evicted), and
one for an evicted model waits (queued) while the agent loads it again, evicting others if needed.

When the server answers 404 for a model the agent holds as loaded and its
`/v2/models/{name}/ready` does not say ready (the server restarted or lost it), the agent loads it
once and sends the request once more; if the load fails, the client gets the server's 404.

Its own paths: `GET /metrics` (Prometheus, `metrics.py`); `GET /v2/health/ready` answers 503 while
the agent drains; `GET /v2/models/{name}/ready` answers 200 for a model held but evicted (it is
served, after a reload) without waking the server.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import unquote

import orjson
from aiohttp import web
from multidict import CIMultiDict
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from modelyard.agent.metrics import AgentMetrics
from modelyard.agent.residency import Residency
from modelyard.agent.state import LocalState, ModelStatus
from modelyard.errors import ModelNotResident, ModelyardError, NotFound, UpstreamError
from modelyard.serving.errors import ServiceErrors
from modelyard.upstream.headers import forwarded_request_headers, relayed_response_headers
from modelyard.upstream.http1 import Http1Client, UpstreamResponse

log = logging.getLogger("modelyard.agent")

_READ = frozenset({"GET", "HEAD"})
_SERVER_PATHS = frozenset({("v2",), ("v2", "health", "live"), ("v2", "health", "ready")})
_OIP_VERBS = frozenset({"infer", "generate", "generate_stream", "explain"})
_V1_VERBS = frozenset({"predict", "explain"})
_OPENAI_PATHS = frozenset({("v1", "chat", "completions"), ("v1", "completions"), ("v1", "embeddings")})
_JSON = "application/json"
# Each error in the envelope of the protocol the path speaks.
_ERRORS = ServiceErrors("agent", body_limit="the agent's max_body_bytes")


@dataclass(frozen=True)
class Route:
    """An inference request the data plane forwards: the model its path names (None: the server's
    health or metadata, or an OpenAI path, whose model is in the body)."""

    model: str | None
    openai: bool = False


class NotForwarded(NotFound):
    """A path the data plane does not forward (404): not an inference path, or a model not held here."""

    code = "not_forwarded"


def inference_route(method: str, raw_path: str) -> Route | None:
    """What `method raw_path` asks for, if it is an inference request the agent forwards; None for
    anything else. The raw path is what the server gets, so it is judged as sent: each segment
    decoded, and one that decodes to `.`, `..`, nothing or holds a slash makes it no route."""
    path = raw_path.partition("?")[0]
    if not path.startswith("/"):
        return None
    segments = tuple(unquote(segment) for segment in path[1:].split("/"))
    if any(s in ("", ".", "..") or "/" in s or "\\" in s for s in segments):
        return None
    if method in _READ and segments in _SERVER_PATHS:
        return Route(None)
    if method == "POST" and segments in _OPENAI_PATHS:
        return Route(None, openai=True)
    if len(segments) >= 3 and segments[:2] == ("v2", "models"):
        rest = segments[3:]
        if rest[:1] == ("versions",):
            if len(rest) < 2:
                return None
            rest = rest[2:]
        if method in _READ and rest in ((), ("ready",)):
            return Route(segments[2])
        if method == "POST" and len(rest) == 1 and rest[0] in _OIP_VERBS:
            return Route(segments[2])
        return None
    if len(segments) == 3 and segments[:2] == ("v1", "models"):
        name, colon, verb = segments[2].partition(":")
        if not colon and method in _READ:
            return Route(name)
        if colon and name and method == "POST" and verb in _V1_VERBS:
            return Route(name)
    return None


def model_in_body(body: bytes) -> str | None:
    """An OpenAI request's `model`, or None (the server says what is wrong with the body)."""
    if not body:
        return None
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    model = parsed.get("model") if isinstance(parsed, dict) else None
    return model if isinstance(model, str) and model else None


class DataPlane:
    def __init__(
        self,
        state: LocalState,
        residency: Residency,
        metrics: AgentMetrics,
        server_url: str,
        *,
        timeout: float,
        draining: Callable[[], bool],
        subscribed: Callable[[], bool] = lambda: True,
        max_connections: int = 1024,
    ) -> None:
        self._state = state
        self._residency = residency
        self._metrics = metrics
        self._server_url = server_url
        self._timeout = timeout
        self._draining = draining
        self._subscribed = subscribed
        self._client = Http1Client(max_connections=max_connections, connect_timeout=5.0)

    def app(self, max_body_bytes: int) -> web.Application:
        app = web.Application(client_max_size=max_body_bytes, middlewares=[_ERRORS.middleware])
        app.router.add_get("/metrics", self._metrics_page)
        # The agent's own probes (Kubernetes), under /agent/ so no server path is shadowed.
        app.router.add_get("/agent/livez", self._live)
        app.router.add_get("/agent/readyz", self._ready)
        app.router.add_route("*", "/{tail:.*}", self._proxy)
        return app

    async def close(self) -> None:
        self._client.close()

    async def _metrics_page(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self._metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def _live(self, request: web.Request) -> web.Response:
        return web.json_response({"live": True})

    async def _ready(self, request: web.Request) -> web.Response:
        """Ready while subscribed to the scheduler (it can place models here) and not draining."""
        if self._draining():
            return web.json_response({"ready": False, "reason": "draining"}, status=503)
        if not self._subscribed():
            return web.json_response(
                {"ready": False, "reason": "not subscribed to the scheduler"}, status=503
            )
        return web.json_response({"ready": True})

    async def _proxy(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        route = inference_route(request.method, request.raw_path)
        if route is None:  # before the body is read: nothing of it is wanted
            self._metrics.requests.labels("", "404").inc()
            raise NotForwarded(
                f"{request.method} {path[:200]}: not an inference path; the agent forwards inference "
                "requests (OIP v2, KServe v1, OpenAI) for its models only"
            )
        body = await request.read()
        name = model_in_body(body) if route.openai else route.model
        if name is not None and self._state.get(name) is None:
            self._metrics.requests.labels("", "404").inc()
            raise NotForwarded(f"model {name[:200]!r} is not served by this replica")
        if request.method == "GET":
            if path == "/v2/health/ready" and self._draining():
                return self._answer(request, "", 503, {"error": "the agent is draining"})
            if name is not None and path.endswith("/ready"):
                record = self._state.get(name)
                if record is not None and record.status in (ModelStatus.EVICTED, ModelStatus.RELOADING):
                    return self._answer(request, name, 200, {"name": name, "ready": True})
        pinned = False
        # Metrics name models the agent holds; any other name a client sends counts as "" (a
        # client probing names must not grow the number of series without bound).
        label = name if name is not None and self._state.get(name) is not None else ""
        try:
            if name is not None:
                pinned = await self._residency.acquire(name)
            upstream = await self._send(request, body)
            if upstream.status == 404 and pinned:
                assert name is not None
                answer = await upstream.read()
                if await self._lost(name):  # the server lost it: it was loaded again; once more
                    upstream = await self._send(request, body)
                else:  # the 404 is about something else (a path, a version): it is the answer
                    return self._answer_bytes(label, 404, answer, upstream)
            return await self._relay(request, label, upstream)
        except ModelyardError as error:  # counted here; `_ERRORS.middleware` renders it
            if isinstance(error, UpstreamError):
                log.warning("%s %s: %s", request.method, path, error.message)
            self._metrics.requests.labels(label, str(error.status)).inc()
            raise
        finally:
            if pinned:
                assert name is not None
                self._residency.release(name)

    async def _lost(self, name: str) -> bool:
        """After a 404 for a model held as loaded: whether the server had lost it (then it is
        loaded again here). A server that says the model is ready answered 404 for another
        reason; one whose repository cannot load it (no such API) leaves the 404 as it was."""
        if await self._residency.server_ready(name):
            return False
        try:
            await self._residency.force_load(name)
        except ModelNotResident as error:
            log.warning("%s", error.message)
            return False
        return True

    def _answer_bytes(self, label: str, status: int, body: bytes, upstream: UpstreamResponse) -> web.Response:
        self._metrics.requests.labels(label, str(status)).inc()
        return web.Response(body=body, status=status, headers=relayed_response_headers(upstream.headers))

    async def _send(self, request: web.Request, body: bytes) -> UpstreamResponse:
        request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        headers = forwarded_request_headers(request.headers.items(), request_id)
        return await self._client.request(
            self._server_url,
            request.method,
            request.raw_path,
            headers,
            body if body or request.method not in ("GET", "HEAD") else None,
            self._timeout,
        )

    async def _relay(
        self, request: web.Request, label: str, upstream: UpstreamResponse
    ) -> web.StreamResponse:
        headers = relayed_response_headers(upstream.headers)
        self._metrics.requests.labels(label, str(upstream.status)).inc()
        if upstream.content_type != "text/event-stream":
            return web.Response(body=await upstream.read(), status=upstream.status, headers=headers)
        try:
            return await self._stream(request, upstream, headers)
        finally:
            upstream.close()  # a whole stream gives its connection back to the pool, a cut one is dropped

    async def _stream(
        self, request: web.Request, upstream: UpstreamResponse, headers: CIMultiDict[str]
    ) -> web.StreamResponse:
        response = web.StreamResponse(status=upstream.status, headers=headers)
        await response.prepare(request)
        try:
            async for chunk in upstream.iter_chunks():
                await response.write(chunk)
        except UpstreamError as error:
            # The stream broke off: cut the client's connection too, rather than end the stream
            # cleanly, so the client (the gateway) sees it broken and not a whole answer.
            log.warning("%s: the server's stream broke off: %s", request.path, error.message)
            if request.transport is not None:
                request.transport.close()
            return response
        except ConnectionError:  # the client went away
            return response
        await response.write_eof()
        return response

    def _answer(self, request: web.Request, label: str, status: int, body: object) -> web.Response:
        self._metrics.requests.labels(label, str(status)).inc()
        return web.Response(body=orjson.dumps(body), status=status, content_type=_JSON)
