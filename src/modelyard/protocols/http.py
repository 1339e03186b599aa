"""HTTP facts every server and client here shares."""

from __future__ import annotations

# Hop-by-hop headers (RFC 9110 section 7.6.1, and the non-standard Proxy-Connection): they describe
# one connection, never the message, so they never cross a proxy. Lower case.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
