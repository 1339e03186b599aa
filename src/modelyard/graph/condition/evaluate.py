"""gjson.Get on the value orjson parsed: a path walked through objects and arrays, with queries,
multipaths, modifiers, statics and pipes. `Condition.exists` is the one question KServe asks."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from modelyard.graph.condition.glob import match_limit
from modelyard.graph.condition.go_strconv import parse_uint
from modelyard.graph.condition.modifiers import apply_modifier, split_modifier
from modelyard.graph.condition.multipath import SubSelector, parse_sub_selectors
from modelyard.graph.condition.query import query_matches
from modelyard.graph.condition.statics import split_static
from modelyard.graph.condition.strict_json import parse_json_strict
from modelyard.graph.condition.syntax import (
    ArrayPath,
    parse_array_path,
    parse_object_path,
    split_possible_pipe,
)
from modelyard.graph.condition.values import MISSING


@dataclass(frozen=True, slots=True)
class Condition:
    """A compiled condition (build it with compile_condition); `exists` answers
    `gjson.Get(document, source).Exists()`."""

    source: str

    def exists(self, document: Any) -> bool:
        """`document` is a parsed JSON value (dict, list, str, int, float, bool or None)."""
        if not self.source:
            return False
        try:
            return get(document, self.source) is not MISSING
        except RecursionError:  # only for absurdly deep documents or paths
            return False


def condition_exists(condition: Condition, data: bytes) -> bool | None:
    """None when `data` is not valid JSON by gjson's validator, else whether `condition` exists in it."""
    valid, document = parse_json_strict(data)
    if not valid:
        return None
    return condition.exists(document)


class _Ctx:
    """gjson's parseContext: the value found and the pipe to apply to it at the end of Get."""

    __slots__ = ("pipe", "piped", "value")

    def __init__(self) -> None:
        self.value: Any = MISSING
        self.pipe = ""
        self.piped = False


_NOT_PLAIN = frozenset(".|*?\\#@![{")


@lru_cache(maxsize=4096)
def _is_plain_key(path: str) -> bool:
    """A lone key or index: no character that gjson's Get, parseObjectPath or parseArrayPath reads."""
    return not any(c in _NOT_PLAIN for c in path)


def get(value: Any, path: str) -> Any:
    if _is_plain_key(path):  # the common case, answered without the general machinery
        if isinstance(value, dict):
            return value.get(path, MISSING)
        if isinstance(value, list):
            index = parse_uint(path)
            return value[index] if 0 <= index < len(value) else MISSING
        return MISSING
    if len(path) > 1:
        head = path[0]
        if head == "@":
            mod = split_modifier(path)
            if mod is not None:
                out = apply_modifier(mod.name, value, mod.args, get)
                if mod.rest and mod.rest[0] in "|.":
                    return get(out, mod.rest[1:])
                return out
        elif head == "!":
            static = split_static(path)
            if static is not None:
                if static.rest and static.rest[0] in "|.":
                    return get(static.value, static.rest[1:])
                return static.value
        if head in "[{":
            sel = parse_sub_selectors(path)
            if sel is None:
                path = ""  # gjson goes on with the (empty) remainder
            elif not sel.rest or sel.rest[0] in "|.":
                built = _build_multipath(value, head, sel.subs)
                if sel.rest:
                    return get(built, sel.rest[1:])
                return built
            else:
                path = sel.rest
    ctx = _Ctx()
    if len(path) >= 2 and path[0] == "." and path[1] == ".":
        _parse_array(ctx, [] if value is MISSING else [value], path[2:])
    elif isinstance(value, dict):
        _parse_object(ctx, value, path)
    elif isinstance(value, list):
        _parse_array(ctx, value, path)
    if ctx.piped:
        return get(ctx.value, ctx.pipe)
    return ctx.value


def _build_multipath(value: Any, kind: str, subs: tuple[SubSelector, ...]) -> Any:
    if kind == "[":
        items = []
        for sub in subs:
            found = get(value, sub.path)
            if found is not MISSING:
                items.append(found)
        return items
    obj: dict[str, Any] = {}
    for sub in subs:
        found = get(value, sub.path)
        if found is not MISSING and sub.key not in obj:
            obj[sub.key] = found
    return obj


def _parse_object(ctx: _Ctx, obj: dict[str, Any], path: str) -> bool:
    rp = parse_object_path(path)
    if not rp.more and rp.piped:
        ctx.pipe, ctx.piped = rp.pipe, True
    if rp.wild:
        candidates = [v for k, v in obj.items() if match_limit(k, rp.part)]
    elif rp.part in obj:
        candidates = [obj[rp.part]]
    else:
        return False
    for child in candidates:
        if not rp.more:
            ctx.value = child
            return True
        if isinstance(child, dict):
            if _parse_object(ctx, child, rp.path):
                return True
        elif isinstance(child, list) and _parse_array(ctx, child, rp.path):
            return True
    return False


def _parse_array(ctx: _Ctx, arr: list[Any], path: str) -> bool:
    rp = parse_array_path(path)
    if not rp.more and rp.piped:
        ctx.pipe, ctx.piped = rp.pipe, True
    if rp.q_on:
        return _query_array(ctx, arr, rp)
    if rp.arrch:
        if rp.part != "#":
            return False
        if rp.alogok:
            key = rp.alogkey
            split = split_possible_pipe(key)
            if split is not None:
                key, ctx.pipe, ctx.piped = split[0], split[1], True
            mapped = []
            for elem in arr:
                found = get(elem, key)
                if found is not MISSING:
                    mapped.append(found)
            ctx.value = mapped
            return True
        ctx.value = len(arr)
        return True
    index = parse_uint(rp.part)
    if index < 0 or index >= len(arr):
        return False
    elem = arr[index]
    if not rp.more:
        ctx.value = elem
        return True
    if isinstance(elem, dict):
        return _parse_object(ctx, elem, rp.path)
    if isinstance(elem, list):
        return _parse_array(ctx, elem, rp.path)
    return False


def _query_array(ctx: _Ctx, arr: list[Any], rp: ArrayPath) -> bool:
    matches: list[Any] = []
    for elem in arr:
        if isinstance(elem, dict | list):
            res = get(elem, rp.q_path)
        elif rp.q_path:
            continue
        else:
            res = elem
        if not query_matches(rp.q_op, rp.q_value, res):
            continue
        if rp.more:
            rest = rp.path
            split = split_possible_pipe(rest)
            if split is not None:
                rest, ctx.pipe, ctx.piped = split[0], split[1], True
            res = get(elem, rest)
        else:
            res = elem
        if not rp.q_all:
            ctx.value = res  # the first match decides, even when its continuation is missing
            return True
        if res is not MISSING:
            matches.append(res)
    if rp.q_all and ctx.value is MISSING:
        ctx.value = matches
    return False
