"""The manifests' placeholders: whole values keep their type, None leaves a field out."""

from __future__ import annotations

import pytest

from modelyard.kube.template import TemplateError, fill_documents

CONTEXT = {
    "name": "gw",
    "port": 8000,
    "on": True,
    "resources": {"limits": {"cpu": "2"}},
    "absent": None,
    "key": "token",
}


def test_a_whole_placeholder_takes_the_value_with_its_type():
    (doc,) = fill_documents("a: ${port}\nb: ${resources}\nc: '${on}'\n", CONTEXT, source="t.yaml")
    assert doc == {"a": 8000, "b": {"limits": {"cpu": "2"}}, "c": True}


def test_a_placeholder_inside_text_is_written_as_text():
    (doc,) = fill_documents("url: http://${name}:${port}/x\nflag: on=${on}\n", CONTEXT, source="t.yaml")
    assert doc == {"url": "http://gw:8000/x", "flag": "on=true"}


def test_none_removes_the_key_or_the_list_item():
    text = "keep: 1\ndrop: ${absent}\nports:\n  - 80\n  - ${absent}\n  - ${port}\n"
    (doc,) = fill_documents(text, CONTEXT, source="t.yaml")
    assert doc == {"keep": 1, "ports": [80, 8000]}


def test_keys_and_several_documents():
    docs = fill_documents("---\n${key}: x\n---\n---\nn: ${name}\n", CONTEXT, source="t.yaml")
    assert docs == [{"token": "x"}, {"n": "gw"}]


def test_filled_values_are_copies():
    first, second = fill_documents("r: ${resources}\n---\nr: ${resources}\n", CONTEXT, source="t.yaml")
    first["r"]["limits"]["cpu"] = "9"
    assert second["r"]["limits"]["cpu"] == "2" and CONTEXT["resources"] == {"limits": {"cpu": "2"}}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a: ${nope}\n", "t.yaml: ${nope} names no value"),
        ("a: ${name.deeper}\n", "t.yaml: ${name.deeper} names no value"),
        ("a: x-${resources}\n", "t.yaml: ${resources} is inside a string"),
        ("a: x-${absent}\n", "t.yaml: ${absent} is inside a string but is None"),
        ("a: x-${name }\n", "t.yaml: 'x-${name }' holds a placeholder that is not ${name.path}"),
        ("${key}: 1\ntoken: 2\n", "t.yaml: two keys fill to 'token'"),
    ],
)
def test_a_template_mistake_names_the_template_and_placeholder(text, message):
    with pytest.raises(TemplateError, match="^" + message.replace("$", r"\$").replace("{", r"\{")):
        fill_documents(text, CONTEXT, source="t.yaml")
