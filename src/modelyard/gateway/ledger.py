"""The exchange ledger: where a request is opened and where it is closed, once.

Opening counts the request in its model's retry budget and starts its span. Closing frees the
endpoint it holds (and the answer's connection), counts it once with the status it really ended
with (metrics, the routing log, the access log and the span's outcome, from one record so they
never disagree), teaches prefix_aware's service model from an answer relayed whole, tells the
shadow comparison the primary's time, ends the budget's count and the span. Whoever ends an
exchange (the relay, the attempt loop when it gives up, a gateway-made call, a held stream)
closes it here; the proxy closes it again on any exception, which does nothing once it is closed,
so a request cancelled or failed anywhere in between is still counted and freed.

A try that fails and is retried is not the end: `try_ended` counts it and frees its endpoint.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

from modelyard.cluster import Endpoint
from modelyard.errors import ModelyardError
from modelyard.gateway.access_log import AccessLog
from modelyard.gateway.exchange import Exchange
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.gateway.routing_log import Entry, RoutingRecord
from modelyard.telemetry import Kind, Span, Tracer

CLIENT_CLOSED = 499  # nginx's code for "client closed the request": metrics, routing and access log


def ended_with(exc: BaseException) -> int:
    """The status an exchange ends with when `exc` ends it: a modelyard error's own, 499 for a
    client that went away, 500 for a bug (the error middleware answers it so)."""
    if isinstance(exc, ModelyardError):
        return exc.status
    if isinstance(exc, (asyncio.CancelledError, ConnectionError, GeneratorExit)):
        return CLIENT_CLOSED  # (GeneratorExit: a relayed stream's reader stopped reading)
    return 500


class Ledger:
    def __init__(
        self,
        metrics: GatewayMetrics,
        tracer: Tracer | None,
        access: AccessLog | None,
    ) -> None:
        self._metrics = metrics
        self._log = metrics.routing_log
        self._tracer = tracer  # None: tracing off, and no span is made
        self._access = access  # None: logging.access_log is off

    @property
    def tracing(self) -> bool:
        return self._tracer is not None

    def open(self, ex: Exchange, headers: Iterable[tuple[str, str]] | None, kind: Kind = "server") -> None:
        """The request is in: counted in its model's retry budget and, `tracing`, traced (a child
        of the traceparent in `headers` when it has one; the caller need not make them when not)."""
        if self._tracer is not None:  # (before the count: a tracer that raises leaves none)
            ex.span = _request_span(self._tracer, ex, headers or (), kind)
        ex.cluster.budget.request_started()

    def try_ended(self, ex: Exchange, code: int) -> None:
        """The try holding `ex.held` failed and is retried: counted (not as the request's end),
        its answer's connection closed and its endpoint freed."""
        held = ex.held
        assert held is not None
        endpoint, pick, started = held
        ex.held = None
        if ex.answer is not None:
            ex.answer.close()
            ex.answer = None
        ex.cluster.release(endpoint, ex.tokens, id(ex))
        if ex.counted:
            self._observe(ex, endpoint, code, started, pick.cache_hit, final=False)

    def close(self, ex: Exchange, code: int) -> None:
        """The end of the exchange, with the status it ended with (CLIENT_CLOSED: the client
        left). Does nothing the second time."""
        if ex.closed:
            return
        ex.closed = True
        cluster = ex.cluster
        held = ex.held
        # (what must happen whatever counting raises is in the `finally`: a second close does
        # nothing, so nothing else would end the budget's count, the capture or the span)
        try:
            if held is None:
                if ex.counted:
                    self._unrouted(ex, code)
            else:
                endpoint, pick, started = held
                answer = ex.answer
                try:
                    if answer is not None:
                        answer.close()
                        started = ex.started  # an answer is timed whole; a try that failed, by itself
                finally:
                    cluster.release(endpoint, ex.tokens, id(ex))
                if ex.counted:
                    self._observe(ex, endpoint, code, started, pick.cache_hit, final=True)
                    # Only an answer relayed whole times the server: a stream that went idle or broke
                    # off after its 200 would teach the service model its timeout.
                    sample = ex.service_sample
                    if sample is not None and code == 200 and answer is not None:
                        cluster.balancer.on_served(sample, time.monotonic())
        finally:
            if ex.counted:  # (a shadow copy is not in the budget)
                cluster.budget.request_ended()
            permit = ex.permit
            if permit is not None and ex.counted:  # (the request's handler ends the permit: Quotas.end)
                price = held[0].cost_per_1k_tokens if held is not None else 0.0
                # (no endpoint and 429: the gateway refused it for room, Overloaded: shed)
                permit.ended(ex.usage, ex.usage * price / 1000, code, held is None and code == 429)
            if ex.capture is not None:
                ex.capture.ended(time.perf_counter() - ex.started)
            if ex.span is not None:  # after the relay: a stream's span ends with the stream
                ex.span.end()

    def _observe(
        self,
        ex: Exchange,
        endpoint: Endpoint,
        code: int,
        started: float,
        cache_hit: bool | None,
        *,
        final: bool,
    ) -> None:
        """Count a try that ended, or the answer: metrics and the routing log; `final`: the
        exchange ends with it (its access log line and its span's outcome)."""
        now = time.perf_counter()
        seconds = now - started
        cluster = ex.cluster
        strategy = cluster.balancer.strategy.name
        self._metrics.observe_request(cluster.name, endpoint.name, strategy, code, seconds)
        record = self._log.record(
            cluster.name, ex.route.name, ex.subset, endpoint.name, strategy, code, seconds, cache_hit,
            ex.request_id, ex.tenant, ex.fallback_for,
        )  # fmt: skip
        if final and (ex.span is not None or self._access is not None):
            self._ended(ex, record, now - ex.started)

    def _unrouted(self, ex: Exchange, code: int) -> None:
        """A request that ended holding no endpoint (none healthy, no room in time, the client
        left while it waited or between tries): logged without one, and counted in the request
        metrics without one unless a try of it already was."""
        cluster = ex.cluster
        seconds = time.perf_counter() - ex.started
        if ex.tries == 0:
            self._metrics.observe_request(cluster.name, "", cluster.balancer.strategy.name, code, seconds)
        record = self._log.record(
            cluster.name, ex.route.name, ex.subset, "", cluster.balancer.strategy.name, code, seconds, None,
            ex.request_id, ex.tenant, ex.fallback_for,
        )  # fmt: skip
        if ex.span is not None or self._access is not None:
            self._ended(ex, record, seconds)

    def _ended(self, ex: Exchange, entry: Entry, seconds: float) -> None:
        """The request's outcome, as the routing log recorded it, for its span and the access log:
        one record, so the three never disagree. `seconds`: the whole request's (the record's
        latency is its last try's, which is the dashboard's)."""
        record = RoutingRecord(*entry)
        span = ex.span
        if span is not None:
            span.set("modelyard.route", record.route)
            span.set("modelyard.subset", record.subset)
            span.set("modelyard.backend", record.backend)
            span.set("modelyard.attempts", ex.tries)
            if record.fallback_for:
                span.set("modelyard.fallback_for", record.fallback_for)
            span.answered(record.status)
        if self._access is not None:
            trace_id = span.trace_id if span is not None else None
            self._access.write(record, ex.method, ex.path, ex.tries, ex.sent_bytes, trace_id, seconds * 1000)


def _request_span(tracer: Tracer, ex: Exchange, headers: Iterable[tuple[str, str]], kind: Kind) -> Span:
    """The span of one routed request, a child of the caller's traceparent when it sent one; what
    only its end knows (backend, attempts, status) is set when it closes (`_ended`)."""
    cluster = ex.cluster
    return tracer.start(
        f"{ex.method} {cluster.name}",
        headers,
        kind,
        {
            "http.request.method": ex.method,
            "url.path": ex.path.partition("?")[0],
            "modelyard.model": cluster.name,
            "modelyard.route": ex.route.name,
            "modelyard.subset": ex.subset,
            "modelyard.strategy": cluster.balancer.strategy.name,
            "modelyard.request_id": ex.request_id,
        },
        started=ex.started,  # the whole request's time: the affinity lookup before it too
    )
