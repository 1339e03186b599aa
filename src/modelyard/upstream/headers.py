"""Which headers cross the proxy: hop-by-hop headers (RFC 9110 section 7.6.1) never do."""

from __future__ import annotations

from collections.abc import Iterable

from multidict import CIMultiDict

from modelyard.protocols.http import HOP_BY_HOP

# Recomputed by the next hop (Host, Content-Length), already settled with the client (Expect: the
# gateway holds the whole body; Content-Encoding: aiohttp has decoded a gzip/deflate body), or set
# by the gateway's own server (Date, Server).
_NOT_FORWARDED = HOP_BY_HOP | {"host", "content-length", "expect", "content-encoding"}
_NOT_RELAYED = HOP_BY_HOP | {"content-length", "date", "server"}
_NOT_FORWARDED_WITH_ID = _NOT_FORWARDED | {"x-request-id"}  # the gateway sets its own


def _without(headers: Iterable[tuple[str, str]], drop: frozenset[str]) -> list[tuple[str, str]]:
    """`headers` less `drop` and less the names listed in any `Connection` line, in one pass
    (this runs twice per proxied request)."""
    kept: list[tuple[str, str, str]] = []
    listed: set[str] | None = None
    for name, value in headers:
        low = name.lower()
        if low == "connection":
            listed = (listed or set()) | {token.strip().lower() for token in value.split(",")}
        if low not in drop:
            kept.append((name, value, low))
    if listed:
        return [(n, v) for n, v, low in kept if low not in listed]
    return [(n, v) for n, v, _low in kept]


def forwarded_request_headers(headers: Iterable[tuple[str, str]], request_id: str) -> list[tuple[str, str]]:
    """The client's headers as they go upstream, with the request id set."""
    kept = _without(headers, _NOT_FORWARDED_WITH_ID)
    kept.append(("X-Request-Id", request_id))
    return kept


def relayed_response_headers(headers: Iterable[tuple[str, str]]) -> CIMultiDict[str]:
    """The server's headers as they go back to the client."""
    return CIMultiDict(_without(headers, _NOT_RELAYED))
