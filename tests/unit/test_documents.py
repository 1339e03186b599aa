"""Bounded YAML/JSON documents: nesting and aliases refused before anything recurses over them."""

from __future__ import annotations

import pytest

from modelyard.documents import MAX_DEPTH, DocumentError, parse_document, parse_documents


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize(
    "text",
    [
        "[" * 20_000,  # unclosed: not JSON, so YAML reads it (and would recurse)
        nested(MAX_DEPTH + 1),  # valid JSON, too deep
        "- " * (MAX_DEPTH + 1) + "x",  # YAML block sequences nested on one line
        "a:\n" + "".join("  " * i + f"k{i}:\n" for i in range(1, MAX_DEPTH + 2)),
    ],
)
def test_nesting_beyond_the_limit_is_refused(text: str) -> None:
    with pytest.raises(DocumentError, match=f"nested deeper than {MAX_DEPTH} levels"):
        parse_document(text)


def test_nesting_within_the_limit_is_read() -> None:
    assert parse_document(nested(MAX_DEPTH - 1)) is not None
    assert parse_document(b'{"routes": [{"name": "r"}]}') == {"routes": [{"name": "r"}]}
    assert parse_document("routes:\n- name: r\n") == {"routes": [{"name": "r"}]}


def test_aliases_are_refused_from_the_network_and_allowed_in_files() -> None:
    bomb = "a: &a [x, x]\nb: &b [*a, *a]\nc: [*b, *b]\n"
    with pytest.raises(DocumentError, match="aliases"):
        parse_document(bomb)
    assert parse_document(bomb, untrusted=False)["c"][0][0] == ["x", "x"]


def test_errors_say_where() -> None:
    with pytest.raises(DocumentError) as info:
        parse_document("a: [1, 2\nb: 3\n")
    assert info.value.where.startswith("line ") and "invalid YAML" in info.value.problem


def test_streams_and_empty_documents() -> None:
    assert parse_documents("---\na: 1\n---\n---\nb: 2\n") == [{"a": 1}, {"b": 2}]
    assert parse_document("") is None
    with pytest.raises(DocumentError, match="one document"):
        parse_document("a: 1\n---\nb: 2\n")


@pytest.mark.parametrize("text", [b"\x00", "a: \x07\n"])
def test_characters_yaml_refuses_are_a_document_error(text: str | bytes) -> None:
    with pytest.raises(DocumentError, match="invalid YAML"):
        parse_document(text)
