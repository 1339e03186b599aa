"""Forward one request to one of a model's endpoints and relay the answer.

listener (app.py) -> route (the cluster's first matching route, a subset by weight) -> strategy
(with the affinity remembered for the prompt when the strategy needs it) -> attempt loop
(attempts.py) -> relay (relay.py); a share of a route's requests is mirrored (shadow.py).

The body arrives parsed once (for routing) and leaves as the original bytes. A client that goes
away cancels the upstream request (the server cancels the handler; a failed write closes the
upstream response).
"""

from __future__ import annotations

import itertools
import os
import random
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import NamedTuple

from multidict import CIMultiDict

from modelyard.balancing import Need, RoutingContext, affinity_key
from modelyard.balancing.routes import pick_subset
from modelyard.config import RouteConfig
from modelyard.errors import ModelyardError, UpstreamUnreachable
from modelyard.gateway.access_log import AccessLog
from modelyard.gateway.admission import CREDENTIAL_FIELDS
from modelyard.gateway.attempts import GRPC_CONTENT_TYPE, AttemptLoop, grpc_metadata, try_span
from modelyard.gateway.cluster import Cluster
from modelyard.gateway.exchange import Attempt, Exchange
from modelyard.gateway.fallback import (
    CONTEXT_LENGTH,
    FALLBACK_HEADER,
    Fallbacks,
    FellBack,
    over_window,
    reason_for_error,
)
from modelyard.gateway.ledger import CLIENT_CLOSED, Ledger, ended_with
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.gateway.quotas import Permit
from modelyard.gateway.relay import Relay
from modelyard.gateway.shadow import ShadowTraffic
from modelyard.protocols.http import HEADER_TEXT, RawHeaders, encode_fields, field_value
from modelyard.protocols.tokens import tokens_in_bytes
from modelyard.rpc import OipCall, OipChannels
from modelyard.serving.h1 import H1Request
from modelyard.serving.reply import Inbound, Reply
from modelyard.state import SharedState
from modelyard.telemetry import Kind, Span, Tracer
from modelyard.types import RoutingRequest
from modelyard.upstream import UpstreamPool, forwarded_headers, not_relayed

BACKEND_HEADER = "X-Modelyard-Backend"
STRATEGY_HEADER = "X-Modelyard-Strategy"
CACHE_HIT_HEADER = "X-Modelyard-Cache-Hit"
ROUTE_HEADER = "X-Modelyard-Route"
SUBSET_HEADER = "X-Modelyard-Subset"
REQUEST_ID_HEADER = "X-Request-Id"
# What a server's answer loses on its way: hop-by-hop fields, and those the proxy sets itself (a
# server's own are dropped, not doubled): the upstream pool's answers leave them out of `relayed`.
# X-Modelyard-Cache-Hit is set for the strategies that remember affinities only.
NOT_RELAYED = not_relayed(
    (BACKEND_HEADER, STRATEGY_HEADER, ROUTE_HEADER, SUBSET_HEADER, REQUEST_ID_HEADER, FALLBACK_HEADER)
)
_CACHE_HIT = CACHE_HIT_HEADER.lower().encode()
_FALLBACK = FALLBACK_HEADER.encode()
_MAX_ANSWER_FIELDS = 4096

PrefixRecorded = Callable[[str, str, Sequence[int]], None]  # (model, endpoint, chunk names)


class Asked(NamedTuple):
    """What every model a request tries shares (one, or each of its fallbacks): the client's
    request and reply, the caller's permit (auth.enabled), when it came, its id (as it came, and as
    text), the headers forwarded."""

    request: Inbound
    reply: Reply
    permit: Permit | None
    started: float
    raw_id: bytes
    request_id: str
    sent: RawHeaders


class Called(NamedTuple):
    """What `Proxy.call` got: the answer's status and body; `grpc`: a gRPC backend answered (the
    call relayed as gRPC): the body is its answer message, or for an error status OIP's error JSON
    with the gRPC status's name (rpc.OipChannels)."""

    status: int
    body: bytes
    grpc: bool = False


class Proxy:
    def __init__(
        self,
        pool: UpstreamPool,
        grpc: OipChannels,
        state: SharedState,
        metrics: GatewayMetrics,
        rng: random.Random,
        *,
        clusters: Mapping[str, Cluster] | None = None,
        share_prefix: PrefixRecorded | None = None,
        share_canary: Callable[[list[object]], None] | None = None,
        tracer: Tracer | None = None,
        access: AccessLog | None = None,
        drop_credentials: bool = False,
    ) -> None:
        if not NOT_RELAYED.issubset(pool.relay_drop):  # answers' `relayed` leave out what is set here
            raise ValueError("the proxy's upstream pool must drop at least proxy.NOT_RELAYED")
        self._state = state
        # auth.enabled: a client's API key is the gateway's business, never a server's
        self._drop_credentials = drop_credentials
        # What prefix_aware records goes to the other gateways too (prefix_sharing.py).
        self._share_prefix = share_prefix or _not_shared
        self._metrics = metrics
        self._rng = rng
        self._grpc = grpc
        self._ledger = Ledger(metrics, tracer, access)
        self._attempts = AttemptLoop(pool, grpc, metrics, rng, self._ledger)
        self._relay = Relay(self._ledger, metrics)
        self._shadows = ShadowTraffic(self._attempts, self._ledger, metrics, rng, share_canary)
        # The models a fallback may name (`clusters`: the gateway's; none: no fallbacks are served)
        self._fallbacks = Fallbacks(clusters if clusters is not None else {}, metrics)
        # Request ids: a random per-gateway prefix and a counter; unique without a syscall per request.
        self._id_prefix = os.urandom(8).hex()
        self._id_counter = itertools.count(1)
        self._answer_fields_made: dict[
            tuple[str, str, str, str, bool | None], tuple[tuple[bytes, bytes], ...]
        ] = {}

    async def forward(
        self,
        request: Inbound,
        reply: Reply,
        cluster: Cluster,
        routing: RoutingRequest,
        body: bytes | None,
        permit: Permit | None = None,
        *,
        fallbacks: bool = True,
    ) -> None:
        """Route the request to `cluster` and relay its answer; when the model has `fallbacks` (and
        `fallbacks`: an inference call, not a metadata or readiness one), on to them as its
        `fallback_on` says (gateway/fallback.py). `permit`: auth.enabled, the caller's admission
        (quotas.py), which each exchange tells how it ended."""
        started = time.perf_counter()
        route = cluster.route_for(request.headers, routing.fields)  # (404 before the request has an id)
        if type(request) is H1Request:  # (the lean connection sorted the fields as it parsed them)
            raw_id = request.request_id
            forwarded = request.forwarded
        else:
            raw_id = field_value(request.raw_headers, b"x-request-id")
            forwarded = None
        if raw_id:
            request_id = raw_id.decode(*HEADER_TEXT)
        else:
            request_id = self.new_request_id()
            raw_id = request_id.encode()
        reply.request_id = request_id
        if forwarded is not None:
            forwarded.append((b"X-Request-Id", raw_id))
            sent = RawHeaders(forwarded)
        else:
            sent = forwarded_headers(request.raw_headers, raw_id)
        if self._drop_credentials:
            sent = RawHeaders([field for field in sent.fields if field[0].lower() not in CREDENTIAL_FIELDS])
        # (tuple.__new__: a NamedTuple's own __new__ is a Python function)
        asked = tuple.__new__(Asked, (request, reply, permit, started, raw_id, request_id, sent))
        if fallbacks and cluster.config.fallbacks:
            await self._with_fallbacks(asked, cluster, route, routing, body)
            return
        await self._send(asked, cluster, route, routing, body, request.raw_path, None, "")

    async def _send(
        self,
        asked: Asked,
        cluster: Cluster,
        route: RouteConfig,
        routing: RoutingRequest,
        body: bytes | None,
        path: str,
        watch: Sequence[str] | None,
        fallback_for: str,
        trail: list[Span] | None = None,
    ) -> None:
        """One model's exchange, opened and closed here: routed, tried, relayed. `watch`: the
        fallback_on conditions of a model with a fallback after this one, which an answer that
        stands for one of them goes to instead (FellBack, this exchange closed with its status).
        `trail`, on the way through a model's fallbacks: the asked model's span once it has one,
        the parent of the fallbacks' spans (one trace holds every model tried)."""
        request, reply, permit, started, raw_id, request_id, sent = asked
        subset = pick_subset(route, request.headers, self._rng)
        key = remembered = chunks = held = waits = line = roomy = tokens = None
        needs = cluster.balancer.strategy.needs  # (empty for most strategies: nothing to look up then)
        if needs:
            if Need.AFFINITY in needs:
                key = affinity_key(cluster.name, routing.prompt, cluster.config.kv_aware.prefix_chars)
                remembered = await self._state.get(key)
            now = time.monotonic()  # after the lookup: what the prefix waits and the strategy see
            if Need.PREFIX in needs and routing.prompt:
                chunks, held, waits, line, roomy, tokens = cluster.balancer.look(
                    routing.prompt, cluster.endpoint_names, now, routing.fields
                )
        else:
            now = time.monotonic()
        ex = Exchange(
            cluster,
            route,
            subset,
            # (tuple.__new__: a NamedTuple's own __new__ is a Python function)
            tuple.__new__(
                RoutingContext,
                (routing, cluster.next_seq(), remembered, now, held, waits, line, roomy, tokens),
            ),
            request.method,
            path,
            sent,
            body,
            routing.prompt_tokens + routing.max_tokens,
            started,
            request_id,
        )
        if permit is not None:
            ex.permit, ex.tenant, ex.priority = permit, permit.caller.tenant, permit.caller.priority
        if fallback_for:
            ex.fallback_for = fallback_for
        ledger = self._ledger
        if not trail:
            ledger.open(ex, request.headers.items() if ledger.tracing else None)
            if trail is not None and ex.span is not None:
                trail.append(ex.span)
        else:
            ledger.open(ex, trail[0].inject(request.headers.items()), "internal")
        try:
            ex.capture = self._shadows.start(ex)
            attempt = await self._attempts.run(ex)
            if watch is not None and attempt.response.status >= 400:
                reason = await self._fallbacks.answer_reason(attempt.response, watch)
                if reason is not None:  # counted for this model, with the status it answered
                    ledger.close(ex, attempt.response.status)
                    raise FellBack(reason)
            if key is not None:
                await self._remember(ex, attempt, key)
            if chunks is not None and 200 <= attempt.response.status < 300:
                cluster.balancer.on_cached(attempt.endpoint.name, chunks)  # it now caches this prompt
                self._share_prefix(cluster.name, attempt.endpoint.name, chunks)
            cache_hit = attempt.pick.cache_hit
            # The server's headers, less those set here (which replace any it sent).
            fields = attempt.response.relayed
            if cache_hit is not None:
                fields = [field for field in fields if field[0].lower() != _CACHE_HIT]
            headers = RawHeaders(fields)
            # (the subset may have changed under it: vanished_subset; the config refuses names no
            # header may hold, so encoding them cannot fail here, after a slot was taken)
            headers.fields.extend(
                self._answer_fields(attempt.endpoint.name, cluster, route.name, ex.subset, cache_hit)
            )
            if fallback_for:
                headers.fields.append((_FALLBACK, cluster.name.encode(*HEADER_TEXT)))
            headers.fields.append((b"X-Request-Id", raw_id))
            if permit is not None:
                headers.fields.extend(permit.fields)
            await self._relay.respond(reply, ex, attempt, headers)  # (closes the exchange)
        except BaseException as exc:  # (a failed request is closed already: this does nothing)
            ledger.close(ex, ended_with(exc))
            raise

    async def _with_fallbacks(
        self,
        asked: Asked,
        cluster: Cluster,
        route: RouteConfig,
        routing: RoutingRequest,
        body: bytes | None,
    ) -> None:
        """The asked model, then its fallbacks in order, each its own exchange, for as long as one
        fails as the asked model's `fallback_on` says and another is left to try; the last one
        tried is the client's answer (or error). Nothing once the answer has begun."""
        request, reply, permit = asked.request, asked.reply, asked.permit
        asked_for = cluster.name
        conditions = cluster.config.fallback_on
        candidates = self._fallbacks.candidates(
            cluster, request.headers, routing, permit.caller if permit is not None else None
        )
        usable = [i for i, candidate in enumerate(candidates) if candidate.cluster is not None]
        if not usable:  # (none the caller may use, none served here now: the asked model alone)
            try:
                await self._send(asked, cluster, route, routing, body, request.raw_path, None, "")
            except ModelyardError as exc:
                if not reply.started and reason_for_error(exc) in conditions:  # (it would have)
                    for candidate in candidates:
                        self._fallbacks.skipped(asked_for, candidate)
                raise
            return
        trail: list[Span] = []  # (the first model tried's span: the others' parent)
        reason: str | None
        if CONTEXT_LENGTH in conditions and over_window(cluster, routing):
            reason = CONTEXT_LENGTH  # too long for the asked model's window: straight to a fallback
        else:
            reason = await self._try_model(
                asked, cluster, route, routing, body, request.raw_path, conditions, "", trail
            )
            if reason is None:
                return
        last = usable[-1]
        for i, candidate in enumerate(candidates):
            target = candidate.cluster
            if target is None or candidate.route is None:
                self._fallbacks.skipped(asked_for, candidate)
                continue
            self._fallbacks.fell_back(asked_for, target.name, reason)
            path, moved, renamed = self._fallbacks.request_for(target, request.raw_path, body, routing)
            reason = await self._try_model(
                asked, target, candidate.route, renamed, moved, path,
                conditions if i != last else None, asked_for, trail,
            )  # fmt: skip
            if reason is None:
                return

    async def _try_model(
        self,
        asked: Asked,
        cluster: Cluster,
        route: RouteConfig,
        routing: RoutingRequest,
        body: bytes | None,
        path: str,
        conditions: Sequence[str] | None,
        fallback_for: str,
        trail: list[Span],
    ) -> str | None:
        """One model's exchange (`_send`): None when it was the answer (relayed, or failed for
        good), else the fallback_on condition its failure stands for, to go on to the next.
        `conditions` None: the last candidate, whose outcome is the client's whatever it is."""
        try:
            await self._send(asked, cluster, route, routing, body, path, conditions, fallback_for, trail)
        except FellBack as fell:
            return fell.reason
        except ModelyardError as exc:  # (its exchange is closed, counted for this model)
            reason = reason_for_error(exc)
            if conditions is None or asked.reply.started or reason not in conditions:
                raise
            return reason
        return None

    async def call(
        self,
        cluster: Cluster,
        method: str,
        path: str,
        headers: list[tuple[str, str]],
        body: bytes | None,
        *,
        grpc: OipCall | None = None,
        rest_body: Callable[[], bytes] | None = None,
        span_kind: Kind = "server",
        permit: Permit | None = None,
    ) -> Called:
        """A routed call made by the gateway itself (a graph step naming a model, an OIP gRPC call):
        the model's routes, strategy, health and retries apply, as for a client request (not its
        fallbacks: gateway/fallback.py). `grpc`
        goes as it is to an endpoint with a grpc_url (`rest_body`, when given, makes the REST
        body for the others). Traced, its span is a child of the traceparent in `headers` (a gRPC
        client's: `span_kind` server; a graph step's: internal)."""
        tokens = tokens_in_bytes(len(body) if body is not None else len(grpc.message) if grpc else 0)
        ex = self._own_exchange(cluster, method, path, headers, body, tokens, permit)
        ex.grpc, ex.rest_body = grpc, rest_body
        self._ledger.open(ex, headers, span_kind)
        code = CLIENT_CLOSED
        try:
            attempt = await self._attempts.run(ex)
            data = await attempt.response.read()
            ex.sent_bytes = len(data)
            code = attempt.response.status
            return Called(code, data, attempt.response.content_type == GRPC_CONTENT_TYPE)
        except BaseException as exc:
            code = ended_with(exc)  # (the answer's body broke off; a failed request is closed already)
            raise
        finally:
            self._ledger.close(ex, code)

    async def stream(
        self,
        cluster: Cluster,
        path: str,
        headers: list[tuple[str, str]],
        method: str,
        messages: AsyncIterator[bytes],
        permit: Permit | None = None,
    ) -> AsyncIterator[bytes]:
        """A gRPC stream (ModelStreamInfer) relayed whole to one endpoint with a grpc_url, chosen
        as a request's would be (routes, strategy, health, room), held until the stream ends and
        counted then, once, with how it ended. `path` is the REST path the log and routes see."""
        ex = self._own_exchange(cluster, "POST", path, headers, None, 0, permit)
        span = None
        self._ledger.open(ex, headers)
        code = CLIENT_CLOSED
        try:
            endpoint, _ = await self._attempts.hold(ex, lambda e: bool(e.grpc_url))
            ex.tries = 1
            try:
                sent = headers
                if ex.span is not None:  # the one try, the whole stream: its own client span
                    span = try_span(ex.span, ex, endpoint, 0, method)
                    sent = span.inject(headers)
                metadata = grpc_metadata(sent)
                async for message in self._grpc.stream(endpoint.grpc_url, method, messages, metadata):
                    ex.sent_bytes += len(message)
                    yield message
                code = 200
            except BaseException as exc:
                code = ended_with(exc)
                if isinstance(exc, UpstreamUnreachable):  # nothing listens there: out until a probe passes
                    cluster.record_connection_failure(endpoint, exc.message)
                raise
            finally:
                if span is not None:
                    span.answered(code)
                    span.end()
                if code != CLIENT_CLOSED:  # 5xx and failures count against it, as a request's do
                    cluster.record_outcome(endpoint, code < 500, None, time.monotonic())
        finally:
            self._ledger.close(ex, code)

    def _own_exchange(
        self,
        cluster: Cluster,
        method: str,
        path: str,
        headers: list[tuple[str, str]],
        body: bytes | None,
        tokens: int,
        permit: Permit | None,
    ) -> Exchange:
        """The exchange of a call the gateway makes itself (`call`, `stream`): the model's route
        for its headers, no prompt to route on; the routing log's request id is the caller's."""
        lookup = CIMultiDict(headers)
        route = cluster.route_for(lookup, None)
        ex = Exchange(
            cluster,
            route,
            pick_subset(route, lookup, self._rng),
            RoutingContext(
                RoutingRequest(model=cluster.name, prompt_tokens=tokens),
                cluster.next_seq(),
                now=time.monotonic(),
            ),
            method,
            path,
            headers,
            body,
            tokens,
            time.perf_counter(),
            lookup.get(REQUEST_ID_HEADER, ""),  # a gRPC call's, or a graph's caller's
        )
        if permit is not None:  # (a gRPC client's call: its handler ends the permit)
            ex.permit, ex.tenant, ex.priority = permit, permit.caller.tenant, permit.caller.priority
        return ex

    async def close(self) -> None:
        await self._shadows.close()

    async def _remember(self, ex: Exchange, attempt: Attempt, key: str) -> None:
        """Count the affinity lookup, and remember a new prefix's endpoint."""
        self._metrics.kv_affinity.labels("hit" if attempt.pick.cache_hit else "miss").inc()
        if attempt.pick.cache_hit:
            return
        await self._state.set(key, attempt.endpoint.name, ex.cluster.config.kv_aware.ttl)

    def _answer_fields(
        self, backend: str, cluster: Cluster, route: str, subset: str, cache_hit: bool | None
    ) -> tuple[tuple[bytes, bytes], ...]:
        """The X-Modelyard-* fields of an answer, encoded once per combination (a few per model)."""
        key = (backend, cluster.balancer.strategy.name, route, subset, cache_hit)
        fields = self._answer_fields_made.get(key)
        if fields is None:
            if len(self._answer_fields_made) >= _MAX_ANSWER_FIELDS:  # endpoints come and go: start afresh
                self._answer_fields_made.clear()
            pairs = [
                (BACKEND_HEADER, backend),
                (STRATEGY_HEADER, cluster.balancer.strategy.name),
                (ROUTE_HEADER, route),
                (SUBSET_HEADER, subset),
            ]
            if cache_hit is not None:
                pairs.append((CACHE_HIT_HEADER, "true" if cache_hit else "false"))
            fields = self._answer_fields_made[key] = encode_fields(pairs)
        return fields

    def new_request_id(self) -> str:
        """A fresh request id, for a request that came without one (HTTP here, gRPC in oip_grpc)."""
        return f"{self._id_prefix}{next(self._id_counter):016x}"


def _not_shared(model: str, endpoint: str, chunks: Sequence[int]) -> None:
    pass
