"""Policy, pure: routing strategies, the per-model Balancer (a strategy and what it learns), route
matching and the retry policy."""

from modelyard.balancing.strategies import (
    Need,
    Pick,
    RoutingContext,
    Strategy,
    affinity_key,
    build_strategy,
    check_strategy_name,
)

__all__ = [
    "Need",
    "Pick",
    "RoutingContext",
    "Strategy",
    "affinity_key",
    "build_strategy",
    "check_strategy_name",
]
