"""The `@modifiers`: where `@name[:args]` ends (gjson's execModifier) and what each does to a
parsed value. gjson re-parses the text a modifier returns; here the value is handed on as it is."""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import lru_cache
from typing import Any, NamedTuple

import orjson

from modelyard.graph.condition.strict_json import decode_strict, parse_json_strict
from modelyard.graph.condition.syntax import MODIFIER_NAMES, squash
from modelyard.graph.condition.values import MISSING, go_bytes, is_number, to_float

# gjson.Get, handed in by the evaluator that calls the modifiers (only @dig needs it).
Lookup = Callable[[Any, str], Any]


class Modifier(NamedTuple):
    name: str
    args: str
    args_offset: int
    rest: str


@lru_cache(maxsize=4096)
def split_modifier(path: str) -> Modifier | None:
    """gjson's execModifier without the call: None when `@name` is not a modifier (then a key)."""
    name, rest, has_args = path[1:], "", False
    for i in range(1, len(path)):
        c = path[i]
        if c == ":":
            rest, name = path[i + 1 :], path[1:i]
            has_args = len(rest) > 0
            break
        if c in "|.":
            rest, name = path[i:], path[1:i]
            break
    if name not in MODIFIER_NAMES:
        return None
    args = ""
    args_offset = len(path) - len(rest)
    if has_args:
        if rest[0] in '{["':
            args = squash(rest)
        else:
            i = 0
            while i < len(rest) and rest[i] != "|":
                if rest[i] in '{["(':
                    i += len(squash(rest[i:])) - 1
                i += 1
            args = rest[:i]
        rest = rest[len(args) :]
    return Modifier(name, args, args_offset, rest)


def _option(args: str, name: str) -> bool:
    """A boolean option from a modifier's JSON argument, as gjson's Result.Bool reads it."""
    parsed = decode_strict(go_bytes(args)) if args else MISSING
    if not isinstance(parsed, dict):
        return False
    value = parsed.get(name)
    if value is True:
        return True
    if isinstance(value, str):
        return value.lower() in ("1", "t", "true")
    return is_number(value) and to_float(value) != 0


def _mod_this(value: Any, args: str) -> Any:
    return value


def _mod_reverse(value: Any, args: str) -> Any:
    if isinstance(value, list):
        return value[::-1]
    if isinstance(value, dict):
        return dict(reversed(value.items()))
    return value


def _mod_flatten(value: Any, args: str) -> Any:
    if not isinstance(value, list):
        return value
    deep = _option(args, "deep")

    def flat(items: list[Any]) -> list[Any]:
        out: list[Any] = []
        for item in items:
            if isinstance(item, list):
                out.extend(flat(item) if deep else item)
            else:
                out.append(item)
        return out

    return flat(value)


def _mod_join(value: Any, args: str) -> Any:
    if not isinstance(value, list):
        return value
    preserve = _option(args, "preserve")
    out: dict[str, Any] = {}
    for item in value:
        if isinstance(item, dict):
            for key, member in item.items():
                if preserve:
                    out.setdefault(key, member)  # duplicates kept in gjson; the first one is found
                else:
                    out[key] = member
    return out


def _mod_keys(value: Any, args: str) -> Any:
    if value is MISSING:
        return []
    if isinstance(value, dict):
        return list(value)
    if isinstance(value, list):
        return [None] * len(value)
    return [None]


def _mod_values(value: Any, args: str) -> Any:
    if value is MISSING:
        return []
    if isinstance(value, dict):
        return list(value.values())
    if isinstance(value, list):
        return value
    return [value]


def _dumps(value: Any) -> str:
    try:
        return orjson.dumps(value).decode()
    except (TypeError, orjson.JSONEncodeError):
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _mod_tostr(value: Any, args: str) -> Any:
    return "" if value is MISSING else _dumps(value)


def _mod_fromstr(value: Any, args: str) -> Any:
    if value is MISSING or value is None:
        return MISSING
    if isinstance(value, str):
        valid, parsed = parse_json_strict(go_bytes(value))
        return parsed if valid else MISSING
    return value


def _mod_group(value: Any, args: str) -> Any:
    if not isinstance(value, dict):
        return MISSING
    rows: list[dict[str, Any]] = []
    for key, column in value.items():
        if isinstance(column, list):
            for index, item in enumerate(column):
                if index == len(rows):
                    rows.append({})
                rows[index].setdefault(key, item)
    return rows


def _mod_dig(value: Any, args: str, get: Lookup) -> Any:
    found: list[Any] = []

    def descend(node: Any) -> None:
        hit = get(node, args)
        if hit is not MISSING:
            found.append(hit)
        if isinstance(node, dict):
            for child in node.values():
                descend(child)
        elif isinstance(node, list):
            for child in node:
                descend(child)

    descend(value)
    return found


_MODIFIERS: dict[str, Callable[[Any, str], Any]] = {
    "this": _mod_this,
    "reverse": _mod_reverse,
    "pretty": _mod_this,
    "ugly": _mod_this,
    "valid": _mod_this,
    "flatten": _mod_flatten,
    "join": _mod_join,
    "keys": _mod_keys,
    "values": _mod_values,
    "tostr": _mod_tostr,
    "fromstr": _mod_fromstr,
    "group": _mod_group,
}
assert {*_MODIFIERS, "dig"} == MODIFIER_NAMES


def apply_modifier(name: str, value: Any, args: str, get: Lookup) -> Any:
    """The result of `@name:args` on `value` (MISSING for none); `name` is one of MODIFIER_NAMES."""
    if name == "dig":
        return _mod_dig(value, args, get)
    return _MODIFIERS[name](value, args)
