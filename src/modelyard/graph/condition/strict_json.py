"""What gjson's validator accepts as JSON, and the value it holds.

KServe checks a body with `gjson.ValidBytes` before it tests a condition: one JSON value with
optional surrounding whitespace (space, tab, CR, LF), any root type; no NaN/Infinity, no empty
input, nothing after the value. Unlike orjson, gjson does not check UTF-8, surrogate escapes,
nesting depth or whether a number fits a double, so documents orjson rejects are decoded by a
slower port of gjson's rules.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from modelyard.graph.condition.go_strconv import unescape
from modelyard.graph.condition.values import MISSING


def parse_json_strict(data: bytes) -> tuple[bool, Any]:
    """(valid, value) by gjson's validator; (False, None) for what it rejects."""
    try:
        return True, orjson.loads(data)
    except orjson.JSONDecodeError:
        pass
    value = decode_strict(data)
    if value is MISSING:
        return False, None
    return True, value


_WS = b" \t\n\r"
_NUMBER = re.compile(rb"-?(?:0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
_STRING_BODY = re.compile(
    rb'[^"\\\x00-\x1f]*(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})[^"\\\x00-\x1f]*)*"'
)  # after the opening quote, up to and including the closing one


def _skip_ws(data: bytes, i: int) -> int:
    n = len(data)
    while i < n and data[i] in _WS:
        i += 1
    return i


def _read_string(data: bytes, i: int) -> tuple[str, int] | None:
    """The string whose opening quote is at i - 1: (decoded, index after the closing quote)."""
    m = _STRING_BODY.match(data, i)
    if m is None:
        return None
    raw = data[i : m.end() - 1].decode("utf-8", "surrogateescape")
    return (unescape(raw) if "\\" in raw else raw), m.end()


def decode_strict(data: bytes) -> Any:
    """gjson's validator (RFC 8259 without UTF-8, surrogate, depth or range checks) that also
    builds the value: MISSING when invalid. Iterative, so any depth; first duplicate key wins."""
    n = len(data)
    i = _skip_ws(data, 0)
    stack: list[Any] = []
    keys: list[str] = []
    while True:
        if i >= n:
            return MISSING
        c = data[i]
        value: Any
        if c == 0x7B:  # {
            i = _skip_ws(data, i + 1)
            if i < n and data[i] == 0x7D:
                value, i = {}, i + 1
            else:
                member = _read_member_key(data, i)
                if member is None:
                    return MISSING
                key, i = member
                stack.append({})
                keys.append(key)
                continue
        elif c == 0x5B:  # [
            i = _skip_ws(data, i + 1)
            if i < n and data[i] == 0x5D:
                value, i = [], i + 1
            else:
                stack.append([])
                keys.append("")
                continue
        elif c == 0x22:  # "
            read = _read_string(data, i + 1)
            if read is None:
                return MISSING
            value, i = read
        elif c == 0x2D or 0x30 <= c <= 0x39:
            m = _NUMBER.match(data, i)
            if m is None:
                return MISSING
            raw = m.group()
            value = float(raw) if m.group(1) or m.group(2) else int(raw)
            i = m.end()
        elif data.startswith(b"true", i):
            value, i = True, i + 4
        elif data.startswith(b"false", i):
            value, i = False, i + 5
        elif data.startswith(b"null", i):
            value, i = None, i + 4
        else:
            return MISSING
        while True:  # attach the value, closing every container it completes
            i = _skip_ws(data, i)
            if not stack:
                return value if i == n else MISSING
            top = stack[-1]
            if isinstance(top, list):
                top.append(value)
            elif keys[-1] not in top:
                top[keys[-1]] = value
            if i >= n:
                return MISSING
            c = data[i]
            if c == 0x2C:  # ,
                i = _skip_ws(data, i + 1)
                if isinstance(top, dict):
                    member = _read_member_key(data, i)
                    if member is None:
                        return MISSING
                    keys[-1], i = member
                break
            if c == (0x5D if isinstance(top, list) else 0x7D):
                i += 1
                value = stack.pop()
                keys.pop()
                continue
            return MISSING


def _read_member_key(data: bytes, i: int) -> tuple[str, int] | None:
    """`"key" :` at i; returns the key and the index of the member's value."""
    if i >= len(data) or data[i] != 0x22:
        return None
    read = _read_string(data, i + 1)
    if read is None:
        return None
    key, i = read
    i = _skip_ws(data, i)
    if i >= len(data) or data[i] != 0x3A:
        return None
    return key, _skip_ws(data, i + 1)
