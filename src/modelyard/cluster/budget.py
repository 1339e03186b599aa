"""Envoy's retry budget: how many retries a cluster may have in flight, from its active requests."""

from __future__ import annotations

from dataclasses import dataclass

from modelyard.config import RetryBudgetConfig


@dataclass(slots=True)
class RetryBudget:
    """Counts a cluster's requests and the retries among them that are in flight.

    Retries in flight stay under `budget_percent` of active requests (at least
    `min_retry_concurrency`), so retries cannot multiply an outage into a storm. A retry holds its
    place from the decision to retry until its try ends, backoff included.
    """

    config: RetryBudgetConfig
    active: int = 0
    retrying: int = 0

    def allows_retry(self) -> bool:
        limit = max(self.config.min_retry_concurrency, self.config.budget_percent / 100.0 * self.active)
        return self.retrying < limit

    def request_started(self) -> None:
        self.active += 1

    def request_ended(self) -> None:
        self.active -= 1

    def retry_started(self) -> None:
        self.retrying += 1

    def retry_ended(self) -> None:
        self.retrying -= 1
