"""Fallback models: a request its model cannot serve goes on to the next of the model's `fallbacks`.

A model's `fallback_on` names what sends a request on (all of them by default):

    saturated       429: every endpoint at max_requests and the queue full or out of time
                    (Overloaded), or the server itself answered 429
    no_endpoint     503: no healthy endpoint (NoHealthyEndpoint), a placed model with no replica
    server_error    a 5xx answer after the route's retries, or no answer at all (refused, reset)
    timeout         504: the route's timeout or per_try_timeout ran out (UpstreamTimeout)
    context_length  the server answered 400 saying the prompt is too long (OpenAI's
                    `context_length_exceeded`, vLLM's "maximum context length"), or the request's
                    estimate (prompt words + its max_tokens) is over the model's `context_window`:
                    then it goes straight to a fallback whose window takes it

How it works, and why:
- Each model tried is an exchange of its own, on its own cluster (its routes, strategy, retries,
  queue, counters), opened once and closed once by the ledger as any other: the asked model's
  failure is counted for it (metrics, routing log, access log, with its status), the answer for
  the model that gave it. A fallback's records carry `fallback_for` (the model asked for) and the
  same request id; `modelyard_fallbacks_total{model,fallback,reason}` counts each step on. So
  the proxy drives it (`Proxy._with_fallbacks`), above the attempt loop, whose unit is one
  exchange on one cluster; one exchange moving between clusters would be counted, budgeted and
  released against the wrong model. A request whose model has no fallbacks takes none of this.
- Only the asked model's list is tried, in order, never a fallback's own (as LiteLLM does): no
  chains, so no loops. The last candidate's outcome, whatever it is, is the client's.
- A fallback is sent the request naming it: an OpenAI body's "model" is rewritten (only then: a
  request that does not fall back is forwarded as the bytes it came as), an OIP v2 or KServe v1
  path names it instead (`/v2/models/{fallback}/infer`; a version in the path is the asked model's
  and is dropped).
- Before the first byte only: the decision is made on the answer's head (and a 400's small body),
  before anything is relayed. A stream whose 200 went out is the asked model's to finish: if it
  breaks off, it ends with an error event as any stream does.
- The answer carries `X-Modelyard-Fallback: <model that answered>`.
- `Fallbacks.candidates` is the one place a fallback is chosen: it skips a model the caller's key
  may not use (auth.enabled), one not served here now (a placed model gone), one whose
  `context_window` the request is over, and one whose routes match no such request. Quotas are
  per tenant and key, not per model: one client request is one request whichever model answers
  it, so a fallback takes nothing more from them.
- Inference calls over HTTP only (OpenAI, OIP v2 and KServe v1 REST). Not metadata or readiness
  (a model is not ready because its fallback is), OIP gRPC calls or graph steps (`Proxy.call`:
  a graph names the model each step calls, and says what to do when it fails).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from modelyard.config import RouteConfig
from modelyard.errors import (
    ModelNotPlaced,
    ModelyardError,
    NoHealthyEndpoint,
    NotFound,
    Overloaded,
    UpstreamError,
    UpstreamTimeout,
)
from modelyard.gateway.cluster import Cluster
from modelyard.gateway.exchange import Answer
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.protocols import oip, openai
from modelyard.security.api_keys import Caller
from modelyard.types import RoutingRequest

FALLBACK_HEADER = "X-Modelyard-Fallback"
SATURATED = "saturated"
NO_ENDPOINT = "no_endpoint"
SERVER_ERROR = "server_error"
TIMEOUT = "timeout"
CONTEXT_LENGTH = "context_length"


class FellBack(Exception):
    """Raised by the proxy when a model answered in a way its `fallback_on` names (its exchange
    closed already, with that answer's status): the request goes on to the next candidate. Never
    reaches a client."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Candidate(NamedTuple):
    """One of the asked model's fallbacks: its cluster and the route the request takes there, or
    why it is skipped."""

    name: str
    cluster: Cluster | None
    route: RouteConfig | None = None
    skipped: str = ""  # not_allowed, not_served, context_window, no_route


def reason_for_error(exc: ModelyardError) -> str | None:
    """The fallback_on condition a failure of the attempt loop stands for; None: none does (a bad
    request, a key that may not, a route that matches nothing: no other model would do better)."""
    if isinstance(exc, Overloaded):
        return SATURATED
    if isinstance(exc, NoHealthyEndpoint | ModelNotPlaced):
        return NO_ENDPOINT
    if isinstance(exc, UpstreamTimeout):
        return TIMEOUT
    if isinstance(exc, UpstreamError):
        return SERVER_ERROR
    return None


def over_window(cluster: Cluster, routing: RoutingRequest) -> bool:
    """Whether the request's estimate (the prompt's words and the max_tokens it asks for, when it
    does) is over the model's `context_window`. An estimate (words, not tokens: fewer), so a
    request it lets through may still be refused by the server, which is the other way to tell."""
    window = cluster.config.context_window
    if window is None:
        return False
    fields = routing.fields or {}
    asked = fields.get("max_completion_tokens") or fields.get("max_tokens")
    wanted = asked if isinstance(asked, int) and not isinstance(asked, bool) else 0
    return routing.prompt_tokens + wanted > window


class Fallbacks:
    def __init__(self, clusters: Mapping[str, Cluster], metrics: GatewayMetrics) -> None:
        self._clusters = clusters  # the gateway's, changed in place by the placement feed
        self._metrics = metrics

    def candidates(
        self, cluster: Cluster, headers: Mapping[str, str], routing: RoutingRequest, caller: Caller | None
    ) -> list[Candidate]:
        """The asked model's fallbacks, in order, each with its cluster and route or why it is
        skipped: the one place a fallback model is chosen (what the caller's key may use, what is
        served here, whose window takes the request, whose routes match it)."""
        chosen = []
        for name in cluster.config.fallbacks:
            target = self._clusters.get(name)
            if caller is not None and not caller.may_use(name):
                chosen.append(Candidate(name, None, None, "not_allowed"))
            elif target is None:
                chosen.append(Candidate(name, None, None, "not_served"))
            elif over_window(target, routing):
                chosen.append(Candidate(name, None, None, "context_window"))
            else:
                try:
                    route = target.route_for(headers, routing.fields)
                except NotFound:  # its routes match no such request
                    chosen.append(Candidate(name, None, None, "no_route"))
                else:
                    chosen.append(Candidate(name, target, route))
        return chosen

    def fell_back(self, asked: str, fallback: str, reason: str) -> None:
        self._metrics.fallbacks.labels(asked, fallback, reason).inc()

    def skipped(self, asked: str, candidate: Candidate) -> None:
        self._metrics.fallbacks_skipped.labels(asked, candidate.name, candidate.skipped).inc()

    @staticmethod
    async def answer_reason(answer: Answer, conditions: Sequence[str]) -> str | None:
        """The fallback_on condition an answer stands for (the attempt loop returns a 5xx it did
        not retry, or retried in vain, as an answer); None: relay it. A 400 is read (an error's
        body is small) to see whether it says the prompt is too long; read, it can still be relayed."""
        status = answer.status
        if status >= 500:
            return SERVER_ERROR if SERVER_ERROR in conditions else None
        if status == 429:
            return SATURATED if SATURATED in conditions else None
        if (
            status == 400
            and CONTEXT_LENGTH in conditions
            and answer.content_type != "text/event-stream"  # (a body to read whole, never a stream)
            and openai.context_length_exceeded(status, await answer.read())
        ):
            return CONTEXT_LENGTH
        return None

    @staticmethod
    def request_for(
        target: Cluster, path: str, body: bytes | None, routing: RoutingRequest
    ) -> tuple[str, bytes | None, RoutingRequest]:
        """The request as `target` is sent it: the model named in the path (OIP v2, KServe v1) or
        else in the OpenAI body's "model"."""
        name = target.name
        moved = oip.path_for_model(path, name)
        if moved is not None:
            return moved, body, routing._replace(model=name)
        fields = routing.fields
        if fields is None or body is None:  # (no body to name it in: sent as it is)
            return path, body, routing._replace(model=name)
        renamed = {**fields, "model": name}
        return path, openai.body_for_model(fields, name), routing._replace(model=name, fields=renamed)
