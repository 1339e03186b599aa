"""A served model: its endpoints, its current strategy and the counters strategies read."""

from __future__ import annotations

import logging
from collections.abc import Callable

from modelyard.balancing import Strategy, get_strategy
from modelyard.cluster import BackendLoad, Endpoint, HealthThresholds, observe
from modelyard.cluster.health import ejected
from modelyard.config import ModelConfig

log = logging.getLogger("modelyard.gateway")


class ServedModel:
    def __init__(
        self,
        config: ModelConfig,
        loads: dict[str, BackendLoad],
        on_health_change: Callable[[str, str, bool], None] = lambda model, endpoint, healthy: None,
    ) -> None:
        self.config = config
        self._on_health_change = on_health_change
        self.name = config.name
        self.strategy: Strategy = get_strategy(config.strategy)
        self.seq = 0  # requests routed so far; kept across strategy switches
        self.endpoints = [
            Endpoint(
                name=e.name,
                url=e.url,
                load=loads.setdefault(e.url, BackendLoad(e.url, e.name)),
                weight=e.weight,
                cost_per_1k_tokens=e.cost_per_1k_tokens,
            )
            for e in config.endpoints
        ]
        check = config.health_check
        self.health_checked = check.interval > 0
        self.thresholds = HealthThresholds(check.unhealthy_threshold, check.healthy_threshold)

    def healthy_endpoints(self) -> list[Endpoint]:
        return [e for e in self.endpoints if e.health.healthy]

    @property
    def ready(self) -> bool:
        return any(e.health.healthy for e in self.endpoints)

    def next_seq(self) -> int:
        seq = self.seq
        self.seq += 1
        return seq

    def record_probe(self, endpoint: Endpoint, error: str) -> None:
        """Apply one probe result ("" when it passed)."""
        before = endpoint.health.healthy
        endpoint.health = observe(endpoint.health, not error, self.thresholds, error)
        self._transition(endpoint, before)

    def record_unreachable(self, endpoint: Endpoint, error: str) -> None:
        """A refused connection takes the endpoint out until a probe brings it back. Without
        active checks nothing would bring it back, so then it only fails this one request."""
        if not self.health_checked:
            return
        before = endpoint.health.healthy
        endpoint.health = ejected(error)
        self._transition(endpoint, before)

    def _transition(self, endpoint: Endpoint, before: bool) -> None:
        after = endpoint.health.healthy
        if after == before:
            return
        self._on_health_change(self.name, endpoint.name, after)
        if after:
            log.info("model %s: endpoint %s is healthy again", self.name, endpoint.name)
        else:
            log.warning(
                "model %s: endpoint %s is unhealthy: %s", self.name, endpoint.name, endpoint.health.last_error
            )
