"""tidwall/match as `%` and `!%` use it: `*`, `?` and `\\` only, and the complexity cap."""

from __future__ import annotations

import time

import orjson
import pytest
from condition_support import exists


@pytest.mark.parametrize(
    ("pattern", "text", "expected"),
    [
        ('"*"', "", True),
        ('"*"', "anything", True),
        ('"a*"', "abc", True),
        ('"a*"', "bac", False),
        ('"*c"', "abc", True),
        ('"a?c"', "abc", True),
        ('"a?c"', "ac", False),
        ('"?"', "\u00e9", True),  # one rune, not one byte
        ('"??"', "\u00e9", False),
        ('"a.c"', "abc", False),  # `.` is a literal
        ('"a.c"', "a.c", True),
        ('"(x)"', "(x)", True),
        ('"[ab]"', "a", False),  # no character classes
        ('"[ab]"', "[ab]", True),
        ('"*a*b*c*"', "xaxbxcx", True),
        ('"*a*b*c*"', "xcxbxax", False),
        ("a\\*c", "a*c", True),  # unquoted: `\*` is an escaped star
        ("a\\*c", "abc", False),
        ('"a\\*c"', "a", True),  # quoted: gjson's unescape stops at the unknown escape `\*`
        ('"a\\*c"', "a*c", False),
        ('"A*"', "abc", False),  # case-sensitive
    ],
)
def test_glob(pattern: str, text: str, expected: bool) -> None:
    doc = orjson.dumps({"s": text}).decode()
    assert exists(f"[@this].#(s%{pattern})", doc) is expected
    assert exists(f"[@this].#(s!%{pattern})", doc) is (not expected)


def test_glob_gives_up_past_the_complexity_limit() -> None:
    # without the 10000-steps-per-byte cap this search takes astronomically long
    doc = orjson.dumps({"s": "a" * 25}).decode()
    started = time.monotonic()
    assert exists('[@this].#(s%"*a*a*a*a*a*a*a*a*a*a*a*a*b*")', doc) is False
    assert time.monotonic() - started < 10
