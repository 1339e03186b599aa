"""One exchange in flight: what was asked, where it is going, when it started.

Built once per request by the proxy and handed along (attempt loop, relay, shadow copy) instead of
long parameter lists; opened and closed once by the ledger (ledger.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import NamedTuple, Protocol

from modelyard.balancing import Pick, RoutingContext
from modelyard.balancing.balancer import Sample
from modelyard.cluster import Endpoint
from modelyard.config import RouteConfig
from modelyard.gateway.capture import Capture
from modelyard.gateway.cluster import Cluster
from modelyard.gateway.quotas import Permit
from modelyard.protocols.http import RawHeaders
from modelyard.rpc import OipCall
from modelyard.telemetry import Span


class Answer(Protocol):
    """An upstream answer, its head received: upstream.UpstreamResponse over HTTP, or a whole
    gRPC answer (attempts.GrpcAnswer). `read()` or `close()` ends its use."""

    status: int
    raw_headers: list[tuple[bytes, bytes]]  # as they came
    relayed: list[tuple[bytes, bytes]]  # those a client is given (less the proxy's own, hop-by-hop)

    @property
    def headers(self) -> list[tuple[str, str]]: ...  # decoded

    def header(self, name: str) -> str | None: ...
    @property
    def content_type(self) -> str: ...
    @property
    def complete(self) -> bool: ...  # the whole body is here: `take()` has it
    def take(self) -> bytes: ...  # (then `close()`)
    async def read(self) -> bytes: ...
    def iter_chunks(self) -> AsyncIterator[bytes]: ...
    def close(self) -> None: ...


@dataclass(slots=True, eq=False)
class Exchange:
    cluster: Cluster
    route: RouteConfig
    subset: str
    ctx: RoutingContext  # the routing view of the request (its prompt, tokens, affinity)
    method: str
    path: str  # as the client sent it, forwarded unchanged
    headers: RawHeaders | list[tuple[str, str]]  # as forwarded upstream
    body: bytes | None  # None: no body, or `rest_body` makes it when a try needs it
    tokens: int  # the request's estimated cost, counted on the endpoint while it runs
    started: float  # perf_counter
    request_id: str = ""
    # auth.enabled: who is calling (the key's tenant, its priority under overload); "" and 0 when off
    tenant: str = ""
    priority: int = 0
    # auth.enabled: the request's admission against its limits, settled when it closes with the
    # tokens the answer's usage reported (`usage`).
    permit: Permit | None = None
    usage: int = 0
    # A fallback model's exchange: the model the request asked for (gateway/fallback.py)
    fallback_for: str = ""
    # False for shadow copies: client metrics describe what clients got, and the retry budget counts
    # clients' requests only
    counted: bool = True
    # prefix_aware: the last try's sample, for learning the service time (Balancer.on_served)
    service_sample: Sample | None = None
    # An OIP gRPC call: relayed as it is to an endpoint with a grpc_url; to the others as the REST
    # request above, its body made by `rest_body` (once) when the first such try needs it.
    grpc: OipCall | None = None
    rest_body: Callable[[], bytes] | None = None
    tries: int = 0  # endpoints tried so far (the access log's and the span's attempts)
    sent_bytes: int = 0  # body bytes relayed to the client (or read, for the gateway's own calls)
    span: Span | None = None  # tracing on: the request's span, the parent of each try's span
    # What the ledger (ledger.py) closes: the endpoint whose slot the exchange holds now, with its
    # pick and when its try started; the answer being relayed from it; the shadow comparison's
    # capture of the primary answer, told when the exchange ended.
    held: tuple[Endpoint, Pick, float] | None = None
    answer: Answer | None = None
    capture: Capture | None = None
    closed: bool = False

    def shadow(self, route: RouteConfig, subset: str) -> Exchange:
        """A copy of this exchange for the mirror subset (marked, so servers can tell). It has no
        span: its tries are not the request's (the shadow traffic gives it a span of its own)."""
        return replace(
            self,
            route=route,
            subset=subset,
            headers=[*self.headers, ("X-Modelyard-Shadow", "true")],
            counted=False,
            span=None,
            held=None,
            answer=None,
            capture=None,
            closed=False,
        )


class Attempt(NamedTuple):
    """The try that answered: the endpoint holds a slot until the exchange is closed. (A tuple:
    made with tuple.__new__, without a Python-level __init__.)"""

    endpoint: Endpoint
    pick: Pick
    response: Answer
