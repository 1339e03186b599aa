"""`create_app(config)`: the gateway as an aiohttp application, one instance per config."""

from __future__ import annotations

from aiohttp import web

from modelyard.config import GatewayConfig
from modelyard.gateway import admin, inference
from modelyard.gateway.errors import error_middleware
from modelyard.gateway.gateway import GATEWAY, Gateway
from modelyard.gateway.oip_grpc import GatewayOip
from modelyard.gateway.openapi import openapi_handler
from modelyard.gateway.siblings import Siblings
from modelyard.gateway.ui import dashboard_handlers
from modelyard.graph import Graph
from modelyard.rpc import OipServer
from modelyard.serving.drain import install_drain
from modelyard.state import SharedState

OIP_GRPC = web.AppKey("oip_grpc", OipServer)


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
    app = web.Application(middlewares=[error_middleware], client_max_size=config.limits.max_body_bytes)
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
    add("POST", "/v1/chat/completions", inference.openai_handler("chat"))
    add("POST", "/v1/completions", inference.openai_handler("completions"))
    add("POST", "/v1/embeddings", inference.openai_handler("embeddings"))
    add("GET", "/v1/models", inference.list_models)
    add("POST", "/v1/models/{name}:predict", inference.oip_infer)
    add("GET", "/v1/models/{name:[^/]+(?<!:predict)}", inference.model_get)  # :predict: POST only
    add("GET", "/v2", inference.oip_server_metadata)
    add("GET", "/v2/health/live", inference.oip_live)
    add("GET", "/v2/health/ready", inference.oip_ready)
    for prefix in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        add("GET", prefix, inference.model_get)
        add("GET", prefix + "/ready", inference.model_get)
        add("POST", prefix + "/infer", inference.oip_infer)
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
