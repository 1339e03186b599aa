"""Whether an array element matches a query `#(KEY OP VALUE)`, by gjson's queryMatches: the JSON
type of the element's value picks the comparison, and the `~` forms first turn it into a boolean."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

from modelyard.graph.condition.glob import match_limit
from modelyard.graph.condition.go_strconv import parse_bool, parse_float
from modelyard.graph.condition.values import MISSING, go_bytes, is_number, to_float


def _trueish(value: Any) -> bool:
    if value is True:
        return True
    if isinstance(value, str):
        return parse_bool(value) is True
    if is_number(value):
        return to_float(value) != 0
    return False


def _falseish(value: Any) -> bool:
    if value is None or value is MISSING or value is False:
        return True
    if isinstance(value, str):
        return parse_bool(value) is False
    if is_number(value):
        return to_float(value) == 0
    return False


def query_matches(op: str, literal: str, value: Any) -> bool:
    """`value` is what the query's KEY found in the element (MISSING when nothing); `op` is "" for
    a query that only tests existence, and `literal` is already unquoted."""
    if literal.startswith("~"):
        kind = literal[1:]
        if kind == "*":
            ish = value is not MISSING
        elif kind == "null":
            ish = value is None or value is MISSING
        elif kind == "true":
            ish = _trueish(value)
        elif kind == "false":
            ish = _falseish(value)
        else:
            return False
        value, literal = ish, "true"
    if value is MISSING:
        return False
    if not op:
        return True
    if value is True:
        return (
            (op == "=" and literal == "true")
            or (op == "!=" and literal != "true")
            or (op == ">" and literal == "false")
            or op == ">="
        )
    if value is False:
        return (
            (op == "=" and literal == "false")
            or (op == "!=" and literal != "false")
            or (op == "<" and literal == "true")
            or op == "<="
        )
    if isinstance(value, str):
        return _compare_strings(op, value, literal)
    if is_number(value):
        return _compare_numbers(op, to_float(value), parse_float(literal))
    return False


# Comparison operators, as gjson's queryMatches applies them to strings (byte-wise) and numbers.
_COMPARE: dict[str, Callable[[Any, Any], bool]] = {
    "=": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
}


def _compare_strings(op: str, value: str, literal: str) -> bool:
    if op == "%":
        return match_limit(value, literal)
    if op == "!%":
        return not match_limit(value, literal)
    if op in ("=", "!="):
        return _COMPARE[op](value, literal)
    compare = _COMPARE.get(op)
    return compare is not None and compare(go_bytes(value), go_bytes(literal))


def _compare_numbers(op: str, value: float, literal: float) -> bool:
    compare = _COMPARE.get(op)
    return compare is not None and compare(value, literal)
