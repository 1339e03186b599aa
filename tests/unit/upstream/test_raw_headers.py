"""Header fields kept as bytes (protocols.http.RawHeaders, HeaderView) and the raw versions of the
proxy's header rules (upstream.headers): the same fields cross the proxy as with text headers."""

from __future__ import annotations

import pytest

from modelyard.protocols.http import (
    HeaderView,
    RawHeaders,
    connection_options,
    encode_fields,
    field_value,
    fields_at,
)
from modelyard.upstream import (
    forwarded_headers,
    forwarded_request_headers,
    not_relayed,
)
from modelyard.upstream.http1 import encode_request

FIELDS = [
    (b"Host", b"gateway:8000"),
    (b"Content-Length", b"42"),
    (b"Connection", b"keep-alive, X-Hop-Only"),
    (b"X-Hop-Only", b"1"),
    (b"Transfer-Encoding", b"chunked"),
    (b"Date", b"Mon, 01 Jan 2024 00:00:00 GMT"),
    (b"Server", b"uvicorn"),
    (b"X-Request-Id", b"from-the-peer"),
    (b"Set-Cookie", b"a=1"),
    (b"set-cookie", b"b=2"),
    (b"X-Note", "café".encode()),
    (b"X-Latin", b"\xe9t\xe9"),  # not UTF-8: kept as the same bytes
]


def text(fields: list[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    return [(n.decode("utf-8", "surrogateescape"), v.decode("utf-8", "surrogateescape")) for n, v in fields]


def test_forwarded_raw_fields_are_the_text_rules_fields() -> None:
    raw = forwarded_headers(FIELDS, b"req-1")
    assert list(raw) == forwarded_request_headers(text(FIELDS), "req-1")
    assert field_value(raw.fields, b"x-request-id") == b"req-1"


def test_not_relayed_adds_the_names_a_caller_replaces_in_lower_case() -> None:
    drop = not_relayed(["X-Request-Id", "X-Modelyard-Backend"])
    assert {b"x-request-id", b"x-modelyard-backend", b"connection", b"date", b"server"} <= drop


def test_connection_options_are_the_listed_names_in_lower_case() -> None:
    fields = [(b"Connection", b"keep-alive, X-Hop"), (b"X-Hop", b"1"), (b"connection", b" close ,TE,")]
    assert connection_options(fields, [0, 2]) == {b"x-hop", b"close", b"te"}  # a field named Close goes
    assert connection_options([(b"Connection", b"keep-alive")], [0]) == set()


@pytest.mark.parametrize("count", [0, 1, 3])
def test_fields_at_takes_those_positions_as_a_new_list(count: int) -> None:
    fields = [(b"A", b"1"), (b"B", b"2"), (b"C", b"3"), (b"D", b"4")]
    indexes = [3, 0, 2][:count]
    taken = fields_at(indexes)(fields)
    assert taken == [fields[i] for i in indexes]
    taken.append((b"X", b"x"))
    assert len(fields) == 4 and fields_at(indexes)(fields) == [fields[i] for i in indexes]


def test_an_empty_block_is_empty() -> None:
    assert RawHeaders([]).block() == b""


def test_a_block_is_the_fields_as_head_lines_and_leaves_encode_request_as_they_are() -> None:
    raw = RawHeaders([(b"A", b"1"), (b"B", b"\xff")])
    assert raw.block() == b"A: 1\r\nB: \xff\r\n"
    assert encode_request("POST", "/p", b"h", raw, b"{}") == (
        b"POST /p HTTP/1.1\r\nHost: h\r\nA: 1\r\nB: \xff\r\nContent-Length: 2\r\n\r\n{}"
    )


@pytest.mark.parametrize(
    ("name", "value"), [("x-a", "v\r\nX-Injected: 1"), ("x-a", "v\nx"), ("x-a", "v\0"), ("a\rb", "v")]
)
def test_added_fields_may_not_hold_cr_lf_or_nul(name: str, value: str) -> None:
    with pytest.raises(ValueError, match="may not hold CR, LF or NUL"):
        encode_fields([(name, value)])
    with pytest.raises(ValueError, match="may not hold CR, LF or NUL"):
        encode_fields([("X-Ok", "1"), (name, value)])


def test_added_text_round_trips() -> None:
    raw = RawHeaders(
        list(encode_fields([("X-Note", "café \udce9")]))
    )  # a surrogate-escaped byte goes out as that byte
    assert raw.fields == [(b"X-Note", "café ".encode() + b"\xe9")]
    assert list(raw) == [("X-Note", "café \udce9")]


def test_a_header_view_looks_up_case_insensitively_first_value_first() -> None:
    view = HeaderView(FIELDS)
    assert view.get("set-COOKIE") == "a=1"
    assert view["X-Note"] == "café"
    assert view.get("X-Latin") == "\udce9t\udce9"
    assert "host" in view and "Nope" not in view and 3 not in view
    assert view.get("nope") is None
    with pytest.raises(KeyError):
        view["nope"]
    assert len(view) == len(FIELDS)
    assert view.items() == text(FIELDS)  # every field, repeats too, in order
    assert list(view)[:2] == ["Host", "Content-Length"]


def test_field_value_is_the_first_match() -> None:
    assert field_value(FIELDS, b"set-cookie") == b"a=1"
    assert field_value(FIELDS, b"absent") is None
