"""Multipaths `[...]` and `{...}`: they always exist; `.` and `|` continue into them."""

from __future__ import annotations

from condition_support import cases, exists


@cases(
    ("[a,b]", "{}", True),
    ("[a,b].#", "{}", True),
    ("[a,b].0", "{}", False),
    ("[a,nope].0", '{"a":1}', True),
    ("[a,nope].1", '{"a":1}', False),
    ("[a,b].1", '{"a":1,"b":null}', True),
    ("[ a ].0", '{"a":1}', False),  # no trimming: the key is " a "
    ("[a,b]|#", "{}", True),
    ("{a:b}.a", '{"b":5}', True),
    ("{a:b}.b", '{"b":5}', False),
    ('{"x y":b}.x y', '{"b":5}', True),
    ("{b}.b", '{"b":5}', True),
    ("{x.b}.b", '{"x":{"b":5}}', True),
    ("{b.#}._", '{"b":[1]}', True),  # a name that is not simple becomes "_"
    ("{a,b}", "{}", True),
    ("{a,b}.a", "{}", False),
    ("a.[b]", '{"a":{"b":1}}', True),
    ("a.[b].0", '{"a":{"b":1}}', True),
    ("a.[c].0", '{"a":{"b":1}}', False),
    ("a.[c]", '{"a":{"b":1}}', True),
    ("x|[a]", "{}", True),  # the pipe runs on the missing value; a multipath always exists
    ("x.[a]", "{}", True),
    ("a.b.[c]", "{}", False),  # the pipe is only set once `a` is found
    ("[@this,a].1", '{"a":2}', True),
    ("[@this].0.a", '{"a":2}', True),
    ("[@this]|0.a", '{"a":2}', True),
    ("[[a]].0.0", '{"a":2}', True),
)
def test_multipaths(path: str, doc: str, expected: bool) -> None:
    assert exists(path, doc) is expected
