"""How Go reads the text in a condition: strconv's ParseFloat, ParseBool and gjson's parseUint
for literals and indexes, and gjson's unescape for quoted strings. Errors are ignored as gjson
ignores them, so each function answers something for any input."""

from __future__ import annotations

import math
import re
from functools import lru_cache

_DECIMAL = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_HEXFLOAT = re.compile(r"([+-]?)0[xX]((?:[0-9a-fA-F]+\.?[0-9a-fA-F]*|\.[0-9a-fA-F]+))[pP]([+-]?[0-9]+)")
_INFINITY = re.compile(r"([+-]?)(?:inf|infinity)", re.IGNORECASE)


@lru_cache(maxsize=1024)
def parse_float(text: str) -> float:
    """strconv.ParseFloat(text, 64) with the error ignored: 0 on a syntax error, ±Inf past range.
    Go's float literal syntax: `1_000` (underscores between digits), `.5`, `5.`, `1e3`, `0x1p-2`,
    `inf`, `infinity`, `nan` (case-insensitive)."""
    if "_" in text:
        if not _underscores_ok(text):
            return 0.0
        text = text.replace("_", "")
    if _DECIMAL.fullmatch(text):
        return float(text)
    if text.lower() == "nan":
        return math.nan
    special = _INFINITY.fullmatch(text)
    if special:
        return -math.inf if special.group(1) == "-" else math.inf
    hexf = _HEXFLOAT.fullmatch(text)
    if hexf:
        sign, mantissa, exponent = hexf.groups()
        try:
            return float.fromhex(f"{sign}0x{mantissa}p{exponent}")
        except OverflowError:
            return -math.inf if sign == "-" else math.inf
    return 0.0


def _underscores_ok(text: str) -> bool:
    """strconv's underscoreOK: each `_` sits between digits (or right after a 0x/0b/0o prefix)."""
    saw = "^"
    i = 0
    if text[:1] in ("+", "-"):
        text = text[1:]
    hexa = False
    if len(text) >= 2 and text[0] == "0" and text[1].lower() in "box":
        i, saw, hexa = 2, "0", text[1].lower() == "x"
    for c in text[i:]:
        if "0" <= c <= "9" or (hexa and "a" <= c.lower() <= "f"):
            saw = "0"
        elif c == "_":
            if saw != "0":
                return False
            saw = "_"
        elif saw == "_":
            return False
        else:
            saw = "!"
    return saw != "_"


def parse_uint(part: str) -> int:
    """gjson's parseUint then int(): digits only, uint64 wrap-around; -1 when not an index."""
    if not part or not part.isascii() or not part.isdigit():
        return -1
    n = int(part) % (1 << 64)
    return -1 if n >= 1 << 63 else n


def parse_bool(text: str) -> bool | None:
    """Go's strconv.ParseBool after strings.ToLower."""
    low = text.lower()
    if low in ("1", "t", "true"):
        return True
    if low in ("0", "f", "false"):
        return False
    return None


_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_HEX = frozenset("0123456789abcdefABCDEF")


def _runeit(text: str) -> int:
    """strconv.ParseUint(text[:4], 16, 64) with the error ignored."""
    digits = text[:4]
    return int(digits, 16) if len(digits) == 4 and all(c in _HEX for c in digits) else 0


def unescape(text: str) -> str:
    """gjson's unescape: stops at a control character or a bad escape; lone surrogates become U+FFFD."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c < " ":
            break
        if c != "\\":
            out.append(c)
            i += 1
            continue
        i += 1
        if i >= n:
            break
        e = text[i]
        if e in _SIMPLE_ESCAPES:
            out.append(_SIMPLE_ESCAPES[e])
            i += 1
            continue
        if e != "u" or i + 5 > n:
            break
        r = _runeit(text[i + 1 :])
        i += 5
        if 0xD800 <= r <= 0xDFFF and n - i >= 6 and text[i] == "\\" and text[i + 1] == "u":
            low = _runeit(text[i + 2 :])
            r = 0x10000 + ((r - 0xD800) << 10) + (low - 0xDC00) if r < 0xDC00 <= low < 0xE000 else 0xFFFD
            i += 6
        out.append("\ufffd" if 0xD800 <= r <= 0xDFFF else chr(r))
    return "".join(out)
