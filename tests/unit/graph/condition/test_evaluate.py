"""gjson.Get on parsed values: existence, keys, indexes, wildcards, escapes, counts and pipes."""

from __future__ import annotations

import pytest
from condition_support import cases, exists

# --- existence ------------------------------------------------------------------------------------


@cases(
    ("a", '{"a":null}', True),
    ("a", '{"a":{}}', True),
    ("a", '{"a":[]}', True),
    ("a", '{"a":false}', True),
    ("a", '{"a":0}', True),
    ("a", '{"a":""}', True),
    ("a", '{"b":1}', False),
    ("a", "{}", False),
    ("a", '"a"', False),
    ("a", "null", False),
    ("a.b.c", '{"a":{"b":{"c":null}}}', True),
    ("a.b.c", '{"a":{"b":{"d":1}}}', False),
    ("a.b.c", '{"a":{"b":"c"}}', False),
    ("@this", "null", True),
    ("@this", "false", True),
    ("@this", '""', True),
)
def test_existence(path: str, doc: str, expected: bool) -> None:
    assert exists(path, doc) is expected


# --- keys, indexes, wildcards, escapes, counts ----------------------------------------------------

SYNTAX_DOC = """{
  "name": {"first": "Tom", "last": "Anderson"},
  "age":37,
  "children": ["Sara","Alex","Jack"],
  "fav.movie": "Deer Hunter",
  "friends": [
    {"first": "Dale", "last": "Murphy", "age": 44, "nets": ["ig", "fb", "tw"]},
    {"first": "Roger", "last": "Craig", "age": 68, "nets": ["fb", "tw"]},
    {"first": "Jane", "last": "Murphy", "age": 47, "nets": ["ig", "tw"]}
  ]
}"""


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        # gjson's SYNTAX.md examples
        ("name.last", True),
        ("age", True),
        ("children", True),
        ("children.0", True),
        ("children.2", True),
        ("children.3", False),
        ("friends.1.first", True),
        ("child*.2", True),
        ("c?ildren.0", True),
        ("fav\\.movie", True),
        ("fav.movie", False),
        ("friends.#", True),
        ("friends.#.age", True),
        ('friends.#(last=="Murphy").first', True),
        ('friends.#(last=="Murphy")#.first', True),
        ("friends.#(age>45)#.last", True),
        ('friends.#(first%"D*").last', True),
        ('friends.#(first!%"D*").last', True),
        ('children.#(!%"*a*")', True),
        ('children.#(%"*a*")#', True),
        ('friends.#(nets.#(=="fb"))#.first', True),
        # dot vs pipe
        ("friends.0.first", True),
        ("friends|0.first", True),
        ("friends.0|first", True),
        ("friends|0|first", True),
        ("friends|#", True),
        ('friends.#(last="Murphy")#', True),
        ('friends.#(last="Murphy")#.first', True),
        ('friends.#(last="Murphy")#|first', False),
        ('friends.#(last="Murphy")#.0', True),  # []
        ('friends.#(last="Murphy")#|0', True),
        ('friends.#(last="Murphy")#.#', True),  # []
        ('friends.#(last="Murphy")#|#', True),
        ("children.@reverse", True),
        ("children.@reverse.0", True),
        ('{name.first,age,"the_murphys":friends.#(last="Murphy")#.first}', True),
        ('{name.first,age,"the_murphys":friends.#(last="Murphy")#.first}.the_murphys', True),
        ('{name.first,age,"the_murphys":friends.#(last="Murphy")#.first}.first', True),
        ('{name.first,age,"the_murphys":friends.#(last="Murphy")#.first}.age', True),
        ('{name.first,age,"the_murphys":friends.#(last="Murphy")#.first}.name', False),
        # more of the same document
        ('friends.#(first=="Nobody").last', False),
        ("friends.#(age>100)#", True),
        ("friends.#(age>100)", False),
        ('friends.#(nets.#(=="xx"))', False),
        ('friends.#(nets.#(=="xx"))#', True),
        ("friends.#(nets)", True),
        ("friends.#(zzz)", False),
        ('friends.#[last=="Craig"].first', True),  # the pre-1.3 query brackets still work
        ("friends.#.nets.#", True),
        ("x*", False),
        ("*.first", True),
        ("n?me.last", True),
        ("name.l*", True),
    ],
)
def test_syntax_document(path: str, expected: bool) -> None:
    assert exists(path, SYNTAX_DOC) is expected


@cases(
    ("0", "[5]", True),
    ("1", "[5]", False),
    ("01", "[5,6]", True),
    ("-1", "[5]", False),
    ("+0", "[5]", False),
    ("0", '{"0":1}', True),
    ("a.0", '{"a":{"0":1}}', True),
    ("a.0", '{"a":[]}', False),
    ("a.1.b", '{"a":[{"b":1},{"b":2}]}', True),
    ("a.1.b", '{"a":[{"b":1},5]}', False),
    ("a.0.0", '{"a":[[7]]}', True),
    ("a\\.b", '{"a.b":1}', True),
    ("a\\.b", '{"a":{"b":1}}', False),
    ("a\\.b.c", '{"a.b":{"c":1}}', True),
    ("a\\*b", '{"a*b":1}', True),
    ("a\\*b", '{"axb":1}', False),
    ("a\\?", '{"a?":1}', True),
    ("a\\\\b", '{"a\\\\b":1}', True),
    ("a*", '{"b":1,"abc":2}', True),
    ("a*.b", '{"ax":{},"ay":{"b":1}}', True),  # every matching key is tried in order
    ("a*.b", '{"ax":{"c":1},"ay":5}', False),
    ("*", "{}", False),
    ("*", '{"a":null}', True),
    ("?", '{"ab":1}', False),
    ("??", '{"ab":1}', True),
    ("a.#", '{"a":[]}', True),
    ("a.#", '{"a":[1,2]}', True),
    ("a.#", '{"a":{}}', False),
    ("a.#", '{"a":"[1]"}', False),
    ("a.#", '{"a":{"#":1}}', True),
    ("#", "[1]", True),
    ("#", "{}", False),
    ("a.#.b", '{"a":[{"b":1},{"c":2}]}', True),
    ("a.#.b", '{"a":[]}', True),
    ("a.#.b", '{"a":{}}', False),
    ("a.#.b.0", '{"a":[{"b":1}]}', True),  # maps `b.0` over the elements: []
    ("a.#.b|0", '{"a":[{"b":1}]}', True),
    ("a.#.b|0", '{"a":[{"c":1}]}', False),
    ("a.#.b|#", '{"a":[]}', True),
    ("[@this].#(a.#>1)", '{"a":[1,2]}', True),
    ("[@this].#(a.#>1)", '{"a":[1]}', False),
    ("..0", '{"a":1}', True),
    ("..#", '{"a":1}', True),
    ("..1", '{"a":1}', False),
    ("..0.a", '{"a":1}', True),
    ("..#(a==1)", '{"a":1}', True),
    ("..#(a==2)", '{"a":1}', False),
)
def test_paths(path: str, doc: str, expected: bool) -> None:
    assert exists(path, doc) is expected
