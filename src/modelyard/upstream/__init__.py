"""HTTP to inference servers: keep-alive pools, forwarding, probes."""

from modelyard.upstream.headers import (
    forwarded_headers,
    forwarded_request_headers,
    not_relayed,
    relayed_response_headers,
)
from modelyard.upstream.http1 import Flight, UpstreamResponse
from modelyard.upstream.pool import UpstreamPool

__all__ = [
    "Flight",
    "UpstreamPool",
    "UpstreamResponse",
    "forwarded_headers",
    "forwarded_request_headers",
    "not_relayed",
    "relayed_response_headers",
]
