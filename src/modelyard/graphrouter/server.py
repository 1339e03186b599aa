"""Serving the stand-alone router, with KServe's shutdown: on SIGTERM/SIGINT `/readyz` turns 503,
requests keep being served for the drain period, then the server stops (the drain itself is
`modelyard.serving`'s, shared with the gateway)."""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Mapping

from modelyard.config import ListenConfig, TlsServerConfig
from modelyard.graph import Graph
from modelyard.graphrouter.app import GO_SERVER_TIMEOUT, GraphResponder, create_router_app
from modelyard.serving import HttpServer
from modelyard.telemetry import Tracer
from modelyard.upstream.graph_invoker import UrlInvoker
from modelyard.upstream.http1 import Http1Client

GO_MAX_HEADER_BYTES = 1 << 20  # net/http's DefaultMaxHeaderBytes
GO_IDLE_TIMEOUT = 180.0  # KServe's router: IdleTimeout
ISTIO_ADMIN_URL = "http://localhost:15000"  # where KServe's router looks for an Istio sidecar


class RunningRouter:
    def __init__(
        self, server: HttpServer, responder: GraphResponder, client: Http1Client, host: str, port: int
    ) -> None:
        self.server = server
        self.responder = responder
        self.client = client
        self.url = f"http://{host}:{port}"
        self.port = port

    async def stop(self) -> None:
        await self.server.stop()
        self.client.close()
        if self.responder.tracer is not None:  # the spans still batched go out (blocking: off the loop)
            await asyncio.to_thread(self.responder.tracer.shutdown)


async def start_router(
    graph: Graph,
    *,
    host: str = "0.0.0.0",
    port: int = 8080,
    services: Mapping[str, str] | None = None,
    patterns: list[re.Pattern[str]] | None = None,
    seed: int | None = None,
    mesh_probe_url: str | None = ISTIO_ADMIN_URL,
    drain_seconds: float = 30.0,
    tracer: Tracer | None = None,
    tls: TlsServerConfig | None = None,
) -> RunningRouter:
    """`tracer`: trace each request and its steps (telemetry.build_tracer); None: off. `tls`: serve
    HTTPS (the certificate's files checked first: TlsError)."""
    timeouts = graph.spec.router_timeouts
    client = Http1Client(max_connections=1024, connect_timeout=30.0)
    invoker = UrlInvoker(
        client,
        services=services,
        call_timeout=float(timeouts.service_client) if timeouts and timeouts.service_client else None,
        mesh_probe_url=mesh_probe_url,
    )
    rng = random.Random(seed) if seed is not None else None
    responder = GraphResponder(graph, invoker, patterns or [], rng=rng, tracer=tracer)
    listen = ListenConfig(
        host=host,
        port=port,
        # Go's ReadTimeout (routerTimeouts.serverRead) also bounds reading the head.
        header_timeout=float(timeouts.server_read)
        if timeouts and timeouts.server_read
        else float(GO_SERVER_TIMEOUT),
        keepalive_timeout=float(timeouts.server_idle)
        if timeouts and timeouts.server_idle
        else GO_IDLE_TIMEOUT,
        drain_seconds=drain_seconds,
        shutdown_timeout=60.0,
        tls=tls,
    )
    try:
        server = HttpServer(
            create_router_app(responder),
            listen,
            max_line_size=GO_MAX_HEADER_BYTES,  # Go's server takes 1 MB of headers; aiohttp only 8 KB
            max_field_size=GO_MAX_HEADER_BYTES,
        )
        await server.start()
    except BaseException:
        client.close()
        raise
    return RunningRouter(
        server, responder, client, host if host not in ("0.0.0.0", "") else "127.0.0.1", server.port
    )
