"""KServe's router contract: every path and method runs the graph; `GET /readyz` answers 200, and
503 `shutting down` once a SIGTERM has started the drain."""

from __future__ import annotations

import asyncio
import logging
import random
import re

from aiohttp import web

from modelyard.graph import Graph, GraphFailure, Invoker, Outcome, RunContext, answer
from modelyard.graph.headers import propagated
from modelyard.serving import answer_response, draining
from modelyard.telemetry import GraphSpans, Tracer, end_graph_span, start_graph_span


class GraphResponder:
    """Runs the graph for one HTTP request."""

    def __init__(
        self,
        graph: Graph,
        invoker: Invoker,
        patterns: list[re.Pattern[str]],
        *,
        rng: random.Random | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        self.graph = graph
        self.tracer = tracer  # None: tracing off
        self.invoker = invoker
        self.patterns = patterns
        self.rng = rng or random.SystemRandom()  # KServe draws Splitter routes from crypto/rand

    async def respond(self, body: bytes, headers: list[tuple[str, str]], path: str = "/") -> web.Response:
        # As KServe's router: spec.timeout is not applied (Knative enforces it in front, if anyone).
        ctx = RunContext(self.invoker, propagated(headers, self.patterns), self.rng, enforce_timeout=False)
        span = None
        if self.tracer is not None:  # the request's span; each step's is its child
            span = start_graph_span(self.tracer, self.graph.name, headers, path)
            ctx.spans = GraphSpans(span)
        result: Outcome | GraphFailure | None = None
        try:
            result = await self.graph.run(body, ctx)
        except GraphFailure as failure:
            result = failure
        except Exception as exc:  # a bug of ours must still answer as KServe's router does
            log.exception("graph %s failed", self.graph.name)
            result = GraphFailure(500, str(exc))
        finally:
            if span is not None:
                end_graph_span(span, result.status if result is not None else None)
        assert result is not None
        return answer_response(answer(result))


log = logging.getLogger("modelyard.graphrouter")

GO_SERVER_TIMEOUT = 60  # KServe's router: ReadTimeout and WriteTimeout default to a minute

ROUTER = web.AppKey("graph_router", GraphResponder)


async def _readyz(request: web.Request) -> web.Response:
    if draining(request):
        return web.Response(
            status=503,
            body=b"shutting down\n",
            headers={"Content-Type": "text/plain; charset=utf-8", "X-Content-Type-Options": "nosniff"},
        )
    response = web.Response(status=200, body=b"")
    response.headers.pop("Content-Type", None)
    return response


async def _run_graph(request: web.Request) -> web.Response:
    """routerTimeouts.serverRead bounds reading the request and serverWrite the whole exchange, as
    Go's http.Server does (default 60 s each). Past either the connection is closed with no
    answer, as KServe's client sees it; unlike Go, the graph's pending calls are cancelled too."""
    responder = request.app[ROUTER]
    timeouts = responder.graph.spec.router_timeouts
    read_limit = _seconds(timeouts.server_read if timeouts else None)
    write_limit = _seconds(timeouts.server_write if timeouts else None)
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        async with asyncio.timeout(read_limit):
            body = await request.read()
        async with asyncio.timeout(started + write_limit - loop.time()):
            return await responder.respond(body, list(request.headers.items()), request.path)
    except TimeoutError:
        if request.transport is not None:
            request.transport.close()
        raise


def _seconds(value: int | None) -> float:
    return float(value) if value else float(GO_SERVER_TIMEOUT)


def create_router_app(
    responder: GraphResponder, *, max_body_bytes: int = 1024 * 1024 * 1024
) -> web.Application:
    app = web.Application(client_max_size=max_body_bytes)  # Go's server has no body limit; ours is large
    app[ROUTER] = responder
    app.router.add_route("*", "/readyz", _readyz)  # Go's mux answers readiness for any method
    app.router.add_route("*", "/{tail:.*}", _run_graph)
    return app
