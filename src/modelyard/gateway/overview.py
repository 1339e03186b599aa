"""`GET /admin/overview`: each model's strategy and endpoints as the dashboard shows them, read from
the clusters' public state between two awaits (a consistent snapshot on one event loop)."""

from __future__ import annotations

from typing import Any

from modelyard.cluster import Endpoint
from modelyard.cluster.outlier import OutlierState
from modelyard.config import STRATEGY_NAMES
from modelyard.gateway.cluster import Cluster
from modelyard.gateway.gateway import Gateway

_NEVER_EJECTED = OutlierState()


def overview(gateway: Gateway, now: float) -> dict[str, Any]:
    """`now` is monotonic time (ejections end at a monotonic instant). Never names the token."""
    admin = gateway.config.admin
    return {
        "models": [_model(cluster, now) for cluster in gateway.clusters.values()],
        "strategies": list(STRATEGY_NAMES),
        "admin_token_required": admin.token is not None,
        "graph_views_protected": admin.token is not None and admin.protect_graph_views,
    }


def _model(cluster: Cluster, now: float) -> dict[str, Any]:
    breakers = cluster.config.circuit_breakers
    return {
        "name": cluster.name,
        "strategy": cluster.strategy.name,
        "ready": cluster.ready,
        "routes": [route.name for route in cluster.config.routes],
        "panic_subsets": sorted(cluster.panicking),
        "queued": len(cluster.capacity),
        "max_pending_requests": breakers.max_pending_requests,
        "active_requests": cluster.budget.active,
        "retries_in_flight": cluster.budget.retrying,
        "endpoints": [_endpoint(cluster, e, now) for e in cluster.endpoints],
    }


def _endpoint(cluster: Cluster, endpoint: Endpoint, now: float) -> dict[str, Any]:
    health = endpoint.health
    outlier = cluster.outliers.get(endpoint.name, _NEVER_EJECTED)
    until = outlier.ejected_until
    limit = cluster.config.circuit_breakers.max_requests
    full = limit > 0 and endpoint.in_flight >= limit
    return {
        "name": endpoint.name,
        "url": endpoint.url,
        "subset": endpoint.subset,
        "weight": endpoint.weight,
        "health": {
            "status": "healthy" if health.healthy else "unhealthy",
            "checked": health.checked,
            "last_error": health.last_error,
        },
        "in_flight": endpoint.in_flight,
        "outstanding_tokens": endpoint.outstanding_tokens,
        "ejection": {
            "ejected": until is not None,
            "seconds_left": None if until is None else round(max(0.0, until - now), 3),
            "ejections": outlier.ejections,
            "consecutive_failures": outlier.consecutive_failures,
        },
        # Envoy's circuit breaker: open while the endpoint has max_requests in flight (0: no limit).
        "circuit": {"state": "open" if full else "closed", "max_requests": limit},
        "routable": health.healthy and until is None,
    }
