"""The `@modifiers`, and `@name` that is no modifier (an ordinary key)."""

from __future__ import annotations

from condition_support import cases, exists


@cases(
    ("x.@this", "{}", False),
    ("@reverse.0", "[1,2]", True),
    ("@reverse.0", "[]", False),
    ("@reverse|#(==1)", "[3,1]", True),
    ("@reverse.0", '{"a":1}', False),
    ("@keys.#(==a)", '{"a":1}', True),
    ("@keys.#(==a)", '{"b":1}', False),
    ("x|@keys", "{}", True),  # @keys of nothing is []
    ("@values.#(==1)", '{"a":1}', True),
    ("@values.#(==1)", "[1]", True),
    ("@flatten.2", "[1,[2,3]]", True),
    ("@flatten.2", "[1,[2]]", False),
    ('@flatten:{"deep":true}.2', "[1,[2,[3]]]", True),
    ("@flatten.2", "[1,[2,[3]]]", True),  # [1,2,[3]]
    ("@flatten.2.0", "[1,[2,[3]]]", True),
    ("@join.b", '[{"a":1},{"b":2}]', True),
    ("@join.c", '[{"a":1},{"b":2}]', False),
    ("@group.1.name", '{"id":[1,2],"name":["a","b"]}', True),
    ("@group.2", '{"id":[1,2],"name":["a","b"]}', False),
    ("@group", "[1]", False),
    ("@valid", '{"a":1}', True),
    ("@ugly.a", '{"a":1}', True),
    ("@pretty.a", '{"a":1}', True),
    ("a.@reverse.0", '{"a":[1]}', True),
    ("@tostr", "{}", True),
    ("@this.a", '{"a":1}', True),
    ("@this|a", '{"a":1}', True),
    ("@foo", '{"@foo":1}', True),  # not a modifier: an ordinary key
    ("@foo", "{}", False),
    ("a.@foo", '{"a":{"@foo":1}}', True),
    ("@dig:b.0", '{"a":{"b":[5]}}', True),  # an array of every match, so it always exists
    ("@dig:b|0", '{"a":{"b":1}}', True),
    ("@dig:b|0", '{"a":{"c":1}}', False),
)
def test_modifiers(path: str, doc: str, expected: bool) -> None:
    assert exists(path, doc) is expected
