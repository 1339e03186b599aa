"""Reading YAML and JSON documents (config files, admin request bodies, graph manifests), bounded.

A document nested deeper than `MAX_DEPTH` is refused before anything recurses over it: PyYAML
composes recursively, so a 20 KB body of `[` would otherwise end in a RecursionError after
blocking the event loop for seconds. Bodies from the network may not use YAML aliases either:
an alias shares a node, and a few lines of them expand into billions of elements for anything
that walks the result (validation, serialisation). JSON takes the fast path (orjson, in C).
"""

from __future__ import annotations

from typing import Any

import orjson
import yaml
from yaml.nodes import Node

MAX_DEPTH = 64  # far beyond any config, route or graph spec; far below Python's recursion limit


class DocumentError(ValueError):
    """A document that cannot be read; `where` is "line L, column C: " when known."""

    def __init__(self, problem: str, where: str = "") -> None:
        super().__init__(where + problem)
        self.problem = problem
        self.where = where


class _BoundedLoader(yaml.SafeLoader):
    max_depth = MAX_DEPTH
    allow_aliases = True

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Node | None, index: int) -> Node | None:
        if not self.allow_aliases and self.check_event(yaml.AliasEvent):
            raise DocumentError("YAML aliases (*name) are not accepted here", self._where())
        self._depth += 1
        try:
            if self._depth > self.max_depth:
                raise DocumentError(f"nested deeper than {self.max_depth} levels", self._where())
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def _where(self) -> str:
        mark = getattr(self.peek_event(), "start_mark", None)  # type: ignore[no-untyped-call]
        return f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""


class _UntrustedLoader(_BoundedLoader):
    allow_aliases = False


def parse_document(text: str | bytes, *, untrusted: bool = True) -> Any:
    """One YAML or JSON document (None when empty). `untrusted`: from the network (no aliases)."""
    documents = parse_documents(text, untrusted=untrusted)
    if len(documents) > 1:
        raise DocumentError(f"expected one document, found {len(documents)}")
    return documents[0] if documents else None


def parse_documents(text: str | bytes, *, untrusted: bool = True) -> list[Any]:
    """Every document of a YAML stream (`---` separated) or one JSON value; empty ones dropped."""
    data = _json(text)
    if data is not _NOT_JSON:
        return [] if data is None else [data]
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    try:
        # The reader checks the characters as it is made: inside the try.
        loader = (_UntrustedLoader if untrusted else _BoundedLoader)(text)
    except yaml.YAMLError as exc:
        raise DocumentError(f"invalid YAML: {exc}") from None
    try:
        documents = []
        while loader.check_node():
            node = loader.get_node()
            if node is not None:
                documents.append(loader.construct_document(node))
        return [d for d in documents if d is not None]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise DocumentError(f"invalid YAML: {getattr(exc, 'problem', None) or exc}", where) from None
    finally:
        loader.dispose()


_NOT_JSON = object()


def _json(text: str | bytes) -> Any:
    """The JSON value of `text`, or _NOT_JSON (YAML then reads it, and reports what is wrong)."""
    start = text.lstrip()[:1]
    if start not in ("{", "[", b"{", b"["):
        return _NOT_JSON
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return _NOT_JSON
    _check_depth(value)
    return value


def _check_depth(value: Any) -> None:
    """Iterative, so that checking cannot recurse either."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise DocumentError(f"nested deeper than {MAX_DEPTH} levels")
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
