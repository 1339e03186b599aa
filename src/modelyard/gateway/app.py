"""`create_app(config)`: the gateway as an aiohttp application, one instance per config."""

from __future__ import annotations

import hmac
import random
import time

import orjson
import yaml
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from modelyard import __version__
from modelyard.balancing import STRATEGIES, get_strategy
from modelyard.cluster import BackendLoad
from modelyard.config import GatewayConfig
from modelyard.errors import (
    BadRequest,
    ModelNotFound,
    Overloaded,
    PayloadTooLarge,
    Unauthorized,
)
from modelyard.gateway.errors import error_middleware
from modelyard.gateway.graphs import TRACE_REQUEST_HEADER, GatewayInvoker, GraphService, load_config_graphs
from modelyard.gateway.health import HealthChecker
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.gateway.models import ServedModel
from modelyard.gateway.openapi import openapi_handler
from modelyard.gateway.proxy import Proxy
from modelyard.graph import Graph
from modelyard.protocols import oip, openai
from modelyard.protocols.openai import parse_json_object
from modelyard.state import SharedState, open_state
from modelyard.types import RoutingRequest
from modelyard.upstream import UpstreamPool
from modelyard.upstream.graph_invoker import UrlInvoker
from modelyard.upstream.http1 import Http1Client
from modelyard.upstream.scrape import ResourceScraper


class Gateway:
    """Everything one gateway instance owns; built from config, no globals."""

    def __init__(
        self,
        config: GatewayConfig,
        *,
        state: SharedState | None = None,
        seed: int | None = None,
        graphs: dict[str, Graph] | None = None,
    ) -> None:
        self.config = config
        self.loads: dict[str, BackendLoad] = {}
        self.metrics = GatewayMetrics(lambda: self.loads.values())
        self.models = {
            m.name: ServedModel(m, self.loads, self.metrics.health_changed, self.metrics.outlier_event)
            for m in config.models
        }
        self.state = (
            state
            if state is not None
            else open_state(config.state, on_fallback=lambda _exc: self.metrics.state_fallbacks.inc())
        )
        self.pool = UpstreamPool(config.upstream)
        self.proxy = Proxy(self.pool, self.state, self.metrics, random.Random(seed))
        self.health = HealthChecker(self.models.values(), self.pool)
        self.scrapers: dict[str, tuple[ResourceScraper, Http1Client]] = {}
        invoker = GatewayInvoker(self.models, self.proxy, UrlInvoker(self.pool.client))
        self.graphs = GraphService(
            load_config_graphs(config, "config") if graphs is None else graphs,
            invoker,
            config.graph_propagate_headers,
            self.metrics.graph_step,
        )
        self.created = int(time.time())

    def model(self, name: str | None) -> ServedModel:
        served = self.models.get(name or "")
        if served is None:
            raise ModelNotFound(name, self.models)
        return served

    async def start(self) -> None:
        await self.health.check_once()  # serve with real health from the first request
        self.health.start()
        for model in self.models.values():
            if model.strategy.name == "resource_aware":
                self.ensure_scraper(model)

    def ensure_scraper(self, model: ServedModel) -> None:
        """Scrape the model's endpoints' /metrics while resource_aware may route it. The scraper has
        its own small client: through the proxy's pool a scrape would queue exactly when the
        server is saturated, and its snapshot would go stale when it matters most."""
        if model.name in self.scrapers:
            return
        client = Http1Client(max_connections=2, connect_timeout=self.config.upstream.connect_timeout)
        endpoints = model.config.endpoints
        scraper = ResourceScraper(
            model.endpoints,
            client,
            model.config.resource_aware,
            metrics_urls={e.url: e.metrics_url for e in endpoints if e.metrics_url},
            gpu_metrics_urls={e.url: e.gpu_metrics_url for e in endpoints if e.gpu_metrics_url},
        )
        # Started before anything awaits, and recorded with it: a cancelled admin call can no
        # longer leave a scraper recorded but never running. Its loop scrapes at once.
        scraper.start()
        self.scrapers[model.name] = (scraper, client)

    async def stop(self) -> None:
        await self.health.stop()
        await self.proxy.close()
        for scraper, client in self.scrapers.values():
            await scraper.stop()
            client.close()
        await self.pool.close()
        await self.state.close()


GATEWAY = web.AppKey("gateway", Gateway)


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


async def _read_body(request: web.Request) -> bytes:
    limit = request.client_max_size
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"request body is larger than limits.max_body_bytes ({limit} bytes)")
    return await request.read()


# --- OpenAI ---------------------------------------------------------------------------------


def _openai_handler(kind: str):  # type: ignore[no-untyped-def]
    async def handle(request: web.Request) -> web.StreamResponse:
        gateway = request.app[GATEWAY]
        body = await _read_body(request)
        routing = openai.routing_request(body, kind)
        return await gateway.proxy.forward(request, gateway.model(routing.model), routing, body)

    return handle


async def list_models(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY]
    data = [
        {"id": name, "object": "model", "created": gateway.created, "owned_by": "modelyard"}
        for name in gateway.models
    ]
    return _json({"object": "list", "data": data})


# --- Open Inference Protocol v2 and KServe v1 ------------------------------------------------


async def oip_infer(request: web.Request) -> web.StreamResponse:
    gateway = request.app[GATEWAY]
    model = gateway.model(request.match_info["name"])
    try:
        model.refuse_if_full()  # the model is in the path: refuse before buffering the body
    except Overloaded:
        gateway.metrics.overloaded.labels(model.name).inc()
        raise
    body = await _read_body(request)
    routing = oip.routing_request(
        model.name, body, request.headers, affinity_chars=model.config.kv_aware.prefix_chars
    )
    return await gateway.proxy.forward(request, model, routing, body)


async def model_get(request: web.Request) -> web.StreamResponse:
    """OIP model metadata/readiness and KServe v1 model status come from a serving endpoint."""
    gateway = request.app[GATEWAY]
    model = gateway.model(request.match_info["name"])
    return await gateway.proxy.forward(request, model, RoutingRequest(model=model.name), None)


async def oip_server_metadata(request: web.Request) -> web.Response:
    return _json({"name": "modelyard", "version": __version__, "extensions": []})


async def oip_live(request: web.Request) -> web.Response:
    return _json({"live": True})


async def oip_ready(request: web.Request) -> web.Response:
    ready = all(m.ready for m in request.app[GATEWAY].models.values())
    return _json({"ready": ready}, 200 if ready else 503)


# --- the gateway's own endpoints -------------------------------------------------------------


async def healthz(request: web.Request) -> web.Response:
    return _json({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    models = request.app[GATEWAY].models.values()
    not_ready = [m.name for m in models if not m.ready]
    body = {"ready": not not_ready, "models_without_healthy_endpoints": not_ready}
    return _json(body, 503 if not_ready else 200)


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[GATEWAY].metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def _check_admin(request: web.Request) -> None:
    token = request.app[GATEWAY].config.admin.token
    if token is None:
        return
    given = request.headers.get("Authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
        raise Unauthorized("admin calls need the header 'Authorization: Bearer <admin.token>'")


def _strategies(gateway: Gateway) -> dict[str, object]:
    per_model = {name: m.strategy.name for name, m in gateway.models.items()}
    names = set(per_model.values())
    return {
        "strategy": names.pop() if len(names) == 1 else "mixed",
        "models": per_model,
        "available": list(STRATEGIES),
    }


async def get_strategy_handler(request: web.Request) -> web.Response:
    _check_admin(request)
    return _json(_strategies(request.app[GATEWAY]))


async def put_strategy_handler(request: web.Request) -> web.Response:
    """Switch strategy for every model, or for one with {"model": ...}. Counters and affinity stay."""
    _check_admin(request)
    gateway = request.app[GATEWAY]
    data = parse_json_object(await _read_body(request))
    strategy = get_strategy(data.get("strategy"))
    target = data.get("model")
    if target is not None and not isinstance(target, str):
        raise BadRequest("'model' must be a string naming one model")
    for model in [gateway.model(target)] if target else gateway.models.values():
        model.strategy = strategy
        if strategy.name == "resource_aware":
            gateway.ensure_scraper(model)
    return _json(_strategies(gateway))


# --- routes and canaries -----------------------------------------------------------------------


def _routes_view(model: ServedModel) -> dict[str, object]:
    routes = [r.model_dump(mode="json", exclude_defaults=True) for r in model.config.routes]
    subsets = sorted({e.subset for e in model.endpoints})
    return {"model": model.name, "routes": routes, "subsets": subsets}


async def get_routes(request: web.Request) -> web.Response:
    _check_admin(request)
    return _json(_routes_view(request.app[GATEWAY].model(request.match_info["model"])))


async def put_routes(request: web.Request) -> web.Response:
    """Replace a model's routes (e.g. move a canary 10 -> 50 -> 100): `{"routes": [...]}` or a
    list, JSON or YAML; validated first (400 with every problem), then swapped atomically."""
    _check_admin(request)
    model = request.app[GATEWAY].model(request.match_info["model"])
    try:
        data = yaml.safe_load((await _read_body(request)).decode("utf-8", "replace"))
    except yaml.YAMLError as exc:
        raise BadRequest(f"routes must be JSON or YAML: {exc}") from None
    routes = data.get("routes") if isinstance(data, dict) else data
    model.replace_routes(routes)
    return _json(_routes_view(model))


async def get_canary(request: web.Request) -> web.Response:
    """Per route with a mirror: answers compared (mean ROUGE-L, exact-match rate) and each
    subset's p50/p95 latency and error rate."""
    _check_admin(request)
    model = request.app[GATEWAY].model(request.match_info["model"])
    mirrors = {r.name: r.mirror.model_dump() for r in model.config.routes if r.mirror is not None}
    return _json({"model": model.name, "mirrors": mirrors, "routes": model.canary_summary()})


# --- inference graphs ------------------------------------------------------------------------


def _graph_summary(graph: Graph) -> dict[str, object]:
    nodes = {
        name: {"routerType": node.router_type, "steps": len(node.steps)}
        for name, node in graph.spec.nodes.items()
    }
    return {"name": graph.name, "nodes": nodes, "timeout": graph.spec.timeout}


async def list_graphs(request: web.Request) -> web.Response:
    graphs = request.app[GATEWAY].graphs.graphs
    return _json({"object": "list", "data": [_graph_summary(g) for g in graphs.values()]})


async def get_graph(request: web.Request) -> web.Response:
    graph = request.app[GATEWAY].graphs.get(request.match_info["name"])
    return _json(
        {
            **_graph_summary(graph),
            "spec": graph.spec.model_dump(mode="json", by_alias=True, exclude_defaults=True),
        }
    )


async def run_graph(request: web.Request) -> web.Response:
    """Run a graph; `X-Modelyard-Trace: 1` adds `X-Modelyard-Graph-Trace` (every step, its status and ms)."""
    service = request.app[GATEWAY].graphs
    name = request.match_info["name"]
    service.get(name)  # 404 before reading the body
    body = await _read_body(request)
    want_trace = request.headers.get(TRACE_REQUEST_HEADER, "") not in ("", "0", "false")
    return await service.run(name, body, list(request.headers.items()), want_trace)


async def put_graph(request: web.Request) -> web.Response:
    _check_admin(request)
    name = request.match_info["name"]
    graph, warnings = request.app[GATEWAY].graphs.put(name, await _read_body(request))
    return _json({**_graph_summary(graph), "warnings": warnings})


async def delete_graph(request: web.Request) -> web.Response:
    _check_admin(request)
    name = request.match_info["name"]
    request.app[GATEWAY].graphs.delete(name)
    return _json({"deleted": name})


def create_app(
    config: GatewayConfig,
    *,
    state: SharedState | None = None,
    seed: int | None = None,
    graphs: dict[str, Graph] | None = None,
) -> web.Application:
    """Build a gateway application. `state` overrides the configured store (tests); `seed` fixes the
    RNG; `graphs` are already-loaded graphs (else the config's are loaded, ConfigError if invalid)."""
    app = web.Application(middlewares=[error_middleware], client_max_size=config.limits.max_body_bytes)
    gateway = Gateway(config, state=state, seed=seed, graphs=graphs)
    app[GATEWAY] = gateway

    async def lifecycle(_app: web.Application):  # type: ignore[no-untyped-def]
        await gateway.start()
        yield
        await gateway.stop()

    app.cleanup_ctx.append(lifecycle)
    add = app.router.add_route
    add("POST", "/v1/chat/completions", _openai_handler("chat"))
    add("POST", "/v1/completions", _openai_handler("completions"))
    add("POST", "/v1/embeddings", _openai_handler("embeddings"))
    add("GET", "/v1/models", list_models)
    add("POST", "/v1/models/{name}:predict", oip_infer)
    add("GET", "/v1/models/{name:[^/]+(?<!:predict)}", model_get)  # :predict is POST only (405, Allow)
    add("GET", "/v2", oip_server_metadata)
    add("GET", "/v2/health/live", oip_live)
    add("GET", "/v2/health/ready", oip_ready)
    for prefix in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        add("GET", prefix, model_get)
        add("GET", prefix + "/ready", model_get)
        add("POST", prefix + "/infer", oip_infer)
    add("GET", "/healthz", healthz)
    add("GET", "/readyz", readyz)
    add("GET", "/metrics", metrics)
    add("GET", "/openapi.json", openapi_handler(gateway))
    add("GET", "/admin/models/{model}/routes", get_routes)
    add("PUT", "/admin/models/{model}/routes", put_routes)
    add("GET", "/admin/models/{model}/canary", get_canary)
    add("GET", "/v1/graphs", list_graphs)
    add("GET", "/v1/graphs/{name}", get_graph)
    add("POST", "/v1/graphs/{name}", run_graph)
    add("PUT", "/admin/graphs/{name}", put_graph)
    add("DELETE", "/admin/graphs/{name}", delete_graph)
    for path in ("/admin/strategy", "/strategy"):  # /strategy: InferFlow's path
        add("GET", path, get_strategy_handler)
        add("PUT", path, put_strategy_handler)
    return app
