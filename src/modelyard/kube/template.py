"""Fill plain Kubernetes YAML with values: `${a.b}` placeholders, replaced in the parsed tree.

The manifests stay ordinary YAML a reader can follow (no template language around them). A string
value that is exactly one placeholder takes the value whole, whatever its type (a mapping of resources, a
number, a list); a placeholder inside a longer string, or in a key, is written in as text. A whole
placeholder value that is None removes its key or list item, which is how an optional field is
left out.
Working on the parsed tree rather than the text means indentation and quoting cannot go wrong.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from typing import Any

import yaml

_PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_.]*)\}")
_ABSENT = object()


class TemplateError(Exception):
    """A placeholder names nothing in the values: a mistake in a template, not in a user's values."""


def fill_documents(text: str, context: Mapping[str, Any], *, source: str) -> list[dict[str, Any]]:
    """Every YAML document in `text`, filled from `context`; empty documents are skipped."""
    documents = []
    for document in yaml.safe_load_all(text):
        if document is None:
            continue
        filled = _fill(document, context, source)
        if filled is not _ABSENT:
            documents.append(filled)
    return documents


def _fill(node: Any, context: Mapping[str, Any], source: str) -> Any:
    if isinstance(node, dict):
        mapping = {}
        for key, value in node.items():
            filled = _fill(value, context, source)
            if filled is _ABSENT:
                continue
            name = _fill_text(key, context, source) if isinstance(key, str) else key
            if name in mapping:
                raise TemplateError(f"{source}: two keys fill to {name!r}")
            mapping[name] = filled
        return mapping
    if isinstance(node, list):
        items = (_fill(item, context, source) for item in node)
        return [item for item in items if item is not _ABSENT]
    if isinstance(node, str) and "${" in node:
        whole = _PLACEHOLDER.fullmatch(node)
        if whole is not None:
            value = _lookup(whole.group(1), context, source)
            return _ABSENT if value is None else copy.deepcopy(value)
        return _fill_text(node, context, source)
    return node


def _fill_text(text: str, context: Mapping[str, Any], source: str) -> str:
    filled = _PLACEHOLDER.sub(lambda m: _text(m.group(1), context, source), text)
    if "${" in _PLACEHOLDER.sub("", text):  # "${ name}", "${a" : a typo, not a value
        raise TemplateError(f"{source}: {text!r} holds a placeholder that is not ${{name.path}}")
    return filled


def _text(path: str, context: Mapping[str, Any], source: str) -> str:
    value = _lookup(path, context, source)
    if value is None or isinstance(value, dict | list):
        raise TemplateError(f"{source}: ${{{path}}} is inside a string but is {value!r}")
    return str(value).lower() if isinstance(value, bool) else str(value)


def _lookup(path: str, context: Mapping[str, Any], source: str) -> Any:
    node: Any = context
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            raise TemplateError(f"{source}: ${{{path}}} names no value")
        node = node[part]
    return node
