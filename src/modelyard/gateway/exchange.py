"""One exchange in flight: what was asked, where it is going, when it started.

Built once per request by the proxy and handed along (attempt loop, relay, shadow copy) instead of
long parameter lists.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from modelyard.balancing import Pick, RoutingContext
from modelyard.cluster import Endpoint
from modelyard.config import RouteConfig
from modelyard.gateway.cluster import Cluster
from modelyard.upstream import UpstreamResponse


@dataclass(slots=True, eq=False)
class Exchange:
    cluster: Cluster
    route: RouteConfig
    subset: str
    ctx: RoutingContext  # the routing view of the request (its prompt, tokens, affinity)
    method: str
    path: str  # as the client sent it, forwarded unchanged
    headers: list[tuple[str, str]]  # as forwarded upstream
    body: bytes | None
    tokens: int  # the request's estimated cost, counted on the endpoint while it runs
    started: float  # perf_counter
    request_id: str = ""
    counted: bool = True  # False for shadow copies: client metrics describe what clients got
    # prefix_aware: (uncached prompt characters, when sent, whether the endpoint was idle) of the
    # last try, for learning the service time
    service_sample: tuple[int, float, bool] | None = None

    def shadow(self, route: RouteConfig, subset: str) -> Exchange:
        """A copy of this exchange for the mirror subset (marked, so servers can tell)."""
        return replace(
            self,
            route=route,
            subset=subset,
            headers=[*self.headers, ("X-Modelyard-Shadow", "true")],
            counted=False,
        )


@dataclass(slots=True)
class Attempt:
    """The try that answered: the endpoint holds a slot until the exchange ends."""

    endpoint: Endpoint
    pick: Pick
    response: UpstreamResponse
