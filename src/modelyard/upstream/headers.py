"""Which headers cross the proxy: hop-by-hop headers (RFC 9110 section 7.6.1) never do."""

from __future__ import annotations

from collections.abc import Iterable

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
# Recomputed by the next hop (Host, Content-Length), already settled with the client (Expect: the
# gateway holds the whole body), or set by the gateway's own server (Date, Server).
_NOT_FORWARDED = HOP_BY_HOP | {"host", "content-length", "expect"}
_NOT_RELAYED = HOP_BY_HOP | {"content-length", "date", "server"}


def _connection_tokens(headers: list[tuple[str, str]]) -> set[str]:
    """Header names listed in every `Connection` line (a message may carry several)."""
    return {
        token.strip().lower()
        for name, value in headers
        if name.lower() == "connection"
        for token in value.split(",")
    }


def _without(headers: list[tuple[str, str]], drop: frozenset[str]) -> list[tuple[str, str]]:
    tokens = _connection_tokens(headers)
    return [(n, v) for n, v in headers if (low := n.lower()) not in drop and low not in tokens]


def forwarded_request_headers(headers: Iterable[tuple[str, str]], request_id: str) -> list[tuple[str, str]]:
    """The client's headers as they go upstream, with the request id set."""
    kept = [(n, v) for n, v in _without(list(headers), _NOT_FORWARDED) if n.lower() != "x-request-id"]
    kept.append(("X-Request-Id", request_id))
    return kept


def relayed_response_headers(headers: Iterable[tuple[str, str]]) -> CIMultiDict[str]:
    """The server's headers as they go back to the client."""
    return CIMultiDict(_without(list(headers), _NOT_RELAYED))
