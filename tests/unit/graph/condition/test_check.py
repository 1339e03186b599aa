"""compile_condition: what is a syntax error (with its offset) and what odd paths gjson accepts."""

from __future__ import annotations

import pytest

from modelyard.graph.condition import Condition, ConditionSyntaxError, compile_condition


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
    with pytest.raises(ConditionSyntaxError) as caught:
        compile_condition(path)
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
    assert compile_condition(path) == Condition(path)
