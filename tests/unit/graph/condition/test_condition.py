"""The package's surface on KServe's own conditions (compat spec section 9): every expected answer
is what Go's tidwall/gjson v1.18 gives for `gjson.GetBytes(doc, path).Exists()`."""

from __future__ import annotations

from typing import Any

import pytest
from condition_support import cases, exists

from modelyard.graph.condition import Condition, compile_condition, condition_exists

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
    assert compile_condition(path).source == path


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


# --- existence on bytes: gjson's validator first, then the path -----------------------------------


@pytest.mark.parametrize("doc", [{}, {"": 1}, [], [1], None, "", 0])
def test_empty_path_never_exists(doc: Any) -> None:
    assert compile_condition("").exists(doc) is False
    assert Condition("").exists(doc) is False


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
    assert condition_exists(compile_condition("a"), data) is expected


def test_condition_on_a_scalar_document() -> None:
    assert condition_exists(compile_condition("[@this].#(==5)"), b" 5 ") is True
    assert condition_exists(compile_condition("{ .input.userId == 1 }"), b'"x"') is True


def test_condition_is_frozen() -> None:
    path = compile_condition("a")
    with pytest.raises(AttributeError):
        path.source = "b"  # type: ignore[misc]
