"""Routing policies: pure functions of an endpoint snapshot, a request and an RNG."""

from modelyard.balancing.strategies import (
    STRATEGIES,
    Pick,
    RoutingContext,
    Strategy,
    affinity_key,
    get_strategy,
)

__all__ = ["STRATEGIES", "Pick", "RoutingContext", "Strategy", "affinity_key", "get_strategy"]
