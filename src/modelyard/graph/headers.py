"""Header propagation as KServe's router does it: `PROPAGATE_HEADERS` is a comma-separated list of
regular expressions, matched unanchored and case-sensitively against Go-canonical header names
(`X-Request-Id`); matching headers go to every service call, with all their values. None by default."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

from modelyard.protocols.http import HOP_BY_HOP

log = logging.getLogger("modelyard.graph")


# Go's client writes these itself from the outgoing request (the connection's own headers, Host,
# the body's framing), so copied ones are never sent; it does send Proxy-* headers it is given.
_NEVER = (HOP_BY_HOP - {"proxy-authenticate", "proxy-authorization", "proxy-connection"}) | {
    "host",
    "content-length",
}


def compile_patterns(setting: str | None) -> list[re.Pattern[str]]:
    """Invalid patterns are logged and skipped, as KServe does (e.g. `*Trace-Id*`)."""
    if not setting:
        return []
    compiled = []
    for pattern in setting.split(","):
        try:
            compiled.append(re.compile(pattern))
        except re.error as exc:
            log.warning("PROPAGATE_HEADERS: skipping invalid pattern %r: %s", pattern, exc)
    return compiled


def canonical(name: str) -> str:
    """Go's textproto.CanonicalMIMEHeaderKey for ordinary names: `x-request-id` -> `X-Request-Id`."""
    if not name or any(c in name for c in " :\t\r\n"):
        return name
    return "-".join(part[:1].upper() + part[1:].lower() for part in name.split("-"))


def propagated(headers: Iterable[tuple[str, str]], patterns: list[re.Pattern[str]]) -> list[tuple[str, str]]:
    """The incoming headers to send to every step; never Host."""
    if not patterns:
        return []
    out = []
    for name, value in headers:
        key = canonical(name)
        if key.lower() not in _NEVER and any(p.search(key) for p in patterns):
            out.append((key, value))
    return out
