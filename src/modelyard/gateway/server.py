"""Starting the gateway on a socket: in-process (tests, the embedded demo) or for the `serve` command
(which then waits with `modelyard.serving.serve_until_signal`)."""

from __future__ import annotations

from aiohttp import web

from modelyard.config import GatewayConfig
from modelyard.gateway.app import OIP_GRPC, create_app, lean_router
from modelyard.gateway.gateway import GATEWAY
from modelyard.gateway.inference import abandoned
from modelyard.gateway.siblings import Siblings
from modelyard.graph import Graph
from modelyard.serving import HttpServer
from modelyard.state import SharedState


class RunningGateway:
    """A gateway bound to a socket; `url` is where it answers."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.host = server.host
        self.port = server.port
        self.url = server.url
        grpc = server.app.get(OIP_GRPC)
        self.grpc_port: int | None = grpc.port if grpc is not None else None
        """Where OIP v2 over gRPC answers (on `host`), when listen.grpc_port is set."""

    @property
    def app(self) -> web.Application:
        return self.server.app

    async def stop(self) -> None:
        await self.server.stop()


async def start_gateway(
    config: GatewayConfig,
    *,
    state: SharedState | None = None,
    seed: int | None = None,
    graphs: dict[str, Graph] | None = None,
    siblings: Siblings | None = None,
) -> RunningGateway:
    """`siblings`: this process is one worker of a gateway (gateway/workers.py)."""
    app = create_app(config, state=state, seed=seed, graphs=graphs, siblings=siblings)
    server = HttpServer(
        app,
        config.listen,
        reuse_port=siblings is not None,
        lean=lean_router(app[GATEWAY]) if config.listen.lean else None,
        lean_abandoned=abandoned(app[GATEWAY]) if config.listen.lean else None,
        max_body_bytes=config.limits.max_body_bytes,
    )
    app[GATEWAY].watch_listener(server.stats)
    await server.start()
    return RunningGateway(server)
