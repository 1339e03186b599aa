"""Static values (gjson's execStatic): `!true`, `!false` and `!null` stand for themselves. gjson
also evaluates `!` before any JSON literal; this port does not, so `split_static` marks those
unsupported and compile_condition rejects them."""

from __future__ import annotations

from functools import lru_cache
from typing import Any, NamedTuple

from modelyard.graph.condition.syntax import closing_quote
from modelyard.graph.condition.values import MISSING


class Static(NamedTuple):
    value: Any
    rest: str
    supported: bool


_STATIC_NAMES = {"true": True, "false": False, "null": None}


@lru_cache(maxsize=1024)
def split_static(path: str) -> Static | None:
    """gjson's execStatic: `!true`, `!false`, `!null` here; other forms gjson evaluates are not
    supported (compile_condition rejects them; at run time they give nothing); None: not a static."""
    name = path[1:]
    if name[0] in '{["+-0123456789':
        return Static(MISSING, name[len(_parse_squash(name)) :], False)
    rest = ""
    for i in range(1, len(path)):
        if path[i] in "|.":
            rest, name = path[i:], path[1:i]
            break
    if name.lower() not in ("true", "false", "null", "nan", "inf"):
        return None
    if name in _STATIC_NAMES:
        return Static(_STATIC_NAMES[name], rest, True)
    return Static(MISSING, rest, False)


def _parse_squash(text: str) -> str:
    """gjson's parseSquash(text, 0): like squash, but the first character is always skipped."""
    i, depth, n = 1, 1, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            i = closing_quote(text, i + 1)
        elif c in "{[(":
            depth += 1
        elif c in "}])":
            depth -= 1
            if depth == 0:
                return text[: i + 1]
        i += 1
    return text
