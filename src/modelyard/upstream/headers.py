"""Which headers cross the proxy: hop-by-hop headers (RFC 9110 section 7.6.1) never do."""

from __future__ import annotations

from collections.abc import Mapping

from multidict import CIMultiDict

HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
        "Proxy-Connection",
    )
)
# Recomputed by the next hop (Host, Content-Length) or set by the gateway's own server (Date, Server).
_NOT_FORWARDED = HOP_BY_HOP | {"host", "content-length"}
_NOT_RELAYED = HOP_BY_HOP | {"content-length", "date", "server"}


def _connection_tokens(headers: Mapping[str, str]) -> set[str]:
    """Header names listed in every `Connection` line (a multidict may hold several)."""
    return {
        token.strip().lower()
        for name, value in headers.items()
        if name.lower() == "connection"
        for token in value.split(",")
    }


def forwarded_request_headers(headers: Mapping[str, str], request_id: str) -> CIMultiDict[str]:
    drop = _NOT_FORWARDED | _connection_tokens(headers)
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        if name.lower() not in drop:
            out.add(name, value)
    out["X-Request-Id"] = request_id
    return out


def relayed_response_headers(headers: Mapping[str, str]) -> CIMultiDict[str]:
    drop = _NOT_RELAYED | _connection_tokens(headers)
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        if name.lower() not in drop:
            out.add(name, value)
    return out
