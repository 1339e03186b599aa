"""How gjson splits a path (ported from gjson's parseObjectPath, parseArrayPath, parseQuery and
splitPossiblePipe): a component runs to the next `.` or `|`; `#(...)` and `#[...]` hold a query;
a `.` before a modifier, `[` or `{` works like a pipe. Results are cached per path string, so a
condition is split once however many requests test it."""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from modelyard.graph.condition.go_strconv import unescape

# Splitting needs the names (an unknown `@name` is an ordinary key); modifiers.py says what each does.
MODIFIER_NAMES = frozenset(
    {"pretty", "ugly", "reverse", "this", "flatten", "join", "valid", "keys", "values", "tostr", "fromstr"}
    | {"group", "dig"}
)


def is_dot_piper_char(s: str) -> bool:
    """After a `.`: does a modifier, `[` or `{` start here (the rest then works like a pipe)?"""
    c = s[0]
    if c == "@":
        i = 1
        while i < len(s) and s[i] not in ".|:":
            i += 1
        return s[1:i] in MODIFIER_NAMES
    return c in "[{"


class ObjectPath(NamedTuple):
    part: str
    path: str
    pipe: str
    piped: bool
    wild: bool
    more: bool


@lru_cache(maxsize=4096)
def parse_object_path(path: str) -> ObjectPath:
    n = len(path)
    wild = False
    i = 0
    while i < n:
        c = path[i]
        if c == "|":
            return ObjectPath(path[:i], "", path[i + 1 :], True, wild, False)
        if c == ".":
            if i < n - 1 and is_dot_piper_char(path[i + 1 :]):
                return ObjectPath(path[:i], "", path[i + 1 :], True, wild, False)
            return ObjectPath(path[:i], path[i + 1 :], "", False, wild, True)
        if c in "*?":
            wild = True
        elif c == "\\":
            # escape mode: drop each backslash, keep the character after it literally
            epart = [path[:i]]
            i += 1
            if i < n:
                epart.append(path[i])
                i += 1
                while i < n:
                    c = path[i]
                    if c == "\\":
                        i += 1
                        if i < n:
                            epart.append(path[i])
                    elif c == ".":
                        part = "".join(epart)
                        if i < n - 1 and is_dot_piper_char(path[i + 1 :]):
                            return ObjectPath(part, "", path[i + 1 :], True, wild, False)
                        return ObjectPath(part, path[i + 1 :], "", False, wild, True)
                    elif c == "|":
                        return ObjectPath("".join(epart), "", path[i + 1 :], True, wild, False)
                    else:
                        if c in "*?":
                            wild = True
                        epart.append(c)
                    i += 1
            return ObjectPath("".join(epart), "", "", False, wild, False)
        i += 1
    return ObjectPath(path, "", "", False, wild, False)


class ArrayPath(NamedTuple):
    part: str
    path: str
    pipe: str
    piped: bool
    more: bool
    arrch: bool
    alogok: bool
    alogkey: str
    q_on: bool
    q_all: bool
    q_path: str
    q_op: str
    q_value: str


@lru_cache(maxsize=4096)
def parse_array_path(path: str) -> ArrayPath:
    n = len(path)
    arrch = alogok = q_on = q_all = False
    alogkey = q_path = q_op = q_value = ""

    def split(part: str, rest: str, pipe: str, piped: bool, more: bool) -> ArrayPath:
        # The query state read here is what the scan has gathered so far (closures bind late).
        return ArrayPath(
            part, rest, pipe, piped, more, arrch, alogok, alogkey, q_on, q_all, q_path, q_op, q_value
        )

    i = 0
    while i < n:
        c = path[i]
        if c == "|":
            return split(path[:i], "", path[i + 1 :], True, False)
        if c == ".":
            if not arrch and i < n - 1 and is_dot_piper_char(path[i + 1 :]):
                return split(path[:i], "", path[i + 1 :], True, False)
            return split(path[:i], path[i + 1 :], "", False, True)
        if c == "#":
            arrch = True
            if i == 0 and n > 1:
                if path[1] == ".":
                    alogok, alogkey = True, path[2:]
                elif path[1] in "[(":
                    q_on = True
                    query = parse_query(path)
                    if query is None:
                        break  # a bad query: the whole path is the part
                    value = query.value
                    if len(value) >= 2 and value[0] == '"' and value[-1] == '"':
                        value = value[1:-1]
                        if query.vesc:
                            value = unescape(value)
                    q_path, q_op, q_value = query.path, query.op, value
                    i = query.end - 1
                    if i + 1 < n and path[i + 1] == "#":
                        q_all = True
        i += 1
    return split(path, "", "", False, False)


class Query(NamedTuple):
    path: str
    path_offset: int  # where `path` starts in the query text
    op: str
    value: str
    end: int  # index just after the closing bracket
    vesc: bool


def _trim(s: str) -> tuple[str, int]:
    """gjson's trim (bytes <= ' ' on both ends) and how many characters left the front."""
    start, end = 0, len(s)
    while start < end and s[start] <= " ":
        start += 1
    while end > start and s[end - 1] <= " ":
        end -= 1
    return s[start:end], start


@lru_cache(maxsize=4096)
def parse_query(query: str) -> Query | None:
    """gjson's parseQuery on text starting with `#(` or `#[`; None when the brackets never close."""
    n = len(query)
    i, j, depth, vesc = 2, 0, 1, False
    while i < n:
        c = query[i]
        if depth == 1 and j == 0 and c in "!=<>%":
            j = i
            i += 1
            continue
        if c == "\\":
            i += 1
        elif c in "[(":
            depth += 1
        elif c in "])":
            depth -= 1
            if depth == 0:
                break
        elif c == '"':
            i += 1
            while i < n:
                if query[i] == "\\":
                    vesc = True
                    i += 1
                elif query[i] == '"':
                    break
                i += 1
        i += 1
    if depth > 0:
        return None
    if j == 0:
        qpath, lead = _trim(query[2:i])
        return Query(qpath, 2 + lead, "", "", i + 1, vesc)
    qpath, lead = _trim(query[2:j])
    value, _ = _trim(query[j:i])
    if len(value) == 1:
        opsz = 1
    elif value[:2] in ("!=", "!%", "<=", ">="):
        opsz = 2
    elif value[:2] == "==":
        value, opsz = value[1:], 1
    elif value[0] in "<>=%":
        opsz = 1
    else:
        opsz = 0  # a lone `!`: no operator, the query only tests existence
    op = value[:opsz]
    value, _ = _trim(value[opsz:])
    return Query(qpath, 2 + lead, op, value, i + 1, vesc)


def closing_quote(text: str, start: int) -> int:
    """The index of the `"` that ends a string whose content starts at `start` (a quote preceded by
    an odd number of backslashes is escaped), or len(text) when it never ends."""
    i, n = start, len(text)
    while i < n:
        if text[i] == '"':
            slashes = 0
            k = i - 1
            while k >= start and text[k] == "\\":
                slashes += 1
                k -= 1
            if slashes % 2 == 0:
                return i
        i += 1
    return n


def squash(text: str) -> str:
    """gjson's squash: the leading bracketed (or quoted) value of `text`, brackets balanced."""
    i, depth = (0, 0) if text[0] == '"' else (1, 1)
    n = len(text)
    while i < n:
        c = text[i]
        if c == '"':
            i = closing_quote(text, i + 1)
            if depth == 0:
                return text if i >= n else text[: i + 1]
        elif c in "{[(":
            depth += 1
        elif c in "}])":
            depth -= 1
            if depth == 0:
                return text[: i + 1]
        i += 1
    return text


@lru_cache(maxsize=4096)
def split_possible_pipe(path: str) -> tuple[str, str] | None:
    """gjson's splitPossiblePipe: (left, right) around the first `|` outside `.#(...)`."""
    if "|" not in path:
        return None
    if path[0] == "{":
        squashed = squash(path[1:])
        if len(squashed) < len(path) - 1:
            squashed = path[: len(squashed) + 1]
            remain = path[len(squashed) :]
            if remain[0] == "|":
                return squashed, remain[1:]
        return None
    n = len(path)
    i = 0
    while i < n:
        c = path[i]
        if c == "\\":
            i += 1
        elif c == ".":
            if i == n - 1:
                return None
            if path[i + 1] == "#":
                i += 2
                if i == n:
                    return None
                if path[i] in "[(":
                    start, end = ("[", "]") if path[i] == "[" else ("(", ")")
                    i += 1
                    depth = 1
                    while i < n:
                        if path[i] == "\\":
                            i += 1
                        elif path[i] == start:
                            depth += 1
                        elif path[i] == end:
                            depth -= 1
                            if depth == 0:
                                break
                        elif path[i] == '"':
                            i = closing_quote(path, i + 1)
                        i += 1
        elif c == "|":
            return path[:i], path[i + 1 :]
        i += 1
    return None
