"""The proxy's contract with its upstream pool."""

from __future__ import annotations

import random

import pytest

from modelyard.config import UpstreamConfig
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.gateway.proxy import NOT_RELAYED, Proxy
from modelyard.rpc import OipChannels
from modelyard.state import MemoryState
from modelyard.upstream import UpstreamPool


def proxy(pool: UpstreamPool) -> Proxy:
    return Proxy(pool, OipChannels(), MemoryState(), GatewayMetrics(lambda: []), random.Random(0))


def test_a_pool_whose_answers_would_keep_the_proxys_own_fields_is_refused() -> None:
    """The proxy sets X-Request-Id and the X-Modelyard-* fields itself: a pool relaying a server's
    own would double them in the client's answer."""
    with pytest.raises(ValueError, match=r"at least proxy\.NOT_RELAYED"):
        proxy(UpstreamPool(UpstreamConfig()))
    proxy(UpstreamPool(UpstreamConfig(), relay_drop=NOT_RELAYED))
    proxy(UpstreamPool(UpstreamConfig(), relay_drop=NOT_RELAYED | {b"x-more"}))
