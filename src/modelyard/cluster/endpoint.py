"""Endpoints as routing policies see them.

A policy reads an `EndpointView`. The gateway passes its live `Endpoint` objects: on one event
loop, reading them between two awaits is a consistent snapshot, and it saves building a copy per
request on the hot path. Tests pass frozen fakes with the same attributes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from modelyard.cluster.health import HealthState
from modelyard.cluster.resources import ResourceSnapshot
from modelyard.errors import UpstreamError


class Abortable(Protocol):
    """A try sent to an endpoint and waiting for its answer (upstream's Flight), which the cluster
    aborts when it takes the endpoint out."""

    def abort(self, error: UpstreamError) -> None: ...


class EndpointView(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def weight(self) -> int: ...
    @property
    def cost_per_1k_tokens(self) -> float: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def outstanding_tokens(self) -> int: ...
    @property
    def resources(self) -> ResourceSnapshot | None: ...


class Load(Protocol):
    """A server's load as the request path counts it: `BackendLoad` in one process; the workers of
    one gateway share theirs (gateway/siblings.py), so that each sees what all have in flight."""

    @property
    def url(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def outstanding_tokens(self) -> int: ...
    def acquire(self, tokens: int) -> None: ...
    def release(self, tokens: int) -> None: ...


@dataclass(slots=True)
class BackendLoad:
    """What this gateway has in flight to one server (one URL), summed over every model it serves."""

    url: str
    name: str
    in_flight: int = 0
    outstanding_tokens: int = 0

    def acquire(self, tokens: int) -> None:
        self.in_flight += 1
        self.outstanding_tokens += tokens

    def release(self, tokens: int) -> None:
        self.in_flight -= 1
        self.outstanding_tokens -= tokens


@dataclass(slots=True, eq=False)
class Endpoint:
    """One endpoint of one model: its configured weight and price, its health, and its server's load."""

    name: str
    url: str
    load: Load
    weight: int = 1
    cost_per_1k_tokens: float = 0.0
    subset: str = "default"
    metrics_url: str = ""  # resource_aware: where its load is scraped ("" = <url>/metrics)
    gpu_metrics_url: str = ""  # resource_aware: a DCGM exporter beside it
    grpc_url: str = ""  # its OIP gRPC port (grpc://host:port): OIP gRPC calls are relayed there as gRPC
    health: HealthState = field(default_factory=HealthState)
    resources: ResourceSnapshot | None = None  # the latest scrape (resource_aware)
    # This model's requests on it, in this process: `in_flight` is its server's, over every model
    # there (what a strategy weighs); this is what the model itself has sent (what an admin reads).
    model_in_flight: int = 0

    @property
    def healthy(self) -> bool:
        return self.health.healthy

    @property
    def in_flight(self) -> int:
        return self.load.in_flight

    @property
    def outstanding_tokens(self) -> int:
        return self.load.outstanding_tokens
