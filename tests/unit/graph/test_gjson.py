"""gjson conditions: every expected answer is what Go's tidwall/gjson v1.18 gives for
`gjson.GetBytes(doc, path).Exists()` (read from gjson's source and SYNTAX.md, and from the
KServe router's checked behaviour in shared/compat/kserve-inferencegraph.md, section 9)."""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest

from modelyard.graph.gjson import GjsonSyntaxError, Path, compile_path, condition_exists, parse_json_strict


def exists(path: str, doc: str | bytes) -> bool:
    raw = doc.encode() if isinstance(doc, str) else doc
    valid, value = parse_json_strict(raw)
    assert valid, doc
    return compile_path(path).exists(value)


def cases(*rows: tuple[str, str, bool]) -> pytest.MarkDecorator:
    return pytest.mark.parametrize(("path", "doc", "expected"), rows, ids=[f"{p} on {d}" for p, d, _ in rows])


# --- section 9.1: every expression KServe's tests, samples and docs use ----------------------------


@cases(
    ('predictions.#(label=="dog")', '{"predictions":[{"label":"cat"},{"label":"dog"}]}', True),
    ('predictions.#(label=="dog")', '{"predictions":[{"label":"cat"}]}', False),
    ('predictions.#(label=="dog")', '{"predictions":[]}', False),
    ('predictions.#(label=="dog")', '{"predictions":{"label":"dog"}}', False),
    ('predictions.#(label=="dog")', "{}", False),
    ('predictions.#(label=="dog")', '{"predictions":[{"label":"Dog"}]}', False),
    ('instances.#(modelId=="1")', '{"instances":[{"modelId":"1"}]}', True),
    ('instances.#(modelId=="1")', '{"instances":[{"modelId":1}]}', True),
    ('instances.#(modelId=="1")', '{"instances":[{"modelId":1.0}]}', True),
    ('instances.#(modelId=="1")', '{"instances":[{"modelId":2}]}', False),
    ('instances.#(modelId=="2")', '{"instances":[{"modelId":2.0}]}', True),
    ('instances.#(modelId=="2")', '{"instances":[{"modelId":"1"},{"modelId":"2"}]}', True),
    ('instances.#(modelId=="2")', '{"instances":[{"modelId":"02"}]}', False),
    ("[@this].#(decision_picker==ERROR)", '{"decision_picker":"ERROR"}', True),
    ("[@this].#(decision_picker==ERROR)", '{"decision_picker":"SUCCESS"}', False),
    ("[@this].#(decision_picker==ERROR)", '{"decision_picker":"error"}', False),
    ("[@this].#(decision_picker==ERROR)", '{"other":"ERROR"}', False),
    ("[@this].#(decision_picker==ERROR)", '[{"decision_picker":"ERROR"}]', False),
    ("[@this].#(decision_picker==SUCCESS)", '{"decision_picker":"SUCCESS","x":1}', True),
    ("[@this].#(decision_picker==SUCCESS)", '{"decision_picker":"ERROR"}', False),
    ('[@this].#(decision_picker=="ERROR")', '{"decision_picker":"ERROR"}', True),
    ("[@this].#(source==client)", '{"source":"client"}', True),
    ("[@this].#(source==client)", '{"source":"server"}', False),
    ("instances.#(intval>10)", '{"instances":[{"intval":11}]}', True),
    ("instances.#(intval>10)", '{"instances":[{"intval":10}]}', False),
    ("instances.#(intval>10)", '{"instances":[{"intval":5},{"intval":12}]}', True),
    ("instances.#(intval>10)", '{"instances":[{"intval":"20"}]}', True),  # "20" > "10" as strings
    ("instances.#(intval>10)", '{"instances":[{"intval":"9"}]}', True),  # "9" > "10" as strings
    ("instances.#(intval>10)", '{"instances":[{"intval":"1"}]}', False),
    ("instances.#(strval%*red-server*)", '{"instances":[{"strval":"my-red-server-1"}]}', True),
    ("instances.#(strval%*red-server*)", '{"instances":[{"strval":"blue-server"}]}', False),
    ("instances.#(strval%*red-server*)", '{"instances":[{"strval":7}]}', False),
    ("{ .input.userId == 1 }", '{"input":{"userId":1}}', True),
    ("{ .input.userId == 1 }", '{"input":{"userId":2}}', True),
    ("{ .input.userId == 1 }", "[]", True),
    ("{ .input.userId == 1 }", "null", True),
    ('{ .predictions.class == "dog" }', '{"predictions":{"class":"cat"}}', True),
    ("{ .input.userId == 2 }", '"text"', True),
    ('{ .predictions.class == "cat" }', "0", True),
    ('[@this].#(predictions.0=="dog")', '{"predictions":["dog","cat"]}', True),
    ('[@this].#(predictions.0=="dog")', '{"predictions":["cat","dog"]}', False),
    ('[@this].#(predictions.0.class=="news")', '{"predictions":[{"class":"news"}]}', True),
    ('[@this].#(predictions.0.class=="news")', '{"predictions":[{"class":"sports"}]}', False),
    ('[@this].#(predictions.0.class=="sports")', '{"predictions":[{"class":"sports"}]}', True),
    ("[@this].#(instances.0.data>0.9)", '{"instances":[{"data":0.95}]}', True),
    ("[@this].#(instances.0.data>0.9)", '{"instances":[{"data":0.9}]}', False),
    ("[@this].#(instances.0.data<=0.5)", '{"instances":[{"data":0.5}]}', True),
    ("[@this].#(instances.0.data<=0.5)", '{"instances":[{"data":0.6}]}', False),
    # no `&&` in gjson: the literal is "0.5 && instances.0.data<=0.9", which reads as 0: data > 0
    ("[@this].#(instances.0.data>0.5 && instances.0.data<=0.9)", '{"instances":[{"data":0.7}]}', True),
    ("[@this].#(instances.0.data>0.5 && instances.0.data<=0.9)", '{"instances":[{"data":0.1}]}', True),
    ("[@this].#(instances.0.data>0.5 && instances.0.data<=0.9)", '{"instances":[{"data":0.95}]}', True),
    ("[@this].#(instances.0.data>0.5 && instances.0.data<=0.9)", '{"instances":[{"data":0}]}', False),
    ("[@this].#(instances.0.data>0.5 && instances.0.data<=0.9)", '{"instances":[{"data":-1}]}', False),
    ("[@this].#(confidence>0.45)", '{"confidence":0.5}', True),
    ("[@this].#(confidence>0.45)", '{"confidence":0.4}', False),
)
def test_kserve_expressions(path: str, doc: str, expected: bool) -> None:
    assert exists(path, doc) is expected


KSERVE_EXPRESSIONS = [
    'predictions.#(label=="dog")',
    'instances.#(modelId=="1")',
    'instances.#(modelId=="2")',
    "[@this].#(decision_picker==ERROR)",
    "[@this].#(decision_picker==SUCCESS)",
    "[@this].#(source==client)",
    "instances.#(intval>10)",
    "instances.#(strval%*red-server*)",
    "{ .input.userId == 1 }",
    "{ .input.userId == 2 }",
    '{ .predictions.class == "dog" }',
    '{ .predictions.class == "cat" }',
    '[@this].#(predictions.0=="dog")',
    '[@this].#(predictions.0.class=="news")',
    '[@this].#(predictions.0.class=="sports")',
    "[@this].#(instances.0.data>0.9)",
    "[@this].#(instances.0.data<=0.5)",
    "[@this].#(instances.0.data>0.5 && instances.0.data<=0.9)",
    "[@this].#(confidence>0.45)",
]


@pytest.mark.parametrize("path", KSERVE_EXPRESSIONS)
def test_kserve_expressions_compile(path: str) -> None:
    assert compile_path(path).source == path


# --- section 9.3 extras: where gjson-py and Go differ, Go's answer ----------------------------------


@cases(
    ("@this", '{"a":1}', True),
    ("key1.name", '{"key1":{"name":"x"}}', True),
    ("key1.name", '{"key1":{"nom":"x"}}', False),
    ("instances.#", '{"instances":[]}', True),
    ("instances.0", '{"instances":[{"a":1}]}', True),
    ("instances.0", '{"instances":[]}', False),
    ('instances.#(strval%"*red.server*")', '{"instances":[{"strval":"a-red.server-b"}]}', True),
    ('instances.#(strval%"*red.server*")', '{"instances":[{"strval":"a-red-server-b"}]}', False),
    ('instances.#(s%"a+b")', '{"instances":[{"s":"a+b"}]}', True),
    ('instances.#(s%"a+b")', '{"instances":[{"s":"aab"}]}', False),
    ("instances.#(flag==true)", '{"instances":[{"flag":"true"}]}', True),
    ("instances.#(modelId==1)", '{"instances":[{"modelId":"1"}]}', True),
    ("instances.#(flag==~true)", '{"instances":[{"flag":true}]}', True),
)
def test_gjson_py_differences(path: str, doc: str, expected: bool) -> None:
    assert exists(path, doc) is expected


# --- existence and the empty path -------------------------------------------------------------------


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


@pytest.mark.parametrize("doc", [{}, {"": 1}, [], [1], None, "", 0])
def test_empty_path_never_exists(doc: Any) -> None:
    assert compile_path("").exists(doc) is False
    assert Path("").exists(doc) is False


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


# --- queries ------------------------------------------------------------------------------------------


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


# --- glob (tidwall/match) ---------------------------------------------------------------------------


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


# --- multipaths, modifiers, statics, pipes on missing values ---------------------------------------


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
    ("x.@this", "{}", False),
    ("a.b.[c]", "{}", False),  # the pipe is only set once `a` is found
    ("[@this,a].1", '{"a":2}', True),
    ("[@this].0.a", '{"a":2}', True),
    ("[@this]|0.a", '{"a":2}', True),
    ("[[a]].0.0", '{"a":2}', True),
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
    ("!true", "{}", True),
    ("!false", "{}", True),
    ("!null", "{}", True),
    ("!true.x", "{}", False),
    ("[!true,!null].1", "{}", True),
    ("!foo", '{"!foo":1}', True),  # not a static value: an ordinary key
)
def test_multipaths_modifiers_statics(path: str, doc: str, expected: bool) -> None:
    assert exists(path, doc) is expected


# --- the validator ---------------------------------------------------------------------------------


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
    assert compile_path("0.0.0").exists(value)


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


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b'{"a":1}', True),
        (b"{}", False),
        (b"[]", False),
        (b"", None),
        (b"NaN", None),
        (b'{"a":1} {"a":1}', None),
        (b'  {"a":null}  ', True),
        (b'{"a":"\\ud800"}', True),
    ],
)
def test_condition_exists(data: bytes, expected: bool | None) -> None:
    assert condition_exists(compile_path("a"), data) is expected


def test_condition_on_a_scalar_document() -> None:
    assert condition_exists(compile_path("[@this].#(==5)"), b" 5 ") is True
    assert condition_exists(compile_path("{ .input.userId == 1 }"), b'"x"') is True


# --- compile_path: what is a syntax error -----------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "offset"),
    [
        ("#(((", 0),
        ("#(a==1", 0),
        ("#[a==1", 0),
        ("a.#(b==1", 2),
        ("[@this].#(decision_picker==ERROR", 8),
        ('#(a=="x)', 0),
        ("x.#(a.#(b==1)", 2),
        ("#([a==1)", 0),
        ("a|#(", 2),
        ("a\\", 1),
        ("a.b\\", 3),
        ("\\", 0),
        ("[@this", 0),
        ("{a,b", 0),
        ("[", 0),
        ("{", 0),
        ("a.[b", 2),
        ("a|{b", 2),
        ("[a,[b]", 0),
        ("[a,#(b==1]", 0),
        ("[a,b.#(c==1]", 0),
        ("[x,a.[b]", 0),
        ("{a:[b}", 0),
        ("[a].#(b", 4),
        ("[a,b\\]", 0),
        ("#(a.[b)", 0),
        ("!1", 0),
        ('!{"a":1}', 0),
        ("![1]", 0),
        ("!TRUE", 0),
        ("!nan", 0),
        ("a|!inf", 2),
    ],
)
def test_syntax_errors(path: str, offset: int) -> None:
    with pytest.raises(GjsonSyntaxError) as caught:
        compile_path(path)
    assert caught.value.offset == offset
    assert f"offset {offset}" in str(caught.value)
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize(
    "path",
    [
        "a[b",  # `[` inside a key is just a character
        "a#(b",  # so is `#(` that does not start a component
        "a\\#(b",
        "a\\\\",  # an escaped backslash
        "\\.",
        "#(a==1)xyz",  # gjson ignores what follows the query in the component
        "[a]b",  # gjson reads this as `b`
        "@foo",
        "!foo",
        "a..b",
        "..a",
        "#[a==1]",
        '#(a=="x)y")',
        "#(a==x\\))",
        "#(b==1]",  # gjson closes on either bracket
        "{ .input.userId == 1 }",
        '{ .predictions.class == "dog" }',
        '{"a":b,c}',
        "[@this].#(a==1).b|c",
        "a.#(b.#(c==1))#.d",
        "@reverse:x",
        "",
    ],
)
def test_odd_but_valid_paths_compile(path: str) -> None:
    assert compile_path(path) == Path(path)


def test_path_is_frozen() -> None:
    path = compile_path("a")
    with pytest.raises(AttributeError):
        path.source = "b"  # type: ignore[misc]
