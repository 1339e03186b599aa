"""The attempt loop: choose an endpoint, try it, and retry as the route's policy allows.

Mechanism only; what is worth retrying and how long to wait is balancing/retry.py. A try that
fails in a way the route names (refused connection, reset, a retriable status, a per-try timeout,
its endpoint taken out before answering) is retried on another endpoint when one is available,
with jittered exponential backoff and within the cluster's retry budget. The route's timeout
covers every try, the waits and the answer's body. Every endpoint has an in-flight limit
(`max_requests`); when all are full a request waits in the cluster's bounded queue, or gets 429.

An OIP gRPC call (`Exchange.grpc`) goes to an endpoint with a `grpc_url` as a gRPC call, its message
relayed as it came, and to the others as its REST request; either way the try's outcome is an
answer with an HTTP status, so retries, outlier detection and metrics treat them alike.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import NamedTuple
from urllib.parse import urlsplit

from modelyard.balancing import Pick
from modelyard.balancing import retry as policy
from modelyard.balancing.routes import ALL_SUBSETS
from modelyard.cluster import Endpoint
from modelyard.errors import (
    EndpointTakenOut,
    ModelyardError,
    NoHealthyEndpoint,
    Overloaded,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from modelyard.gateway.exchange import Answer, Attempt, Exchange
from modelyard.gateway.ledger import CLIENT_CLOSED, Ledger, ended_with
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.protocols.http import RawHeaders
from modelyard.rpc import OipChannels
from modelyard.telemetry import Span, safe_text
from modelyard.upstream import Flight, UpstreamPool

log = logging.getLogger("modelyard.gateway")

GRPC_CONTENT_TYPE = "application/grpc"
# Request headers that describe the REST body, not the call: not sent as gRPC metadata.
_NOT_METADATA = frozenset({"content-type", "content-length"})


def grpc_metadata(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """The forwarded request headers as a gRPC backend's metadata (keys lower case)."""
    return [(k.lower(), v) for k, v in headers if k.lower() not in _NOT_METADATA]


WARN_EVERY = 10.0  # seconds between warnings about requests failed on one endpoint
_MAX_WARNED = 1024  # endpoints remembered for that; more (placed models coming and going) start afresh


class _Try(NamedTuple):
    """The outcome of one try: `reason` is a retry_on name, or "" for an answer that is final.
    (A tuple: an answer's is made with tuple.__new__, without a Python-level __init__.)"""

    reason: str
    error: UpstreamError | None = None
    response: Answer | None = None

    @property
    def code(self) -> int:
        if self.response is not None:
            return self.response.status
        return self.error.status if self.error is not None else 502


class GrpcAnswer:
    """A gRPC backend's whole answer: the answer message's bytes (status 200), or OIP's error JSON
    for its status (rpc.OipChannels)."""

    __slots__ = ("body", "headers", "raw_headers", "relayed", "status")

    def __init__(self, status: int, body: bytes) -> None:
        self.status = status
        self.body = body
        self.headers = [("Content-Type", GRPC_CONTENT_TYPE)]
        self.raw_headers = [(b"Content-Type", GRPC_CONTENT_TYPE.encode())]
        self.relayed = list(self.raw_headers)

    def header(self, name: str) -> str | None:
        return self.headers[0][1] if name.lower() == "content-type" else None

    @property
    def content_type(self) -> str:
        return self.headers[0][1]

    @property
    def complete(self) -> bool:
        return True

    def take(self) -> bytes:
        return self.body

    async def read(self) -> bytes:
        return self.body

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        yield self.body

    def close(self) -> None:
        pass


class AttemptLoop:
    def __init__(
        self,
        pool: UpstreamPool,
        grpc: OipChannels,
        metrics: GatewayMetrics,
        rng: random.Random,
        ledger: Ledger,
    ) -> None:
        self._pool = pool
        self._grpc = grpc
        self._metrics = metrics
        self._rng = rng
        self._ledger = ledger  # where a try or the exchange is counted and its endpoint freed
        self._warned: dict[tuple[str, str], tuple[float, int]] = {}  # (model, endpoint): (when, not logged)

    async def run(self, ex: Exchange) -> Attempt:
        """Try, and retry as the route allows. Returns with the endpoint held and the answer's
        head received (also `ex.held`, `ex.answer`), for the caller to relay and close the
        exchange (the ledger's `close`); a request that fails for good is closed here, then raised."""
        cluster, route = ex.cluster, ex.route
        retries_policy = route.retries
        # The route's timeout covers every try, the waits and the answer's body: each try gets what
        # is left as its client deadline (the upstream connection's one timer, no extra task or context).
        timeout = route.timeout
        deadline = time.monotonic() + timeout if timeout else None
        tried: list[Endpoint] = []
        retries = 0
        charged = False  # holds a place in the retry budget from the decision to the try's end
        try:
            while True:
                # (an endpoint with room, without a coroutine; else wait for one)
                chosen = self._pick_now(ex, tried, None, queued_first=True)
                endpoint, pick = (
                    chosen if chosen is not None else await self._wait_for_room(ex, tried, deadline, None)
                )
                started = time.perf_counter()
                ex.held = (endpoint, pick, started)
                ex.tries += 1
                span = None
                headers = ex.headers
                if ex.span is not None:  # a span per try; the server gets its context
                    relayed = ex.grpc.method if ex.grpc is not None and endpoint.grpc_url else None
                    span = try_span(ex.span, ex, endpoint, retries, relayed)
                    headers = span.inject(headers)
                flight = Flight()
                cluster.awaiting_answer(endpoint, flight)
                try:
                    outcome = await self._try(ex, endpoint, deadline, flight, headers)
                except BaseException as exc:  # cancelled (the client left), the route's time is up, a bug
                    code = ended_with(exc)
                    if span is not None:
                        span.answered(code, exc if isinstance(exc, ModelyardError) else None)
                        span.end()
                    self._ledger.close(ex, code)
                    raise
                finally:
                    cluster.answered(endpoint, flight)
                if span is not None:
                    span.answered(outcome.code, outcome.error)
                    span.end()
                if charged:
                    cluster.budget.retry_ended()
                    charged = False
                # 5xx answers and failures to answer count against the endpoint; the time to the
                # response head is its latency (a stream's length says nothing about the server).
                # A try aborted because its endpoint was taken out says nothing new about it.
                if not isinstance(outcome.error, EndpointTakenOut):
                    failed = outcome.error is not None or outcome.code >= 500
                    latency = None if failed else time.perf_counter() - started
                    cluster.record_outcome(endpoint, not failed, latency, time.monotonic())
                if not outcome.reason:
                    answer = ex.answer = outcome.response
                    assert answer is not None
                    return tuple.__new__(Attempt, (endpoint, pick, answer))
                # A failed try: free the endpoint and decide whether to go again. It is counted here
                # when it ends here (retried or raised); an answer relayed as it is counts once, later.
                tried.append(endpoint)
                out_of_time = deadline is not None and time.monotonic() >= deadline
                status = outcome.response.status if outcome.response is not None else None
                if (
                    not out_of_time
                    and retries < retries_policy.attempts
                    and policy.retriable(retries_policy, outcome.reason, status)
                ):
                    charge = policy.charged_to_budget(outcome.error)
                    if not charge or self._budget_allows(ex):
                        retries += 1
                        self._metrics.retries.labels(cluster.name, route.name, outcome.reason).inc()
                        if outcome.response is not None:
                            outcome.response.close()
                        self._ledger.try_ended(ex, outcome.code)
                        if charge:
                            cluster.budget.retry_started()
                            charged = True
                        pause = policy.backoff(retries_policy, retries, self._rng)
                        if deadline is not None:
                            pause = max(0.0, min(pause, deadline - time.monotonic()))
                        try:
                            await asyncio.sleep(pause)
                        except asyncio.CancelledError:  # the client left between tries
                            self._give_up(ex, CLIENT_CLOSED)
                            raise
                        continue
                if outcome.response is not None and not out_of_time:
                    ex.answer = outcome.response  # not retried: relay it as it is
                    return Attempt(endpoint, pick, outcome.response)
                if outcome.response is not None:
                    outcome.response.close()
                self._ledger.close(ex, 504 if out_of_time else outcome.code)
                failure = _out_of_time(ex) if out_of_time else outcome.error
                assert failure is not None
                if outcome.reason == "connect-failure" and len(tried) > 1 and not out_of_time:
                    names = ", ".join(e.name for e in tried)
                    failure = UpstreamError(  # the last one's reason: a TLS failure says which
                        f"every endpoint of model {cluster.name!r} tried refused the connection: {names} "
                        f"(last: {failure.message})"
                    )
                if ex.counted:  # a shadow copy's failure is the canary's business, not the log's
                    self._warn_failed(ex, endpoint, failure)
                raise failure
        finally:
            if charged:
                cluster.budget.retry_ended()

    async def _try(
        self,
        ex: Exchange,
        endpoint: Endpoint,
        deadline: float | None,
        flight: Flight,
        headers: RawHeaders | list[tuple[str, str]],
    ) -> _Try:
        route = ex.route
        remaining = None
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _out_of_time(ex)
        if ex.grpc is not None and endpoint.grpc_url:
            sending = self._send_grpc(ex, endpoint, remaining, flight, headers)
        else:
            if ex.rest_body is not None:
                ex.body, ex.rest_body = ex.rest_body(), None
            sending = self._pool.send(endpoint.url, ex.method, ex.path, headers, ex.body, remaining, flight)
        try:
            if route.per_try_timeout:
                async with asyncio.timeout(route.per_try_timeout):
                    response = await sending
            else:
                response = await sending
        except TimeoutError:
            error = UpstreamTimeout(
                f"{endpoint.name} did not answer within per_try_timeout {route.per_try_timeout:g}s"
            )
            return _Try("gateway-error", error=error)
        except UpstreamError as exc:
            if isinstance(exc, UpstreamUnreachable):
                # Refused: nothing listens there. (A connection closed without an answer is not
                # taken as proof: one request may have crashed a worker, or met an idle close.)
                ex.cluster.record_connection_failure(endpoint, exc.message)
            return _Try(policy.reason_for_error(exc), error=exc)
        reason = policy.reason_for_status(response.status, route.retries)
        return tuple.__new__(_Try, (reason, None, response))

    async def _send_grpc(
        self,
        ex: Exchange,
        endpoint: Endpoint,
        remaining: float | None,
        flight: Flight,
        headers: RawHeaders | list[tuple[str, str]],
    ) -> Answer:
        assert ex.grpc is not None
        limit = self._pool.time_limit(remaining)
        pending = self._grpc.start(
            endpoint.grpc_url, ex.grpc.method, ex.grpc.message, grpc_metadata(headers), limit
        )
        flight.on_abort(pending.abort)  # its endpoint taken out: given up, and retried elsewhere
        status, body = await pending.answer()
        return GrpcAnswer(status, body)

    async def hold(self, ex: Exchange, only: Callable[[Endpoint], bool]) -> tuple[Endpoint, Pick]:
        """An endpoint for a whole stream (a relayed gRPC ModelStreamInfer), among those `only`
        admits, chosen and waited for as a try is; it holds a slot (`ex.held`, timed from the
        exchange's start) until the exchange is closed. No retries: once the stream has begun, its
        answers may already be on their way."""
        return await self._choose(ex, [], None, only)  # (`ex.held` timed from the exchange's start)

    async def _choose(
        self,
        ex: Exchange,
        tried: list[Endpoint],
        deadline: float | None,
        only: Callable[[Endpoint], bool] | None = None,
    ) -> tuple[Endpoint, Pick]:
        """Pick an endpoint with room, preferring ones not tried yet; wait (bounded) for room."""
        chosen = self._pick_now(ex, tried, only, queued_first=True)
        return chosen if chosen is not None else await self._wait_for_room(ex, tried, deadline, only)

    def _pick_now(
        self,
        ex: Exchange,
        tried: list[Endpoint],
        only: Callable[[Endpoint], bool] | None,
        *,
        queued_first: bool,
    ) -> tuple[Endpoint, Pick] | None:
        """An endpoint with room now, preferring ones not tried yet, acquired; None when every
        one is full (or, `queued_first`, when requests already wait: a newcomer queues behind
        them). Raises when none is healthy, or for a stream (`only`) when all are full."""
        cluster = ex.cluster
        capacity = cluster.capacity
        if cluster.vanished_subset(ex.subset):
            ex.subset = ALL_SUBSETS
        healthy = cluster.routable(ex.subset, time.monotonic())
        if only is not None:
            healthy = [e for e in healthy if only(e)]
        if not healthy:
            self._ledger.close(ex, 503)
            raise NoHealthyEndpoint(
                f"model {cluster.name!r} has no healthy endpoint in subset {ex.subset!r}",
                headers={"Retry-After": "1"},
            )
        if only is None and queued_first and capacity.queued_for(ex.subset, ex.priority):
            candidates: Sequence[Endpoint] = ()
        elif not tried and not capacity.config.max_requests:  # (the usual first try: no limit to check)
            candidates = healthy
        else:
            fresh = [e for e in healthy if e not in tried and capacity.has_room(e)]
            candidates = fresh or [e for e in healthy if capacity.has_room(e)]
        if candidates:
            balancer = cluster.balancer
            pick = balancer.pick(candidates, ex.ctx, self._rng)
            endpoint = candidates[pick.index]
            cluster.acquire(endpoint, ex.tokens)
            ex.held = (endpoint, pick, ex.started)  # (held from here: whatever raises, close frees it)
            ex.service_sample = (
                balancer.on_sent(endpoint.name, id(ex), ex.ctx, time.monotonic()) if balancer.tracks else None
            )
            return endpoint, pick
        if only is not None:  # a stream does not wait in the queue: the requests there want any
            self._metrics.overloaded.labels(cluster.name).inc()
            self._ledger.close(ex, Overloaded.status)
            raise Overloaded(f"model {cluster.name!r} is at capacity: every endpoint it could go to is full")
        return None

    async def _wait_for_room(
        self,
        ex: Exchange,
        tried: list[Endpoint],
        deadline: float | None,
        only: Callable[[Endpoint], bool] | None,
    ) -> tuple[Endpoint, Pick]:
        """Wait in the cluster's queue until an endpoint has room: one queue deadline, however
        often this wakes and waits again."""
        cluster = ex.cluster
        capacity = cluster.capacity
        until = time.monotonic() + capacity.config.queue_timeout
        if deadline is not None:
            until = min(until, deadline)
        while True:
            try:
                await capacity.wait(ex.subset, until, ex.tenant, ex.priority)
            except ModelyardError as exc:
                if ex.counted:
                    self._metrics.overloaded.labels(cluster.name).inc()
                self._ledger.close(ex, exc.status)
                raise
            except asyncio.CancelledError:  # the client left while its request waited for room
                self._give_up(ex, CLIENT_CLOSED)
                raise
            chosen = self._pick_now(ex, tried, only, queued_first=False)
            if chosen is not None:
                return chosen

    def _budget_allows(self, ex: Exchange) -> bool:
        if ex.cluster.budget.allows_retry():
            return True
        self._metrics.retry_budget_exhausted.labels(ex.cluster.name, ex.route.name).inc()
        return False

    def _give_up(self, ex: Exchange, code: int) -> None:
        """A request that ended between tries or before its first (cancelled while it waited for
        room or for its backoff): closed, holding no endpoint."""
        self._ledger.close(ex, code)

    def _warn_failed(self, ex: Exchange, endpoint: Endpoint, failure: ModelyardError) -> None:
        """A request that failed for good: a warning, at most one per endpoint every WARN_EVERY
        seconds (an outage must not flood stderr from the loop); the next one says how many were
        not logged. Every failed request is in the access log with its request id."""
        key = (ex.cluster.name, endpoint.name)
        now = time.monotonic()
        last, quiet = self._warned.get(key, (-WARN_EVERY, 0))
        if now - last < WARN_EVERY:
            self._warned[key] = (last, quiet + 1)
            return
        if len(self._warned) >= _MAX_WARNED:
            self._warned.clear()
        self._warned[key] = (now, 0)
        more = f" ({quiet} more failed on it since the last warning, not logged)" if quiet else ""
        log.warning(
            "model %s: request %s failed after %d tr%s (last %s): %s%s",
            ex.cluster.name, safe_text(ex.request_id) or "-", ex.tries, "y" if ex.tries == 1 else "ies",
            endpoint.name, failure.message, more, extra={"request_id": safe_text(ex.request_id)},
        )  # fmt: skip


def try_span(parent: Span, ex: Exchange, endpoint: Endpoint, retry: int, grpc_method: str | None) -> Span:
    """A try's client span under the request's; `grpc_method`: the try goes as that gRPC call."""
    attributes: dict[str, str | int] = {"modelyard.backend": endpoint.name, "modelyard.retry": retry}
    if grpc_method is not None:  # relayed as gRPC: OTel's rpc attributes, not a URL
        attributes.update(_grpc_attributes(endpoint.grpc_url, grpc_method))
    else:
        attributes["http.request.method"] = ex.method
        attributes["url.full"] = endpoint.url + ex.path.partition("?")[0]  # a query may hold secrets
    return parent.child(f"{ex.method} {endpoint.name}", "client", attributes)


def _grpc_attributes(grpc_url: str, method: str) -> dict[str, str | int]:
    """A gRPC call's span attributes (OTel's rpc conventions): `method` is the call's path,
    /inference.GRPCInferenceService/ModelInfer; `grpc_url` is grpc://host:port."""
    service, _, name = method.strip("/").rpartition("/")
    parts = urlsplit(grpc_url)
    return {
        "rpc.system": "grpc",
        "rpc.service": service,
        "rpc.method": name,
        "server.address": parts.hostname or "",
        "server.port": parts.port or 0,
    }


def _out_of_time(ex: Exchange) -> UpstreamTimeout:
    route = ex.route
    return UpstreamTimeout(
        f"model {ex.cluster.name!r}: route {route.name!r} did not finish within {route.timeout:g}s"
    )
