"""`create_app(config)`: the gateway as an aiohttp application, one instance per config."""

from __future__ import annotations

from aiohttp import web

from modelyard.config import GatewayConfig
from modelyard.gateway import admin, inference
from modelyard.gateway.gateway import GATEWAY, Gateway
from modelyard.gateway.oip_grpc import GatewayOip
from modelyard.gateway.openapi import openapi_handler
from modelyard.gateway.siblings import Siblings
from modelyard.gateway.ui import dashboard_handlers
from modelyard.graph import Graph
from modelyard.rpc import OipServer
from modelyard.serving.drain import install_drain
from modelyard.serving.h1 import Handler, Router
from modelyard.state import SharedState

OIP_GRPC = web.AppKey("oip_grpc", OipServer)

OPENAI_ROUTES = {
    "/v1/chat/completions": inference.openai_route("chat"),
    "/v1/completions": inference.openai_route("completions"),
    "/v1/embeddings": inference.openai_route("embeddings"),
}


def create_app(
    config: GatewayConfig,
    *,
    state: SharedState | None = None,
    seed: int | None = None,
    graphs: dict[str, Graph] | None = None,
    siblings: Siblings | None = None,
) -> web.Application:
    """Build a gateway application. `state` overrides the configured store (tests); `seed` fixes the
    RNG; `graphs` are already-loaded graphs (else the config's are loaded, ConfigError if invalid)."""
    app = web.Application(
        middlewares=[inference.ERRORS.middleware], client_max_size=config.limits.max_body_bytes
    )
    gateway = Gateway(config, state=state, seed=seed, graphs=graphs, siblings=siblings)
    app[GATEWAY] = gateway

    oip_grpc: OipServer | None = None
    if config.listen.grpc_port is not None:
        drain = install_drain(app)  # the server's drain: gRPC readiness follows it too
        oip_grpc = app[OIP_GRPC] = OipServer(
            GatewayOip(gateway, lambda: drain.active),
            config.listen.host,
            config.listen.grpc_port,
            max_message_bytes=config.limits.max_body_bytes,
            reuse_port=siblings is not None,  # one worker of a group: the parent reserved the port
            tls=config.listen.tls,
        )

    async def lifecycle(_app: web.Application):  # type: ignore[no-untyped-def]
        await gateway.start()
        if oip_grpc is not None:
            try:
                await oip_grpc.start()
            except BaseException:
                await gateway.stop()
                raise
        yield
        if oip_grpc is not None:  # the HTTP listener has drained; gRPC calls in flight get as long
            await oip_grpc.stop(config.listen.shutdown_timeout)
        await gateway.stop()

    async def end_log_streams(_app: web.Application) -> None:
        gateway.metrics.routing_log.close()  # before the server waits for handlers to finish

    app.cleanup_ctx.append(lifecycle)
    app.on_shutdown.append(end_log_streams)
    add = app.router.add_route
    view = inference.aiohttp_view
    for path, route in OPENAI_ROUTES.items():
        add("POST", path, view(route))
    add("GET", "/v1/models", inference.list_models)
    add("POST", "/v1/models/{name}:predict", view(inference.oip_infer))
    add("GET", "/v1/models/{name:[^/]+(?<!:predict)}", view(inference.model_get))  # :predict: POST only
    add("GET", "/v2", inference.oip_server_metadata)
    add("GET", "/v2/health/live", inference.oip_live)
    add("GET", "/v2/health/ready", inference.oip_ready)
    for prefix in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        add("GET", prefix, view(inference.model_get))
        add("GET", prefix + "/ready", view(inference.model_get))
        add("POST", prefix + "/infer", view(inference.oip_infer))
    add("GET", "/healthz", inference.healthz)
    add("GET", "/readyz", inference.readyz)
    add("GET", "/metrics", inference.metrics)
    add("GET", "/openapi.json", openapi_handler(gateway))
    add("GET", "/v1/graphs", admin.list_graphs)
    add("GET", "/v1/graphs/{name}", admin.get_graph)
    add("POST", "/v1/graphs/{name}", inference.run_graph)
    add("GET", "/admin/models/{model}/routes", admin.get_routes)
    add("PUT", "/admin/models/{model}/routes", admin.put_routes)
    add("GET", "/admin/models/{model}/canary", admin.get_canary)
    add("PUT", "/admin/graphs/{name}", admin.put_graph)
    add("DELETE", "/admin/graphs/{name}", admin.delete_graph)
    for path in ("/admin/strategy", "/strategy"):  # /strategy: InferFlow's path
        add("GET", path, admin.get_strategy)
        add("PUT", path, admin.put_strategy)
    add("GET", "/admin/overview", admin.get_overview)
    add("GET", "/admin/log", admin.get_log)
    add("GET", "/admin/log/stream", admin.stream_log)
    page, asset, to_page = dashboard_handlers()
    add("GET", "/dashboard", page)
    add("GET", "/dashboard/", to_page)  # the address as people type it
    add("GET", "/dashboard/{asset}", asset)
    return app


def lean_router(gateway: Gateway) -> Router:
    """The proxied routes, for the lean HTTP/1.1 connection (serving/h1.py): the same handlers as
    the aiohttp routes above, for the same paths (the connection leaves paths with a fragment,
    percent-escapes or dot segments to aiohttp, which decodes them); anything else is aiohttp's."""
    handle = inference.lean_handler
    openai_paths = {path: handle(gateway, route) for path, route in OPENAI_ROUTES.items()}
    oip_infer = handle(gateway, inference.oip_infer)
    model_get = handle(gateway, inference.model_get)
    none: dict[str, str] = {}

    def route(method: str, path: str) -> tuple[Handler, dict[str, str]] | None:
        if method == "POST":
            handler = openai_paths.get(path)
            if handler is not None:
                return handler, none
        elif method != "GET":
            return None
        parts = path.split("/")  # "", "v2", "models", name, ... or "", "v1", "models", name
        if len(parts) < 4 or parts[2] != "models" or not parts[3]:
            return None
        name = parts[3]
        if parts[1] == "v1" and len(parts) == 4:
            if method == "POST" and name.endswith(":predict") and len(name) > len(":predict"):
                return oip_infer, {"name": name[: -len(":predict")]}
            if method == "GET" and not name.endswith(":predict"):
                return model_get, {"name": name}
            return None
        if parts[1] != "v2":
            return None
        rest = parts[4:]
        match = {"name": name}
        if len(rest) >= 2 and rest[0] == "versions" and rest[1]:
            match["version"] = rest[1]
            rest = rest[2:]
        if method == "POST":
            return (oip_infer, match) if rest == ["infer"] else None
        return (model_get, match) if rest in ([], ["ready"]) else None

    return route
