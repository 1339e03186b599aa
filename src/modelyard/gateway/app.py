"""`create_app(config)`: the gateway as an aiohttp application, one instance per config."""

from __future__ import annotations

from typing import cast

from aiohttp import web

from modelyard.config import GatewayConfig
from modelyard.gateway import inference
from modelyard.gateway.gateway import GATEWAY, Gateway
from modelyard.gateway.inference import ProxiedRoute
from modelyard.gateway.oip_grpc import GatewayOip
from modelyard.gateway.route_table import ROUTES, WebHandler, lean_matcher
from modelyard.gateway.siblings import Siblings
from modelyard.graph import Graph
from modelyard.rpc import OipServer
from modelyard.serving.drain import install_drain
from modelyard.serving.h1 import Router
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
    for route in ROUTES:
        handler = (
            inference.aiohttp_view(cast(ProxiedRoute, route.handler))
            if route.lean
            else cast(WebHandler, route.handler)
        )
        app.router.add_route(route.method, route.path, handler)
    return app


def lean_router(gateway: Gateway) -> Router:
    """The routes marked lean, for the lean HTTP/1.1 connection (serving/h1.py): the same handlers as
    create_app's for the same paths (the connection leaves paths with a fragment, percent-escapes or
    dot segments to aiohttp, which decodes them); anything else is aiohttp's."""
    return lean_matcher(
        {
            (route.method, route.path): inference.lean_handler(gateway, cast(ProxiedRoute, route.handler))
            for route in ROUTES
            if route.lean
        }
    )
