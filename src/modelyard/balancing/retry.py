"""Retry policy, pure: which outcome of a try is worth another, and how long to wait before it.

The attempt loop (gateway/attempts.py) is the mechanism; it asks these functions. Reasons are
Envoy's `retry_on` names: `connect-failure` (nothing was sent), `reset` (the server closed or was
taken out before any answer byte), `gateway-error` (502/503/504, or a try that timed out), `5xx`,
`retriable-4xx` (409, 429) and `retriable-status` (a code the route lists).
"""

from __future__ import annotations

import random

from modelyard.config import RetryPolicy
from modelyard.errors import (
    EndpointTakenOut,
    UpstreamClosed,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnreachable,
)

_GATEWAY_ERRORS = frozenset({502, 503, 504})
_RETRIABLE_4XX = frozenset({409, 429})


def reason_for_status(status: int, policy: RetryPolicy) -> str:
    """The retry reason an answer's status gives, or "" for an answer that is final."""
    if status in _GATEWAY_ERRORS:
        return "gateway-error" if "gateway-error" in policy.retry_on else "5xx"
    if status >= 500:
        return "5xx"
    if status in _RETRIABLE_4XX:
        return "retriable-4xx"
    if status in policy.retriable_status_codes:
        return "retriable-status"
    return ""


def reason_for_error(error: UpstreamError) -> str:
    """The retry reason of a try that got no answer."""
    if isinstance(error, UpstreamUnreachable):
        return "connect-failure"
    if isinstance(error, UpstreamTimeout):
        return "gateway-error"
    return "reset"


def retriable(policy: RetryPolicy, reason: str, status: int | None) -> bool:
    return reason in policy.retry_on or (status is not None and status in policy.retriable_status_codes)


def charged_to_budget(error: UpstreamError | None) -> bool:
    """Whether retrying a failed try spends the retry budget. The budget stops retries multiplying
    the load on servers that answer with errors (5xx storms) or too slowly (timeouts). A try whose
    server never said a word (the connection refused, closed before any answer byte as when the
    process dies, or its endpoint taken out while it waited) is free: the retry goes to another
    endpoint, and charging it would fail the requests in flight exactly when a server dies under
    load. `attempts` still bounds each request's retries."""
    return not isinstance(error, UpstreamUnreachable | UpstreamClosed | EndpointTakenOut)


def backoff(policy: RetryPolicy, retry: int, rng: random.Random) -> float:
    """Full jitter: uniform in [0, min(max_interval, base_interval x 2^(retry-1)))."""
    return rng.uniform(0, min(policy.max_interval, policy.base_interval * 2 ** (retry - 1)))
