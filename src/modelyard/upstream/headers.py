"""Which headers cross the proxy: hop-by-hop headers (RFC 9110 section 7.6.1) never do.

The proxy's own requests and answers keep the fields as bytes: `forwarded_headers` for a request
aiohttp's server read (the lean connection sorts its fields as it parses them, serving.h1), and the
upstream client's `UpstreamResponse.relayed` for answers (its drop set from `not_relayed`). The
text versions serve the callers that build aiohttp responses or gRPC metadata.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import AnyStr

from multidict import CIMultiDict

from modelyard.protocols.http import HOP_BY_HOP, NOT_FORWARDED_WITH_ID, RawHeaders

# An answer's Content-Length is recomputed; Date and Server are set by the gateway's own server.
_NOT_RELAYED = HOP_BY_HOP | {"content-length", "date", "server"}
_RAW_NOT_FORWARDED_WITH_ID = frozenset(name.encode() for name in NOT_FORWARDED_WITH_ID)
# What the upstream client's answers leave out of their relayed fields by default (lower case).
NOT_RELAYED = frozenset(name.encode() for name in _NOT_RELAYED)


def _without(
    headers: Iterable[tuple[AnyStr, AnyStr]], drop: frozenset[AnyStr], connection: AnyStr, comma: AnyStr
) -> list[tuple[AnyStr, AnyStr]]:
    """`headers` less `drop` and less the names listed in any `Connection` line ("close" among
    them: a field named Close goes too, as protocols.http.connection_options has it). Text or
    bytes: `connection` and `comma` say which."""
    fields = list(headers)
    lows = [name.lower() for name, _value in fields]
    kept = [field for field, low in zip(fields, lows, strict=True) if low not in drop]
    if connection in lows:
        listed = {
            token.strip().lower()
            for (_name, value), low in zip(fields, lows, strict=True)
            if low == connection
            for token in value.split(comma)
        }
        listed -= drop  # (names dropped already, "keep-alive" among them)
        if listed:
            kept = [field for field in kept if field[0].lower() not in listed]
    return kept


def forwarded_request_headers(headers: Iterable[tuple[str, str]], request_id: str) -> list[tuple[str, str]]:
    """The client's headers as they go upstream, with the request id set."""
    kept = _without(headers, NOT_FORWARDED_WITH_ID, "connection", ",")
    kept.append(("X-Request-Id", request_id))
    return kept


def relayed_response_headers(headers: Iterable[tuple[str, str]]) -> CIMultiDict[str]:
    """The server's headers as they go back to the client."""
    return CIMultiDict(_without(headers, _NOT_RELAYED, "connection", ","))


def forwarded_headers(fields: Iterable[tuple[bytes, bytes]], request_id: bytes) -> RawHeaders:
    """`forwarded_request_headers` for fields as they came (a parser's raw headers); `request_id`
    is a client's as it came, or one the gateway made."""
    kept = _without(fields, _RAW_NOT_FORWARDED_WITH_ID, b"connection", b",")
    kept.append((b"X-Request-Id", request_id))
    return RawHeaders(kept)


def not_relayed(replaced: Iterable[str]) -> frozenset[bytes]:
    """The fields an answer's `relayed` leaves out (the upstream client's `relay_drop`) when the
    caller sets the fields named `replaced` itself."""
    return NOT_RELAYED | {name.lower().encode() for name in replaced}
