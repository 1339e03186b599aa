"""Which headers cross the proxy, in each direction."""

from __future__ import annotations

from multidict import CIMultiDict

from modelyard.upstream import forwarded_request_headers, relayed_response_headers

HOP_BY_HOP = [
    ("Connection", "keep-alive, X-Hop-Only"),
    ("Keep-Alive", "timeout=5"),
    ("Proxy-Authenticate", "Basic"),
    ("Proxy-Authorization", "Basic abc"),
    ("TE", "trailers"),
    ("Trailer", "X-Checksum"),
    ("Transfer-Encoding", "chunked"),
    ("Upgrade", "websocket"),
    ("Proxy-Connection", "keep-alive"),
    ("X-Hop-Only", "dropped because Connection names it"),
]


def names(headers: CIMultiDict[str]) -> list[str]:
    return [name.lower() for name, _ in headers.items()]


def forwarded(headers: CIMultiDict[str], request_id: str) -> CIMultiDict[str]:
    """The request side returns (name, value) pairs ready to encode; compare them as a multidict."""
    return CIMultiDict(forwarded_request_headers(headers.items(), request_id))


def relayed(headers: CIMultiDict[str]) -> CIMultiDict[str]:
    return relayed_response_headers(headers.items())


def test_request_drops_hop_by_hop_host_and_content_length() -> None:
    incoming = CIMultiDict(
        [
            ("Host", "gateway:8000"),
            ("Content-Length", "42"),
            *HOP_BY_HOP,
            ("Authorization", "Bearer sk-123"),
            ("Content-Type", "application/json"),
            ("X-Custom", "kept"),
        ]
    )
    out = forwarded(incoming, "req-1")
    assert names(out) == ["authorization", "content-type", "x-custom", "x-request-id"]
    assert out["Authorization"] == "Bearer sk-123"
    assert out["Content-Type"] == "application/json"
    assert out["X-Custom"] == "kept"


def test_request_id_is_set_and_replaces_the_clients() -> None:
    out = forwarded(CIMultiDict([("X-Request-Id", "from-client")]), "req-2")
    assert out.getall("X-Request-Id") == ["req-2"]


def test_request_keeps_repeated_headers_in_order() -> None:
    out = forwarded(CIMultiDict([("Accept", "a/b"), ("Accept", "c/d")]), "r")
    assert out.getall("Accept") == ["a/b", "c/d"]


def test_header_names_match_case_insensitively() -> None:
    incoming = CIMultiDict([("connection", "X-HOP"), ("x-hop", "1"), ("keep-alive", "5"), ("HOST", "h")])
    assert names(forwarded(incoming, "r")) == ["x-request-id"]
    assert names(relayed(incoming)) == ["host"]


def test_response_drops_hop_by_hop_date_server_and_content_length() -> None:
    upstream = CIMultiDict(
        [
            ("Date", "Mon, 01 Jan 2024 00:00:00 GMT"),
            ("Server", "uvicorn"),
            ("Content-Length", "10"),
            *HOP_BY_HOP,
            ("Content-Type", "text/event-stream"),
            ("Set-Cookie", "a=1"),
            ("Set-Cookie", "b=2"),
            ("X-Custom", "kept"),
        ]
    )
    out = relayed(upstream)
    assert names(out) == ["content-type", "set-cookie", "set-cookie", "x-custom"]
    assert out.getall("Set-Cookie") == ["a=1", "b=2"]
    assert "X-Request-Id" not in out


def test_headers_named_in_any_connection_line_are_dropped() -> None:
    headers = CIMultiDict([("Connection", "keep-alive"), ("Connection", "X-Hop-Only"), ("X-Hop-Only", "1")])
    assert "X-Hop-Only" not in forwarded(headers, "r")
    assert "X-Hop-Only" not in relayed(headers)
