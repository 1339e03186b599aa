"""Queries `#(KEY OP VALUE)`: the element's JSON type picks the comparison; the `~` truthiness forms."""

from __future__ import annotations

from condition_support import cases, exists


@cases(
    # the element's JSON type picks the comparison
    ("a.#(==2)", "[1,2]", False),
    ("a.#(==2)", '{"a":[1,2]}', True),
    ("a.#(>5)", '{"a":[1,2]}', False),
    ('a.#(=="2")', '{"a":[2]}', True),
    ('a.#(=="2")', '{"a":["2"]}', True),
    ("a.#(==2)", '{"a":["2"]}', True),
    ("a.#(==2.0)", '{"a":["2"]}', False),
    ("a.#(==2.0)", '{"a":[2]}', True),
    ("a.#(=2)", '{"a":[2]}', True),
    ("a.#(!=1)", '{"a":[1,1]}', False),
    ("a.#(!=1)", '{"a":[1,2]}', True),
    ("a.#(<1)", '{"a":[0.5]}', True),
    ("a.#(>=1)", '{"a":[1]}', True),
    ("a.#(<=1)", '{"a":[1.5]}', False),
    ('a.#(>="b")', '{"a":["a"]}', False),
    ('a.#(>="b")', '{"a":["b"]}', True),
    ('a.#(>="b")', '{"a":["ba"]}', True),
    ('a.#(<"b")', '{"a":["B"]}', True),  # byte order: "B" < "b"
    ('a.#(>"z")', '{"a":["\u00e9"]}', True),
    ("a.#(==9007199254740993)", '{"a":[9007199254740992]}', True),  # float64 on both sides
    ("a.#(==1e2)", '{"a":[100]}', True),
    ("a.#(==abc)", '{"a":[0]}', True),  # an unparsable number reads as 0
    ("a.#(==abc)", '{"a":[1]}', False),
    ("a.#(<abc)", '{"a":[-1]}', True),
    ("a.#(<inf)", '{"a":[1e300]}', True),
    ("a.#(%1*)", '{"a":[10]}', False),  # no pattern matching on numbers
    # keys that are sub-paths, nested queries, scalars and key paths
    ("a.#(b==1)", '{"a":[1,2]}', False),
    ("a.#(b.c==1)", '{"a":[{"b":{"c":1}}]}', True),
    ("a.#(b.#(c==1))", '{"a":[{"b":[{"c":2}]},{"b":[{"c":1}]}]}', True),
    ("a.#(b.#(c==1))", '{"a":[{"b":[{"c":2}]}]}', False),
    ("a.#(b.#(c==1))#", '{"a":[{"b":[{"c":2}]}]}', True),
    ("[@this].#(==5)", "5", True),
    ("[@this].#(a==1)", "5", False),
    ("a.#(@this==1)", '{"a":[1]}', False),  # a key path never matches a scalar element
    # first match, all matches
    ("a.#(b==9)", '{"a":[{"b":1}]}', False),
    ("a.#(b==9)#", '{"a":[{"b":1}]}', True),
    ("a.#(b==9)#", '{"a":[]}', True),
    ("a.#(b==9)#", '{"a":{}}', False),
    ("a.#(b==9)#", "{}", False),
    ("a.#(b==9)#.c", '{"a":[{"b":1}]}', True),
    ("a.#(b==9)#|0", '{"a":[{"b":1}]}', False),
    ("a.#(b==1)#|0", '{"a":[{"b":1}]}', True),
    ("a.#(b==1).c", '{"a":[{"b":1},{"b":1,"c":2}]}', False),  # the first match decides
    ("a.#(b==1)#.c", '{"a":[{"b":1},{"b":1,"c":2}]}', True),
    ("a.#(b==1)|c", '{"a":[{"b":1,"c":2}]}', True),
    ("a.#(b==1)#|c", '{"a":[{"b":1,"c":2}]}', False),
    ("a.#(b==1)#|#", '{"a":[{"b":1}]}', True),
    ("a.#(b==9)#|#", '{"a":[{"b":1}]}', True),
    # existence tests, null and containers
    ("[@this].#(v)", '{"v":null}', True),
    ("[@this].#(v)", '{"w":null}', False),
    ("[@this].#(v==null)", '{"v":null}', False),
    ("[@this].#(v!=1)", '{"v":null}', False),
    ("[@this].#(v==x)", '{"v":{"a":1}}', False),
    ("[@this].#(v!=x)", '{"v":[1]}', False),
    # literals: quoted, raw, whitespace, escapes
    ("[@this].#(name==a b)", '{"name":"a b"}', True),
    ('[@this].#( name == "x" )', '{"name":"x"}', True),
    ('[@this].#(name=="a.b")', '{"name":"a.b"}', True),
    ('[@this].#(name=="a)b")', '{"name":"a)b"}', True),
    ('[@this].#(name=="say \\"hi\\"")', '{"name":"say \\"hi\\""}', True),
    ('[@this].#(name=="\\u0041")', '{"name":"A"}', True),
    ('[@this].#(name=="x"y)', '{"name":"\\"x\\"y"}', True),  # not wrapped in quotes: raw text
    ("[@this].#(a\\==1)", '{"a=":1}', True),  # an escaped `=` belongs to the key
    ("[@this].#(a!b)", '{"a":0}', True),  # `!` without `=`/`%`: no operator, existence of `a`
)
def test_queries(path: str, doc: str, expected: bool) -> None:
    assert exists(path, doc) is expected


@cases(
    ("[@this].#(b==true)", '{"b":true}', True),
    ("[@this].#(b==false)", '{"b":true}', False),
    ("[@this].#(b==false)", '{"b":false}', True),
    ("[@this].#(b!=true)", '{"b":false}', True),
    ("[@this].#(b!=true)", '{"b":true}', False),
    ("[@this].#(b>false)", '{"b":true}', True),
    ("[@this].#(b>=anything)", '{"b":true}', True),
    ("[@this].#(b<true)", '{"b":false}', True),
    ("[@this].#(b<=anything)", '{"b":false}', True),
    ("[@this].#(b<true)", '{"b":true}', False),
    ("[@this].#(b==1)", '{"b":true}', False),
    ('[@this].#(b=="true")', '{"b":true}', True),
    ("[@this].#(b==~true)", '{"b":true}', True),
    ("[@this].#(b==~true)", '{"b":"true"}', True),
    ("[@this].#(b==~true)", '{"b":"TRUE"}', True),
    ("[@this].#(b==~true)", '{"b":"t"}', True),
    ("[@this].#(b==~true)", '{"b":"1"}', True),
    ("[@this].#(b==~true)", '{"b":2}', True),
    ("[@this].#(b==~true)", '{"b":"yes"}', False),
    ("[@this].#(b==~true)", '{"b":false}', False),
    ("[@this].#(b==~true)", '{"b":null}', False),
    ("[@this].#(b==~true)", '{"b":{}}', False),
    ("[@this].#(b==~true)", "{}", False),
    ("[@this].#(b==~false)", '{"b":false}', True),
    ("[@this].#(b==~false)", '{"b":0}', True),
    ("[@this].#(b==~false)", '{"b":"0"}', True),
    ("[@this].#(b==~false)", '{"b":"F"}', True),
    ("[@this].#(b==~false)", '{"b":null}', True),
    ("[@this].#(b==~false)", "{}", True),  # a missing value is false-ish
    ("[@this].#(b==~false)", '{"b":"no"}', False),
    ("[@this].#(b==~false)", '{"b":true}', False),
    ("[@this].#(b==~false)", '{"b":[]}', False),
    ("[@this].#(b==~null)", '{"b":null}', True),
    ("[@this].#(b==~null)", "{}", True),
    ("[@this].#(b==~null)", '{"b":0}', False),
    ("[@this].#(b==~*)", '{"b":null}', True),
    ("[@this].#(b==~*)", '{"b":false}', True),
    ("[@this].#(b==~*)", "{}", False),
    ("[@this].#(b!=~true)", '{"b":false}', True),
    ("[@this].#(b!=~true)", '{"b":true}', False),
    ("[@this].#(b==~maybe)", '{"b":true}', False),
    ('[@this].#(b=="~true")', '{"b":true}', True),  # quoted, then the `~` applies all the same
    ("a.#(==~true)#|#", '{"a":["1",0,true]}', True),
    ("a.#(==~true)", '{"a":["0",0,false]}', False),
)
def test_booleans_and_truthiness(path: str, doc: str, expected: bool) -> None:
    assert exists(path, doc) is expected
