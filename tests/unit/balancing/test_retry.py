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
    ("error", "charged"),
    [
        (UpstreamUnreachable("refused"), False),  # nothing was sent
        (UpstreamClosed("closed without answering"), False),  # the server said nothing (it died)
        (EndpointTakenOut("hung, taken out"), False),
        (UpstreamTimeout("slow"), True),  # the server is there, and loaded: retries add to it
        (UpstreamError("malformed answer"), True),
        (None, True),  # an answer (a 503, a 500): the storms the budget stops
    ],
)
def test_only_tries_the_server_never_answered_are_free(error: UpstreamError | None, charged: bool) -> None:
    assert retry.charged_to_budget(error) is charged


def test_backoff_is_full_jitter_under_an_exponential_cap() -> None:
    policy = RetryPolicy(base_interval=0.1, max_interval=0.3)
    rng = random.Random(0)
    for attempt, cap in ((1, 0.1), (2, 0.2), (3, 0.3), (6, 0.3)):
        pauses = [retry.backoff(policy, attempt, rng) for _ in range(200)]
        assert all(0 <= p < cap for p in pauses)
        assert max(pauses) > cap * 0.8  # spread over the whole range, not a fixed delay
