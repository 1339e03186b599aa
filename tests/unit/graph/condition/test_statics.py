"""Static values `!true`, `!false`, `!null`, and `!name` that is none (an ordinary key)."""

from __future__ import annotations

from condition_support import cases, exists


@cases(
    ("!true", "{}", True),
    ("!false", "{}", True),
    ("!null", "{}", True),
    ("!true.x", "{}", False),
    ("[!true,!null].1", "{}", True),
    ("!foo", '{"!foo":1}', True),  # not a static value: an ordinary key
)
def test_statics(path: str, doc: str, expected: bool) -> None:
    assert exists(path, doc) is expected
