"""Multipaths, gjson's sub-selectors: `[p1,p2]` builds an array of the sub-results that exist and
`{p1,"name":p2}` an object, named by the given name or the sub-path's last component."""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from modelyard.graph.condition.strict_json import decode_strict
from modelyard.graph.condition.syntax import closing_quote
from modelyard.graph.condition.values import go_bytes


class SubSelector(NamedTuple):
    path: str
    path_offset: int
    key: str  # the member name in a `{...}` multipath


class SubSelectors(NamedTuple):
    subs: tuple[SubSelector, ...]
    rest: str


@lru_cache(maxsize=4096)
def parse_sub_selectors(path: str) -> SubSelectors | None:
    """gjson's parseSubSelectors for `[p1,p2]` / `{p1,"name":p2}`; None when never closed."""
    subs: list[SubSelector] = []
    modifier = colon = 0
    depth = start = i = 1
    n = len(path)

    def push() -> None:
        nonlocal colon, modifier, start
        if colon == 0:
            sub_path, offset, name = path[start:i], start, ""
        else:
            sub_path, offset, name = path[colon + 1 : i], colon + 1, path[start:colon]
        subs.append(SubSelector(sub_path, offset, _member_name(name, sub_path)))
        colon = modifier = 0
        start = i + 1

    while i < n:
        c = path[i]
        if c == "\\":
            i += 1
        elif c == "@":
            if modifier == 0 and path[i - 1] in ".|":
                modifier = i
        elif c == ":":
            if modifier == 0 and colon == 0 and depth == 1:
                colon = i
        elif c == ",":
            if depth == 1:
                push()
        elif c == '"':
            i = closing_quote(path, i + 1)
        elif c in "[({":
            depth += 1
        elif c in "])}":
            depth -= 1
            if depth == 0:
                push()
                return SubSelectors(tuple(subs), path[i + 1 :])
        i += 1
    return None


def _member_name(name: str, sub_path: str) -> str:
    if name:
        if name[0] == '"':
            decoded = decode_strict(go_bytes(name))
            if isinstance(decoded, str):
                return decoded
        return name
    last = _name_of_last(sub_path)
    if any(c < " " or c in "[]{}()#|!" for c in last):
        return "_"
    return last


def _name_of_last(path: str) -> str:
    for i in range(len(path) - 1, -1, -1):
        if path[i] in "|." and not (i > 0 and path[i - 1] == "\\"):
            return path[i + 1 :]
    return path
