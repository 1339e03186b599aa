"""Forward one request to one of a model's endpoints and relay the answer.

The request takes a route (the model's first matching route, or the implicit one), the route
picks a subset by weight, and the model's strategy picks an endpoint in it. A try that fails in a
way the route's retry policy names (refused connection, reset, a retriable status, a per-try
timeout) is retried on another endpoint when one is available, with jittered exponential backoff
and within the model's retry budget. Nothing is retried once a stream's first byte has gone to
the client. Every endpoint has an in-flight limit (`max_requests`); when all are full a request
waits in a bounded queue, or gets 429 at once.

The body arrives parsed once (for routing) and leaves as the original bytes. Streams are relayed
chunk by chunk as they arrive; a client that goes away cancels the upstream request (aiohttp
handler cancellation, and a failed write closes the upstream response).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import random
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from modelyard.balancing import Pick, RoutingContext, affinity_key
from modelyard.balancing.routes import ALL_SUBSETS, mirrors, pick_subset
from modelyard.cluster import Endpoint
from modelyard.cluster.canary import answer_text, exact_match, rouge_l
from modelyard.config import Destination, RetryPolicy, RouteConfig
from modelyard.errors import (
    ModelyardError,
    NoHealthyEndpoint,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnreachable,
)
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
ROUTE_HEADER = "X-Modelyard-Route"
SUBSET_HEADER = "X-Modelyard-Subset"
REQUEST_ID_HEADER = "X-Request-Id"
CLIENT_CLOSED = 499  # nginx's code for "client closed the request", used in metrics only

# The route of a model without routes: every endpoint, the default timeouts and retries.
IMPLICIT_ROUTE = RouteConfig(name="default", destinations=[Destination(subset=ALL_SUBSETS)])
_GATEWAY_ERRORS = frozenset({502, 503, 504})
_RETRIABLE_4XX = frozenset({409, 429})


_CAPTURE_LIMIT = 1024 * 1024  # bytes of an answer kept for comparing with its shadow


@dataclass(slots=True)
class _Capture:
    """An answer kept for the canary comparison (bounded), with how it went."""

    subset: str
    status: int = 0
    content_type: str | None = None
    seconds: float = 0.0
    parts: list[bytes] = field(default_factory=list)
    size: int = 0

    def add(self, data: bytes) -> None:
        if self.size < _CAPTURE_LIMIT:
            self.parts.append(data[: _CAPTURE_LIMIT - self.size])
            self.size += len(self.parts[-1])

    def finish(self, status: int, content_type: str | None) -> None:
        self.status = status
        self.content_type = content_type

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 400

    def text(self) -> str | None:
        return answer_text(b"".join(self.parts), self.content_type)


@dataclass(slots=True)
class _Try:
    """The outcome of one attempt that may be retried."""

    reason: str  # a retry_on name: connect-failure, reset, 5xx, gateway-error, retriable-4xx, or "" (final)
    error: ModelyardError | None = None
    response: UpstreamResponse | None = None


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
        self._background: set[asyncio.Task[None]] = set()  # shadow requests in flight

    def _new_request_id(self) -> str:
        return f"{self._id_prefix}{next(self._id_counter):016x}"

    async def forward(
        self, request: web.Request, model: ServedModel, routing: RoutingRequest, body: bytes | None
    ) -> web.StreamResponse:
        started = time.perf_counter()
        compiled = model.route_for(request.headers, routing.fields)
        route = compiled.config if compiled else IMPLICIT_ROUTE
        subset = pick_subset(route, request.headers, self._rng)
        strategy = model.strategy
        key = remembered = None
        if strategy.uses_affinity:
            key = affinity_key(model.name, routing.prompt, model.config.kv_aware.prefix_chars)
            remembered = await self._state.get(key)
        ctx = RoutingContext(
            routing,
            model.next_seq(),
            remembered,
            now=time.monotonic(),
            resource=model.config.resource_aware,
        )
        request_id = request.headers.get(REQUEST_ID_HEADER) or self._new_request_id()
        request[REQUEST_ID] = request_id
        headers = forwarded_request_headers(request.headers.items(), request_id)
        tokens = routing.prompt_tokens + routing.max_tokens

        primary: asyncio.Future[_Capture] | None = None
        capture = None
        # A request already going to the mirror subset has nothing to be compared with.
        if route.mirror is not None and route.mirror.subset != subset and mirrors(route, self._rng):
            primary = asyncio.get_running_loop().create_future()
            capture = _Capture(subset)
            shadow = self._shadow(
                model, route, ctx, request.method, request.raw_path, headers, body, tokens, primary
            )
            self._spawn(shadow)

        model.active_requests += 1
        try:
            endpoint, pick, upstream = await self._attempts(
                model, route, subset, ctx, request.method, request.raw_path, headers, body, tokens
            )
            if key is not None:
                self._metrics.kv_affinity.labels("hit" if pick.cache_hit else "miss").inc()
                if not pick.cache_hit:
                    try:
                        await self._state.set(key, endpoint.name, model.config.kv_aware.ttl)
                    except BaseException:  # the client left while we wrote: free what we hold
                        self._finish(model, endpoint, upstream, tokens, CLIENT_CLOSED, started)
                        raise
            out_headers = relayed_response_headers(upstream.headers)
            out_headers[BACKEND_HEADER] = endpoint.name
            out_headers[STRATEGY_HEADER] = strategy.name
            out_headers[ROUTE_HEADER] = route.name
            out_headers[SUBSET_HEADER] = subset
            out_headers[REQUEST_ID_HEADER] = request_id
            if pick.cache_hit is not None:
                out_headers[CACHE_HIT_HEADER] = "true" if pick.cache_hit else "false"
            return await self._respond(
                request, model, route, endpoint, upstream, out_headers, tokens, started, capture
            )
        finally:
            model.active_requests -= 1
            if primary is not None and capture is not None:
                capture.seconds = time.perf_counter() - started
                primary.set_result(capture)

    async def call(
        self, model: ServedModel, method: str, path: str, headers: list[tuple[str, str]], body: bytes
    ) -> tuple[int, bytes]:
        """A routed call made by the gateway itself (a graph step naming a model): the model's
        routes, strategy, health and retries apply, as for a client request."""
        started = time.perf_counter()
        lookup = CIMultiDict(headers)
        compiled = model.route_for(lookup, None)
        route = compiled.config if compiled else IMPLICIT_ROUTE
        subset = pick_subset(route, lookup, self._rng)
        tokens = len(body) // 4
        ctx = RoutingContext(
            RoutingRequest(model=model.name, prompt_tokens=tokens),
            model.next_seq(),
            now=time.monotonic(),
            resource=model.config.resource_aware,
        )
        model.active_requests += 1
        try:
            endpoint, _pick, upstream = await self._attempts(
                model, route, subset, ctx, method, path, headers, body, tokens
            )
            code = CLIENT_CLOSED
            try:
                data = await upstream.read()
                code = upstream.status
                return upstream.status, data
            except UpstreamError as exc:
                code = exc.status
                raise
            finally:
                self._finish(model, endpoint, upstream, tokens, code, started)
        finally:
            model.active_requests -= 1

    # --- tries ----------------------------------------------------------------------------------

    async def _attempts(
        self,
        model: ServedModel,
        route: RouteConfig,
        subset: str,
        ctx: RoutingContext,
        method: str,
        path: str,
        headers: list[tuple[str, str]],
        body: bytes | None,
        tokens: int,
        *,
        counted: bool = True,
    ) -> tuple[Endpoint, Pick, UpstreamResponse]:
        """Try, and retry as the route's policy allows. Returns with the chosen endpoint acquired
        (the caller releases it) and the response head received. `counted=False` (shadow copies)
        keeps the tries out of the request metrics, which describe what clients got."""
        policy = route.retries
        # The route's timeout covers every try, the waits and the answer's body: each try gets what
        # is left as its client deadline (a timer per exchange, no extra task or context).
        deadline = time.monotonic() + route.timeout if route.timeout else None
        tried: list[Endpoint] = []
        retries = 0
        retrying = False  # holds a place in the retry budget from the decision to the try's end
        try:
            while True:
                endpoint, pick = await self._choose(model, subset, ctx, tried, tokens, deadline, counted)
                started = time.perf_counter()
                try:
                    outcome = await self._try(model, route, endpoint, method, path, headers, body, deadline)
                except BaseException as exc:  # cancelled (the client left), or the route's time is up
                    model.release(endpoint, tokens)
                    if counted:
                        code = exc.status if isinstance(exc, ModelyardError) else CLIENT_CLOSED
                        self._observe(model, endpoint, code, started)
                    raise
                if retrying:
                    model.active_retries -= 1
                    retrying = False
                head_seconds = time.perf_counter() - started
                # 5xx answers and failures to answer count against the endpoint; the time to the
                # response head is its latency (a stream's length says nothing about the server).
                failed = outcome.error is not None or (
                    outcome.response is not None and outcome.response.status >= 500
                )
                model.record_outcome(endpoint, not failed, None if failed else head_seconds, time.monotonic())
                if not outcome.reason:
                    assert outcome.response is not None
                    return endpoint, pick, outcome.response
                # A failed try: free the endpoint and decide whether to go again. It is counted here
                # when it ends here (retried or raised); an answer relayed as it is counts once, later.
                code = (
                    outcome.error.status
                    if outcome.error
                    else (outcome.response.status if outcome.response else 502)
                )
                tried.append(endpoint)
                out_of_time = deadline is not None and time.monotonic() >= deadline
                retriable = not out_of_time and (
                    outcome.reason in policy.retry_on
                    or (
                        outcome.response is not None
                        and outcome.response.status in policy.retriable_status_codes
                    )
                )
                if retriable and retries < policy.attempts and self._budget(model, route):
                    if counted:
                        self._observe(model, endpoint, code, started)
                    retries += 1
                    self._metrics.retries.labels(model.name, route.name, outcome.reason).inc()
                    if outcome.response is not None:
                        outcome.response.close()
                    model.release(endpoint, tokens)
                    model.active_retries += 1
                    retrying = True
                    pause = self._backoff(route, retries)
                    if deadline is not None:
                        pause = max(0.0, min(pause, deadline - time.monotonic()))
                    await asyncio.sleep(pause)
                    continue
                if outcome.response is not None and not out_of_time:
                    return endpoint, pick, outcome.response  # not retried: relay the answer as it is
                if outcome.response is not None:
                    outcome.response.close()
                model.release(endpoint, tokens)
                if out_of_time:
                    code = 504
                if counted:
                    self._observe(model, endpoint, code, started)
                if out_of_time:
                    raise UpstreamTimeout(
                        f"model {model.name!r}: route {route.name!r} did not finish within {route.timeout:g}s"
                    )
                assert outcome.error is not None
                if outcome.reason == "connect-failure" and len(tried) > 1:
                    names = ", ".join(e.name for e in tried)
                    raise UpstreamError(
                        f"every endpoint of model {model.name!r} tried refused the connection: {names}"
                    )
                raise outcome.error
        finally:
            if retrying:
                model.active_retries -= 1

    async def _try(
        self,
        model: ServedModel,
        route: RouteConfig,
        endpoint: Endpoint,
        method: str,
        path: str,
        headers: list[tuple[str, str]],
        body: bytes | None,
        deadline: float | None,
    ) -> _Try:
        remaining = None
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise UpstreamTimeout(
                    f"model {model.name!r}: route {route.name!r} did not finish within {route.timeout:g}s"
                )
        try:
            if route.per_try_timeout:
                async with asyncio.timeout(route.per_try_timeout):
                    response = await self._pool.send(endpoint.url, method, path, headers, body, remaining)
            else:
                response = await self._pool.send(endpoint.url, method, path, headers, body, remaining)
        except UpstreamUnreachable as exc:
            model.record_unreachable(endpoint, exc.message)
            return _Try("connect-failure", error=exc)
        except TimeoutError:
            error = UpstreamTimeout(
                f"{endpoint.name} did not answer within per_try_timeout {route.per_try_timeout:g}s"
            )
            return _Try("gateway-error", error=error)
        except UpstreamTimeout as exc:
            return _Try("gateway-error", error=exc)
        except UpstreamError as exc:
            return _Try("reset", error=exc)
        status = response.status
        if status in _GATEWAY_ERRORS:
            return _Try(
                "gateway-error" if "gateway-error" in route.retries.retry_on else "5xx", response=response
            )
        if status >= 500:
            return _Try("5xx", response=response)
        if status in _RETRIABLE_4XX:
            return _Try("retriable-4xx", response=response)
        if status in route.retries.retriable_status_codes:
            return _Try("retriable-status", response=response)
        return _Try("", response=response)

    async def _choose(
        self,
        model: ServedModel,
        subset: str,
        ctx: RoutingContext,
        tried: list[Endpoint],
        tokens: int,
        deadline: float | None,
        counted: bool = True,
    ) -> tuple[Endpoint, Pick]:
        """Pick an endpoint with room, preferring ones not tried yet; wait (bounded) for room."""
        until: float | None = None  # one queue deadline, however often this wakes and re-waits
        while True:
            pool = model.subset(subset)
            healthy = model.routable(subset, pool, time.monotonic())
            if not healthy:
                if counted:
                    self._metrics.observe_request(model.name, "", model.strategy.name, 503, 0.0)
                raise NoHealthyEndpoint(
                    f"model {model.name!r} has no healthy endpoint in subset {subset!r}",
                    headers={"Retry-After": "1"},
                )
            if until is None and model.queued_for(subset):
                candidates: list[Endpoint] = []  # requests already wait: a newcomer queues behind them
            else:
                fresh = [e for e in healthy if e not in tried and model.has_room(e)]
                candidates = fresh or [e for e in healthy if model.has_room(e)]
            if candidates:
                pick = model.strategy.pick(candidates, ctx, self._rng)
                endpoint = candidates[pick.index]
                model.acquire(endpoint, tokens)
                return endpoint, pick
            if until is None:
                until = time.monotonic() + model.config.circuit_breakers.queue_timeout
                if deadline is not None:
                    until = min(until, deadline)
            try:
                await model.wait_for_room(subset, until)
            except ModelyardError:
                self._metrics.overloaded.labels(model.name).inc()
                raise

    def _budget(self, model: ServedModel, route: RouteConfig) -> bool:
        if model.retry_allowed():
            return True
        self._metrics.retry_budget_exhausted.labels(model.name, route.name).inc()
        return False

    def _backoff(self, route: RouteConfig, retry: int) -> float:
        """Full jitter: uniform in [0, min(max_interval, base_interval x 2^(retry-1)))."""
        policy = route.retries
        return self._rng.uniform(0, min(policy.max_interval, policy.base_interval * 2 ** (retry - 1)))

    def _finish(
        self,
        model: ServedModel,
        endpoint: Endpoint,
        upstream: UpstreamResponse,
        tokens: int,
        code: int,
        started: float,
    ) -> None:
        """The end of an exchange that reached the client: the connection back to its pool (or
        closed), the endpoint's slot freed, the request counted once."""
        upstream.close()
        model.release(endpoint, tokens)
        self._observe(model, endpoint, code, started)

    def _observe(self, model: ServedModel, endpoint: Endpoint, code: int, started: float) -> None:
        seconds = time.perf_counter() - started
        self._metrics.observe_request(model.name, endpoint.name, model.strategy.name, code, seconds)

    # --- shadow traffic -----------------------------------------------------------------------------

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        """Cancel the shadow requests still running."""
        tasks = list(self._background)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _shadow(
        self,
        model: ServedModel,
        route: RouteConfig,
        ctx: RoutingContext,
        method: str,
        path: str,
        headers: list[tuple[str, str]],
        body: bytes | None,
        tokens: int,
        primary: asyncio.Future[_Capture],
    ) -> None:
        """Send a copy to the route's mirror subset, in the background: its answer never reaches
        the client; it is compared with the primary's (exact match, ROUGE-L) for the canary summary.
        No retries, so a failing canary cannot add load beyond the copy itself."""
        assert route.mirror is not None
        subset = route.mirror.subset
        shadow_route = route.model_copy(update={"retries": RetryPolicy(attempts=0)})
        mirrored = _Capture(subset)
        started = time.perf_counter()
        try:
            async with asyncio.timeout(route.timeout or None):
                shadow_headers = [*headers, ("X-Modelyard-Shadow", "true")]
                endpoint, _pick, upstream = await self._attempts(
                    model,
                    shadow_route,
                    subset,
                    ctx,
                    method,
                    path,
                    shadow_headers,
                    body,
                    tokens,
                    counted=False,
                )
                try:
                    mirrored.add(await upstream.read())
                    mirrored.finish(upstream.status, upstream.header("Content-Type"))
                finally:
                    upstream.close()
                    model.release(endpoint, tokens)
        except (ModelyardError, TimeoutError) as exc:
            log.debug("model %s: shadow request to %s failed: %s", model.name, subset, exc)
        mirrored.seconds = time.perf_counter() - started
        answer = await primary
        stats = model.canary_stats(route.name)
        for capture in (answer, mirrored):
            stats.record_outcome(capture.subset, capture.seconds, capture.ok)
            self._metrics.canary_requests.labels(
                model.name, route.name, capture.subset, "ok" if capture.ok else "error"
            ).inc()
            self._metrics.canary_duration.labels(model.name, route.name, capture.subset).observe(
                capture.seconds
            )
        if answer.ok and mirrored.ok:
            ours, theirs = answer.text(), mirrored.text()
            if ours is not None and theirs is not None:
                stats.record_comparison(rouge_l(ours, theirs), exact_match(ours, theirs))
                mean = stats.summary()["mean_rouge_l"]
                if mean is not None:
                    self._metrics.canary_agreement.labels(model.name, route.name).set(mean)

    # --- answers ----------------------------------------------------------------------------------

    async def _respond(
        self,
        request: web.Request,
        model: ServedModel,
        route: RouteConfig,
        endpoint: Endpoint,
        upstream: UpstreamResponse,
        headers: CIMultiDict[str],
        tokens: int,
        started: float,
        capture: _Capture | None = None,
    ) -> web.StreamResponse:
        code = CLIENT_CLOSED
        try:
            broken = 0
            if upstream.content_type == "text/event-stream":
                response, broken = await self._relay_stream(
                    request, model, route, upstream, headers, started, capture
                )
            else:
                data = await upstream.read()
                if capture is not None:
                    capture.add(data)
                response = web.Response(body=data, status=upstream.status, headers=headers)
            code = broken or upstream.status
            if capture is not None:
                capture.finish(code, upstream.header("Content-Type"))
            return response
        except UpstreamError as exc:
            code = exc.status
            raise
        finally:
            self._finish(model, endpoint, upstream, tokens, code, started)

    async def _relay_stream(
        self,
        request: web.Request,
        model: ServedModel,
        route: RouteConfig,
        upstream: UpstreamResponse,
        headers: CIMultiDict[str],
        started: float,
        capture: _Capture | None = None,
    ) -> tuple[web.StreamResponse, int]:
        """Relay a stream. Returns the response and 0, or the status the exchange really ended with
        (502: broke off upstream, 504: idle) when the client's connection had to be cut: the status
        line is already sent, and ending the stream cleanly would pass a truncated answer off as
        complete."""
        response = web.StreamResponse(status=upstream.status, headers=headers)
        await response.prepare(request)
        idle = route.stream_idle_timeout
        chunks = upstream.iter_chunks()
        first = True
        try:
            while True:
                try:
                    async with asyncio.timeout(idle or None):
                        chunk = await anext(chunks)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    # The server stopped producing tokens: fail the stream (the status is already
                    # sent, so cut the connection rather than end it as if complete).
                    self._metrics.stream_idle_timeouts.labels(model.name).inc()
                    log.warning("model %s: stream idle for %gs, closing it", model.name, idle)
                    _cut(request)
                    return response, 504
                if first:
                    self._metrics.ttft.labels(model.name).observe(time.perf_counter() - started)
                    first = False
                await response.write(chunk)
                if capture is not None:
                    capture.add(chunk)
        except UpstreamError as exc:
            log.warning("upstream stream for model %s broke off: %s", model.name, exc.message)
            _cut(request)
            return response, exc.status
        await response.write_eof()
        return response, 0


def _cut(request: web.Request) -> None:
    if request.transport is not None:
        request.transport.close()
