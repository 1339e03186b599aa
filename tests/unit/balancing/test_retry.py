"""Retry policy: reasons from answers and failures, what a route retries, what the budget pays."""

from __future__ import annotations

import random

import pytest

from modelyard.balancing import retry
from modelyard.config import RetryPolicy
from modelyard.errors import (
    EndpointTakenOut,
    UpstreamClosed,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnreachable,
)

DEFAULT = RetryPolicy()


@pytest.mark.parametrize(
    ("status", "policy", "reason"),
    [
        (200, DEFAULT, ""),
        (404, DEFAULT, ""),
        (503, DEFAULT, "gateway-error"),
        (503, RetryPolicy(retry_on=["5xx"]), "5xx"),
        (500, DEFAULT, "5xx"),
        (429, DEFAULT, "retriable-4xx"),
        (409, DEFAULT, "retriable-4xx"),
        (418, RetryPolicy(retriable_status_codes=[418]), "retriable-status"),
    ],
)
def test_reason_for_status(status: int, policy: RetryPolicy, reason: str) -> None:
    assert retry.reason_for_status(status, policy) == reason


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (UpstreamUnreachable("refused"), "connect-failure"),
        (UpstreamTimeout("slow"), "gateway-error"),
        (UpstreamClosed("closed"), "reset"),
        (EndpointTakenOut("taken out"), "reset"),
        (UpstreamError("malformed"), "reset"),
    ],
)
def test_reason_for_error(error: UpstreamError, reason: str) -> None:
    assert retry.reason_for_error(error) == reason


def test_retriable_follows_retry_on_and_the_listed_codes() -> None:
    assert retry.retriable(DEFAULT, "reset", None)
    assert not retry.retriable(DEFAULT, "5xx", 500)  # not in the default retry_on
    assert retry.retriable(RetryPolicy(retriable_status_codes=[500]), "5xx", 500)


@pytest.mark.parametrize(
    ("reason", "taken_out", "charged"),
    [
        ("connect-failure", True, False),
        ("reset", True, False),
        ("connect-failure", False, True),  # the endpoint still serves: a storm could be building
        ("gateway-error", True, True),  # it answered (503): retries add load somewhere
        ("5xx", True, True),
    ],
)
def test_only_connection_failures_of_an_endpoint_already_out_are_free(
    reason: str, taken_out: bool, charged: bool
) -> None:
    assert retry.charged_to_budget(reason, taken_out) is charged


def test_backoff_is_full_jitter_under_an_exponential_cap() -> None:
    policy = RetryPolicy(base_interval=0.1, max_interval=0.3)
    rng = random.Random(0)
    for attempt, cap in ((1, 0.1), (2, 0.2), (3, 0.3), (6, 0.3)):
        pauses = [retry.backoff(policy, attempt, rng) for _ in range(200)]
        assert all(0 <= p < cap for p in pauses)
        assert max(pauses) > cap * 0.8  # spread over the whole range, not a fixed delay
