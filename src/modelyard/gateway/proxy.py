"""Forward one request to one of a model's endpoints and relay the answer.

The body arrives parsed once (for routing) and leaves as the original bytes. A refused
connection is tried on another healthy endpoint (nothing was sent, so it is safe); anything
after the request was sent is answered as it is. Streams are relayed chunk by chunk as they
arrive; a client that goes away cancels the upstream request (aiohttp handler cancellation,
and a failed write closes the upstream response).
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import time

from aiohttp import web
from multidict import CIMultiDict

from modelyard.balancing import Pick, RoutingContext, affinity_key
from modelyard.cluster import Endpoint
from modelyard.errors import ModelyardError, NoHealthyEndpoint, UpstreamError, UpstreamUnreachable
from modelyard.gateway.errors import REQUEST_ID
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.gateway.models import ServedModel
from modelyard.state import SharedState
from modelyard.types import RoutingRequest
from modelyard.upstream import (
    UpstreamPool,
    UpstreamResponse,
    forwarded_request_headers,
    relayed_response_headers,
)

log = logging.getLogger("modelyard.gateway")

BACKEND_HEADER = "X-Modelyard-Backend"
STRATEGY_HEADER = "X-Modelyard-Strategy"
CACHE_HIT_HEADER = "X-Modelyard-Cache-Hit"
REQUEST_ID_HEADER = "X-Request-Id"
CLIENT_CLOSED = 499  # nginx's code for "client closed the request", used in metrics only


class Proxy:
    def __init__(
        self, pool: UpstreamPool, state: SharedState, metrics: GatewayMetrics, rng: random.Random
    ) -> None:
        self._pool = pool
        self._state = state
        self._metrics = metrics
        self._rng = rng
        # Request ids: a random per-gateway prefix and a counter; unique without a syscall per request.
        self._id_prefix = os.urandom(8).hex()
        self._id_counter = itertools.count(1)

    def _new_request_id(self) -> str:
        return f"{self._id_prefix}{next(self._id_counter):016x}"

    async def forward(
        self, request: web.Request, model: ServedModel, routing: RoutingRequest, body: bytes | None
    ) -> web.StreamResponse:
        started = time.perf_counter()
        strategy = model.strategy
        seq = model.next_seq()
        key = remembered = None
        if strategy.uses_affinity:
            key = affinity_key(model.name, routing.prompt, model.config.kv_aware.prefix_chars)
            remembered = await self._state.get(key)
        ctx = RoutingContext(routing, seq, remembered)
        request_id = request.headers.get(REQUEST_ID_HEADER) or self._new_request_id()
        request[REQUEST_ID] = request_id
        headers = forwarded_request_headers(request.headers.items(), request_id)
        tokens = routing.prompt_tokens + routing.max_tokens

        endpoint, pick, upstream = await self._send(
            model, ctx, request.method, request.raw_path, headers, body, tokens, started
        )
        if key is not None:
            self._metrics.kv_affinity.labels("hit" if pick.cache_hit else "miss").inc()
            if not pick.cache_hit:
                await self._state.set(key, endpoint.name, model.config.kv_aware.ttl)

        out_headers = relayed_response_headers(upstream.headers)
        out_headers[BACKEND_HEADER] = endpoint.name
        out_headers[STRATEGY_HEADER] = strategy.name
        out_headers[REQUEST_ID_HEADER] = request_id
        if pick.cache_hit is not None:
            out_headers[CACHE_HIT_HEADER] = "true" if pick.cache_hit else "false"

        code = CLIENT_CLOSED
        try:
            if upstream.content_type == "text/event-stream":
                response = await self._relay_stream(request, upstream, out_headers, model.name, started)
            else:
                data = await upstream.read()
                response = web.Response(body=data, status=upstream.status, headers=out_headers)
            code = upstream.status
            return response
        except UpstreamError as exc:
            code = exc.status
            raise
        finally:
            upstream.close()
            endpoint.load.release(tokens)
            self._metrics.observe_request(
                model.name, endpoint.name, strategy.name, code, time.perf_counter() - started
            )

    async def call(
        self, model: ServedModel, method: str, path: str, headers: list[tuple[str, str]], body: bytes
    ) -> tuple[int, bytes]:
        """A routed call made by the gateway itself (a graph step naming a model): the model's
        strategy and health pick the endpoint, as for a client request; status and body come back."""
        started = time.perf_counter()
        tokens = len(body) // 4
        ctx = RoutingContext(RoutingRequest(model=model.name, prompt_tokens=tokens), model.next_seq())
        endpoint, _pick, upstream = await self._send(model, ctx, method, path, headers, body, tokens, started)
        code = CLIENT_CLOSED
        try:
            data = await upstream.read()
            code = upstream.status
            return upstream.status, data
        except UpstreamError as exc:
            code = exc.status
            raise
        finally:
            upstream.close()
            endpoint.load.release(tokens)
            self._metrics.observe_request(
                model.name, endpoint.name, model.strategy.name, code, time.perf_counter() - started
            )

    async def _send(
        self,
        model: ServedModel,
        ctx: RoutingContext,
        method: str,
        path: str,
        headers: list[tuple[str, str]],
        body: bytes | None,
        tokens: int,
        started: float,
    ) -> tuple[Endpoint, Pick, UpstreamResponse]:
        """Pick an endpoint and send; a refused connection moves on to another healthy endpoint."""
        strategy = model.strategy
        tried: list[Endpoint] = []
        while True:
            candidates = [e for e in model.endpoints if e.health.healthy and e not in tried]
            if not candidates:
                error: ModelyardError
                if tried:
                    names = ", ".join(e.name for e in tried)
                    error = UpstreamError(
                        f"every endpoint of model {model.name!r} refused the connection: {names}"
                    )
                else:
                    error = NoHealthyEndpoint(
                        f"model {model.name!r} has no healthy endpoint", headers={"Retry-After": "1"}
                    )
                self._metrics.observe_request(
                    model.name, "", strategy.name, error.status, time.perf_counter() - started
                )
                raise error
            pick = strategy.pick(candidates, ctx, self._rng)
            endpoint = candidates[pick.index]
            endpoint.load.acquire(tokens)
            try:
                upstream = await self._pool.send(endpoint.url, method, path, headers, body)
            except UpstreamUnreachable as exc:
                endpoint.load.release(tokens)
                tried.append(endpoint)
                model.record_unreachable(endpoint, exc.message)
                continue
            except BaseException as exc:
                endpoint.load.release(tokens)
                code = exc.status if isinstance(exc, UpstreamError) else CLIENT_CLOSED
                self._metrics.observe_request(
                    model.name, endpoint.name, strategy.name, code, time.perf_counter() - started
                )
                raise
            return endpoint, pick, upstream

    async def _relay_stream(
        self,
        request: web.Request,
        upstream: UpstreamResponse,
        headers: CIMultiDict[str],
        model: str,
        started: float,
    ) -> web.StreamResponse:
        response = web.StreamResponse(status=upstream.status, headers=headers)
        await response.prepare(request)
        first = True
        try:
            async for chunk in upstream.iter_chunks():
                if first:
                    self._metrics.ttft.labels(model).observe(time.perf_counter() - started)
                    first = False
                await response.write(chunk)
        except UpstreamError as exc:
            # The server broke off mid-stream; the status is already sent, so end what we have.
            log.warning("upstream stream for model %s ended early: %r", model, exc)
        await response.write_eof()
        return response
