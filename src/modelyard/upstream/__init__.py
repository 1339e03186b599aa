"""HTTP to inference servers: keep-alive pools, forwarding, probes; the only aiohttp client user."""

from modelyard.upstream.headers import forwarded_request_headers, relayed_response_headers
from modelyard.upstream.pool import UpstreamPool

__all__ = ["UpstreamPool", "forwarded_request_headers", "relayed_response_headers"]
