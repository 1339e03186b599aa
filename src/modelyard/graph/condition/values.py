"""Parsed JSON values as gjson sees them: `MISSING` is gjson's empty Result (not found, which is
not JSON null), numbers exclude booleans, and strings are Go byte strings."""

from __future__ import annotations

import math
from typing import Any


class _Missing:
    __slots__ = ()

    def __repr__(self) -> str:
        return "<missing>"


MISSING: Any = _Missing()  # gjson's empty Result: Type Null, Raw ""


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def to_float(value: Any) -> float:
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def go_bytes(text: str) -> bytes:
    """The bytes Go holds for this string (raw bytes come back from surrogateescape)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        try:
            return text.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            return text.encode("utf-8", "surrogatepass")
