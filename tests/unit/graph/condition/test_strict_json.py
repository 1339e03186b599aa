"""gjson's validator: what KServe accepts as JSON before it tests a condition, and the value read."""

from __future__ import annotations

from typing import Any

import pytest

from modelyard.graph.condition import compile_condition, parse_json_strict


@pytest.mark.parametrize(
    ("data", "value"),
    [
        (b"{}", {}),
        (b"[]", []),
        (b"1", 1),
        (b"-0.5e+3", -500.0),
        (b'"x"', "x"),
        (b"null", None),
        (b"true", True),
        (b' \t\n\r{"a":1} \n', {"a": 1}),
        (b"  7  ", 7),
        (b'[1,[2,{"b":[]}]]', [1, [2, {"b": []}]]),
        (b'"\\u0000"', "\x00"),
        (b'"\\ud83d\\ude00"', "\U0001f600"),
        (b"123456789012345678901234567890", 1.2345678901234568e29),
    ],
)
def test_valid_json(data: bytes, value: Any) -> None:
    assert parse_json_strict(data) == (True, value)


@pytest.mark.parametrize(
    ("data", "value"),
    [
        (b'"\\ud800"', "\ufffd"),  # gjson accepts a lone surrogate escape; it reads as U+FFFD
        (b'{"a":"\\udc00x"}', {"a": "\ufffdx"}),
        (b'["\xff"]', ["\udcff"]),  # gjson does not check UTF-8; the byte is kept
        (b"1e400", float("inf")),  # gjson does not check the range
        (b"[1e400]", [float("inf")]),
    ],
)
def test_valid_json_that_orjson_rejects(data: bytes, value: Any) -> None:
    assert parse_json_strict(data) == (True, value)


def test_deep_nesting_is_valid() -> None:
    valid, value = parse_json_strict(b"[" * 3000 + b"]" * 3000)
    assert valid
    assert compile_condition("0.0.0").exists(value)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b" \n",
        b"NaN",
        b"nan",
        b"Infinity",
        b"-Infinity",
        b"[NaN]",
        b"1 2",
        b"{} {}",
        b'{"a":1}x',
        b"[1,]",
        b'{"a":1,}',
        b"{'a':1}",
        b"\xef\xbb\xbf{}",
        b"01",
        b"1.",
        b".5",
        b"+1",
        b"-",
        b"1e",
        b'"a\x01"',
        b'"\\x"',
        b'"\\u12"',
        b'"abc',
        b"[1",
        b'{"a"}',
        b'{"a":}',
        b"\x0c1",
        b"tru",
        b"truex",
        b"undefined",
        b"[1]\x00",
    ],
)
def test_invalid_json(data: bytes) -> None:
    assert parse_json_strict(data) == (False, None)
