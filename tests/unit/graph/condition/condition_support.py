"""Helpers for the condition tests. Every expected answer in them is what Go's tidwall/gjson v1.18
gives for `gjson.GetBytes(doc, path).Exists()` (read from gjson's source and SYNTAX.md, and from the
KServe router's checked behaviour in shared/compat/kserve-inferencegraph.md, section 9)."""

from __future__ import annotations

import pytest

from modelyard.graph.condition import compile_condition, parse_json_strict


def exists(path: str, doc: str | bytes) -> bool:
    raw = doc.encode() if isinstance(doc, str) else doc
    valid, value = parse_json_strict(raw)
    assert valid, doc
    return compile_condition(path).exists(value)


def cases(*rows: tuple[str, str, bool]) -> pytest.MarkDecorator:
    return pytest.mark.parametrize(("path", "doc", "expected"), rows, ids=[f"{p} on {d}" for p, d, _ in rows])
