"""Envoy's retry budget: retries in flight within a share of active requests, with a floor."""

from __future__ import annotations

import pytest

from modelyard.cluster.budget import RetryBudget
from modelyard.config import RetryBudgetConfig


def budget(percent: float, floor: int, active: int = 0, retrying: int = 0) -> RetryBudget:
    return RetryBudget(
        RetryBudgetConfig(budget_percent=percent, min_retry_concurrency=floor), active, retrying
    )


@pytest.mark.parametrize(
    ("percent", "floor", "active", "retrying", "allowed"),
    [
        (20, 3, 0, 2, True),  # the floor allows 3 whatever the traffic
        (20, 3, 0, 3, False),
        (20, 3, 100, 19, True),  # 20% of 100 active
        (20, 3, 100, 20, False),
        (0, 0, 100, 0, False),  # no budget at all
        (100, 0, 4, 3, True),
    ],
)
def test_allows_retry(percent: float, floor: int, active: int, retrying: int, allowed: bool) -> None:
    assert budget(percent, floor, active, retrying).allows_retry() is allowed


def test_counts_move_through_its_methods() -> None:
    b = budget(50, 0)
    b.request_started()
    b.request_started()
    assert b.allows_retry()  # 0 < 50% of 2
    b.retry_started()
    assert not b.allows_retry()  # 1 is 50% of 2
    b.retry_ended()
    b.request_ended()
    assert (b.active, b.retrying) == (1, 0)
