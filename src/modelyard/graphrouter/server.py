"""Serving the stand-alone router, with KServe's shutdown: on SIGTERM/SIGINT `/readyz` turns 503,
requests keep being served for the drain period, then the server stops."""

from __future__ import annotations

import asyncio
import random
import re
import signal
from collections.abc import Mapping

from aiohttp import web

from modelyard.graph import Graph
from modelyard.graphrouter.app import GraphResponder, create_router_app
from modelyard.upstream.graph_invoker import UrlInvoker
from modelyard.upstream.http1 import Http1Client

GO_MAX_HEADER_BYTES = 1 << 20  # net/http's DefaultMaxHeaderBytes
ISTIO_ADMIN_URL = "http://localhost:15000"  # where KServe's router looks for an Istio sidecar


class RunningRouter:
    def __init__(
        self, runner: web.AppRunner, responder: GraphResponder, client: Http1Client, host: str, port: int
    ) -> None:
        self.runner = runner
        self.responder = responder
        self.client = client
        self.url = f"http://{host}:{port}"
        self.port = port

    async def stop(self) -> None:
        await self.runner.cleanup()
        self.client.close()


async def start_router(
    graph: Graph,
    *,
    host: str = "0.0.0.0",
    port: int = 8080,
    services: Mapping[str, str] | None = None,
    patterns: list[re.Pattern[str]] | None = None,
    seed: int | None = None,
    mesh_probe_url: str | None = ISTIO_ADMIN_URL,
) -> RunningRouter:
    timeouts = graph.spec.router_timeouts
    client = Http1Client(max_connections=1024, connect_timeout=30.0)
    invoker = UrlInvoker(
        client,
        services=services,
        call_timeout=float(timeouts.service_client) if timeouts and timeouts.service_client else None,
        mesh_probe_url=mesh_probe_url,
    )
    rng = random.Random(seed) if seed is not None else None
    responder = GraphResponder(graph, invoker, patterns or [], rng=rng)
    idle = float(timeouts.server_idle) if timeouts and timeouts.server_idle else 180.0  # Go: IdleTimeout
    runner = web.AppRunner(
        create_router_app(responder),
        handler_cancellation=True,
        access_log=None,
        keepalive_timeout=idle,
        max_line_size=GO_MAX_HEADER_BYTES,  # Go's server takes 1 MB of headers; aiohttp only 8 KB
        max_field_size=GO_MAX_HEADER_BYTES,
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    bound = runner.addresses[0][1]
    return RunningRouter(
        runner, responder, client, host if host not in ("0.0.0.0", "") else "127.0.0.1", bound
    )


async def serve_router_until_signal(router: RunningRouter, drain_seconds: float) -> None:
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.set)
    await stopping.wait()
    router.responder.draining = True
    await asyncio.sleep(drain_seconds)  # let load balancers see /readyz fail before we go
    await router.stop()
