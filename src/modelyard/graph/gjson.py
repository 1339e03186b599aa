"""KServe's switch and sequence conditions: a port of tidwall/gjson (v1.18) path evaluation, for
`Exists()` only.

KServe's router asks `gjson.GetBytes(body, condition).Exists()` after `gjson.ValidBytes(body)`.
This module answers the same question on the value `orjson` parsed, by porting gjson's own path
splitting (`parseObjectPath`, `parseArrayPath`, `parseQuery`, `parseSubSelectors`,
`splitPossiblePipe`, `execModifier`) and its matching (`queryMatches`, tidwall/match). Whatever
gjson reads leniently is read the same way here; "the path" is always what gjson makes of it:

- `a.b.0`: keys and array indexes (a number is a key on an object); `\\` escapes `.`, `*`, `?`;
  `*`/`?` in a key match the first key (in document order) by glob.
- `#`: the length of an array (a key named "#" on an object); `a.#.b` maps `b` over the array
  (always an array, so it exists whenever `a` is an array).
- `#(KEY OP VALUE)`: the first element that matches, or nothing; `#(...)#`: every match, an array
  that always exists on an array. KEY is a full path in the element (`predictions.0.class`,
  `a.#(b==1)`); without OP, `#(KEY)` tests that KEY exists. OP is `==`/`=`, `!=`, `<`, `<=`, `>`,
  `>=`, `%`, `!%`. VALUE in double quotes is unquoted (escapes processed only when the query has a
  backslash inside a quoted string); otherwise it is the raw rest up to `)`, spaces and `&&`
  included. The JSON type of the element's value picks the comparison:
  string: byte-wise against VALUE, `%`/`!%` a tidwall/match glob (`*`, `?`, `\\` only, at most
  10000 steps per byte or no match); number: against VALUE read by Go's `strconv.ParseFloat`
  (unparsable means 0, `"1"` still compares as 1); true: `=` iff VALUE is `true`, `!=` iff it is
  not, `>` iff it is `false`, `>=` always; false: `=` iff `false`, `!=` iff not, `<` iff `true`,
  `<=` always; null, object, array: never.
  `~true`/`~false`/`~null`/`~*` first turn the element's value into a boolean (then compare it
  with `true`): `~*` it exists; `~null` it is null or missing; `~true` it is true, a non-zero
  number, or a string that Go's `strconv.ParseBool` reads as true ("1", "t", "true", any case);
  `~false` it is false, null, missing, zero, or a string ParseBool reads as false. Any other `~x`
  never matches.
- Modifiers `@this`, `@reverse`, `@flatten`, `@join`, `@keys`, `@values`, `@valid`, `@pretty`,
  `@ugly`, `@tostr`, `@fromstr`, `@group`, `@dig`; an unknown `@name` is an ordinary key.
  Static values `!true`, `!false`, `!null`.
- Multipaths `[p1,p2]` (an array of the sub-results that exist) and `{p1,"name":p2}` (an object),
  which always exist; `.` or `|` continues into them. `{ .input.userId == 1 }` is such an object
  (with one sub-path that never exists), so it always exists. `[@this].#(...)` queries the root.
- `|` applies the rest of the path to the result so far (`a.#(b==1)#|0` is the first match, while
  `a.#(b==1)#.0` maps `0` over the matches). `..` at the start treats the document as JSON lines.

`compile_path` rejects only what gjson cannot make sense of (Go silently reads these in odd ways):
a `#(` or `#[` query at the start of a component with no closing bracket (`#(((`, `#(a==1`,
`#(a=="x)`), a `[` or `{` multipath (at the start of a path, after `.` or `|`, or inside another)
whose brackets do not balance, and a trailing unescaped `\\`. It also rejects the static values
this port does not evaluate: `!` followed by a JSON literal (`!{...}`, `![...]`, `!"..."`, `!1`)
and `true`/`false`/`null` in another letter case, `nan`, `inf`.

Deliberate gaps (Go works on the raw text, this port on parsed values): a duplicated object key
keeps orjson's last value (gjson finds the first); navigating into a string value finds nothing
(gjson scans a string's raw text for `{`/`[`); `@pretty`/`@ugly` ignore their options (so
`sortKeys` does not reorder keys); `@tostr` writes compact orjson text, not the original bytes;
`@fromstr` of a string that is not strictly valid JSON gives nothing; strings with invalid UTF-8
compare by code point after `surrogateescape` decoding; a path or document so deep that Python's
recursion limit is reached does not exist.
"""

from __future__ import annotations

import json
import math
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, NamedTuple

import orjson

__all__ = ["GjsonSyntaxError", "Path", "compile_path", "condition_exists", "parse_json_strict"]


class GjsonSyntaxError(ValueError):
    """A condition gjson cannot make sense of; `offset` is the character where the trouble starts."""

    def __init__(self, message: str, path: str, offset: int) -> None:
        super().__init__(f"{message} (at offset {offset} of {path!r})")
        self.path = path
        self.offset = offset


class _Missing:
    __slots__ = ()

    def __repr__(self) -> str:
        return "<missing>"


_MISSING: Any = _Missing()  # gjson's empty Result: Type Null, Raw ""

_MATCH_LIMIT = 10000


@dataclass(frozen=True, slots=True)
class Path:
    """A compiled gjson path; `exists` answers `gjson.Get(document, source).Exists()`."""

    source: str

    def exists(self, document: Any) -> bool:
        """`document` is a parsed JSON value (dict, list, str, int, float, bool or None)."""
        if not self.source:
            return False
        try:
            return _get(document, self.source) is not _MISSING
        except RecursionError:  # only for absurdly deep documents or paths
            return False


def compile_path(path: str) -> Path:
    """Check `path` once (at graph load) and return it ready to evaluate.

    Raises GjsonSyntaxError for an unclosed `#(`/`#[` query, an unbalanced `[`/`{` multipath, a
    trailing `\\`, and the static values this port does not evaluate (see the module docstring).
    Everything else gjson accepts is accepted, however odd (`{ .input.userId == 1 }` included).
    """
    _Checker(path).check(path, 0)
    return Path(path)


def parse_json_strict(data: bytes) -> tuple[bool, Any]:
    """(valid, value) by gjson's validator: one JSON value with optional surrounding whitespace
    (space, tab, CR, LF), any root type; no NaN/Infinity, no empty input, nothing after the value.

    Unlike orjson, gjson does not check UTF-8, surrogate escapes, nesting depth or whether a number
    fits a double; such documents are decoded here by a slower port of gjson's rules.
    """
    try:
        return True, orjson.loads(data)
    except orjson.JSONDecodeError:
        pass
    value = _go_loads(data)
    if value is _MISSING:
        return False, None
    return True, value


def condition_exists(path: Path, data: bytes) -> bool | None:
    """None when `data` is not valid JSON, else whether `path` exists in it."""
    valid, document = parse_json_strict(data)
    if not valid:
        return None
    return path.exists(document)


# --- evaluation: gjson.Get on parsed values -------------------------------------------------------


class _Ctx:
    """gjson's parseContext: the value found and the pipe to apply to it at the end of Get."""

    __slots__ = ("pipe", "piped", "value")

    def __init__(self) -> None:
        self.value: Any = _MISSING
        self.pipe = ""
        self.piped = False


_NOT_PLAIN = frozenset(".|*?\\#@![{")


@lru_cache(maxsize=4096)
def _is_plain_key(path: str) -> bool:
    """A lone key or index: no character that gjson's Get, parseObjectPath or parseArrayPath reads."""
    return not any(c in _NOT_PLAIN for c in path)


def _get(value: Any, path: str) -> Any:
    if _is_plain_key(path):  # the common case, answered without the general machinery
        if isinstance(value, dict):
            return value.get(path, _MISSING)
        if isinstance(value, list):
            index = _parse_uint(path)
            return value[index] if 0 <= index < len(value) else _MISSING
        return _MISSING
    if len(path) > 1:
        head = path[0]
        if head == "@":
            mod = _split_modifier(path)
            if mod is not None:
                out = _MODIFIER_FUNCS[mod.name](value, mod.args)
                if mod.rest and mod.rest[0] in "|.":
                    return _get(out, mod.rest[1:])
                return out
        elif head == "!":
            static = _split_static(path)
            if static is not None:
                if static.rest and static.rest[0] in "|.":
                    return _get(static.value, static.rest[1:])
                return static.value
        if head in "[{":
            sel = _parse_sub_selectors(path)
            if sel is None:
                path = ""  # gjson goes on with the (empty) remainder
            elif not sel.rest or sel.rest[0] in "|.":
                built = _build_multipath(value, head, sel.subs)
                if sel.rest:
                    return _get(built, sel.rest[1:])
                return built
            else:
                path = sel.rest
    ctx = _Ctx()
    if len(path) >= 2 and path[0] == "." and path[1] == ".":
        _parse_array(ctx, [] if value is _MISSING else [value], path[2:])
    elif isinstance(value, dict):
        _parse_object(ctx, value, path)
    elif isinstance(value, list):
        _parse_array(ctx, value, path)
    if ctx.piped:
        return _get(ctx.value, ctx.pipe)
    return ctx.value


def _build_multipath(value: Any, kind: str, subs: tuple[_SubSelector, ...]) -> Any:
    if kind == "[":
        items = []
        for sub in subs:
            found = _get(value, sub.path)
            if found is not _MISSING:
                items.append(found)
        return items
    obj: dict[str, Any] = {}
    for sub in subs:
        found = _get(value, sub.path)
        if found is not _MISSING and sub.key not in obj:
            obj[sub.key] = found
    return obj


def _parse_object(ctx: _Ctx, obj: dict[str, Any], path: str) -> bool:
    rp = _parse_object_path(path)
    if not rp.more and rp.piped:
        ctx.pipe, ctx.piped = rp.pipe, True
    if rp.wild:
        candidates = [v for k, v in obj.items() if _match_limit(k, rp.part)]
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
    rp = _parse_array_path(path)
    if not rp.more and rp.piped:
        ctx.pipe, ctx.piped = rp.pipe, True
    if rp.q_on:
        return _query_array(ctx, arr, rp)
    if rp.arrch:
        if rp.part != "#":
            return False
        if rp.alogok:
            key = rp.alogkey
            split = _split_possible_pipe(key)
            if split is not None:
                key, ctx.pipe, ctx.piped = split[0], split[1], True
            mapped = []
            for elem in arr:
                found = _get(elem, key)
                if found is not _MISSING:
                    mapped.append(found)
            ctx.value = mapped
            return True
        ctx.value = len(arr)
        return True
    index = _parse_uint(rp.part)
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


def _query_array(ctx: _Ctx, arr: list[Any], rp: _ArrayPath) -> bool:
    matches: list[Any] = []
    for elem in arr:
        if isinstance(elem, dict | list):
            res = _get(elem, rp.q_path)
        elif rp.q_path:
            continue
        else:
            res = elem
        if not _query_matches(rp, res):
            continue
        if rp.more:
            rest = rp.path
            split = _split_possible_pipe(rest)
            if split is not None:
                rest, ctx.pipe, ctx.piped = split[0], split[1], True
            res = _get(elem, rest)
        else:
            res = elem
        if not rp.q_all:
            ctx.value = res  # the first match decides, even when its continuation is missing
            return True
        if res is not _MISSING:
            matches.append(res)
    if rp.q_all and ctx.value is _MISSING:
        ctx.value = matches
    return False


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _to_float(value: Any) -> float:
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _parse_bool(text: str) -> bool | None:
    """Go's strconv.ParseBool after strings.ToLower."""
    low = text.lower()
    if low in ("1", "t", "true"):
        return True
    if low in ("0", "f", "false"):
        return False
    return None


def _trueish(value: Any) -> bool:
    if value is True:
        return True
    if isinstance(value, str):
        return _parse_bool(value) is True
    if _is_number(value):
        return _to_float(value) != 0
    return False


def _falseish(value: Any) -> bool:
    if value is None or value is _MISSING or value is False:
        return True
    if isinstance(value, str):
        return _parse_bool(value) is False
    if _is_number(value):
        return _to_float(value) == 0
    return False


def _query_matches(rp: _ArrayPath, value: Any) -> bool:
    literal = rp.q_value
    if literal.startswith("~"):
        kind = literal[1:]
        if kind == "*":
            ish = value is not _MISSING
        elif kind == "null":
            ish = value is None or value is _MISSING
        elif kind == "true":
            ish = _trueish(value)
        elif kind == "false":
            ish = _falseish(value)
        else:
            return False
        value, literal = ish, "true"
    if value is _MISSING:
        return False
    op = rp.q_op
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
    if _is_number(value):
        return _compare_numbers(op, _to_float(value), _go_parse_float(literal))
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
        return _match_limit(value, literal)
    if op == "!%":
        return not _match_limit(value, literal)
    if op in ("=", "!="):
        return _COMPARE[op](value, literal)
    compare = _COMPARE.get(op)
    return compare is not None and compare(_go_bytes(value), _go_bytes(literal))


def _compare_numbers(op: str, value: float, literal: float) -> bool:
    compare = _COMPARE.get(op)
    return compare is not None and compare(value, literal)


def _go_bytes(text: str) -> bytes:
    """The bytes Go holds for this string (raw bytes come back from surrogateescape)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        try:
            return text.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            return text.encode("utf-8", "surrogatepass")


_DECIMAL = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_HEXFLOAT = re.compile(r"([+-]?)0[xX]((?:[0-9a-fA-F]+\.?[0-9a-fA-F]*|\.[0-9a-fA-F]+))[pP]([+-]?[0-9]+)")
_INFINITY = re.compile(r"([+-]?)(?:inf|infinity)", re.IGNORECASE)


@lru_cache(maxsize=1024)
def _go_parse_float(text: str) -> float:
    """strconv.ParseFloat(text, 64) with the error ignored: 0 on a syntax error, ±Inf past range.
    Go's float literal syntax: `1_000` (underscores between digits), `.5`, `5.`, `1e3`, `0x1p-2`,
    `inf`, `infinity`, `nan` (case-insensitive)."""
    if "_" in text:
        if not _underscores_ok(text):
            return 0.0
        text = text.replace("_", "")
    if _DECIMAL.fullmatch(text):
        return float(text)
    if text.lower() == "nan":
        return math.nan
    special = _INFINITY.fullmatch(text)
    if special:
        return -math.inf if special.group(1) == "-" else math.inf
    hexf = _HEXFLOAT.fullmatch(text)
    if hexf:
        sign, mantissa, exponent = hexf.groups()
        try:
            return float.fromhex(f"{sign}0x{mantissa}p{exponent}")
        except OverflowError:
            return -math.inf if sign == "-" else math.inf
    return 0.0


def _underscores_ok(text: str) -> bool:
    """strconv's underscoreOK: each `_` sits between digits (or right after a 0x/0b/0o prefix)."""
    saw = "^"
    i = 0
    if text[:1] in ("+", "-"):
        text = text[1:]
    hexa = False
    if len(text) >= 2 and text[0] == "0" and text[1].lower() in "box":
        i, saw, hexa = 2, "0", text[1].lower() == "x"
    for c in text[i:]:
        if "0" <= c <= "9" or (hexa and "a" <= c.lower() <= "f"):
            saw = "0"
        elif c == "_":
            if saw != "0":
                return False
            saw = "_"
        elif saw == "_":
            return False
        else:
            saw = "!"
    return saw != "_"


def _parse_uint(part: str) -> int:
    """gjson's parseUint then int(): digits only, uint64 wrap-around; -1 when not an index."""
    if not part or not part.isascii() or not part.isdigit():
        return -1
    n = int(part) % (1 << 64)
    return -1 if n >= 1 << 63 else n


# --- tidwall/match ----------------------------------------------------------------------------------


class _MatchStop(Exception):
    pass


def _match_limit(text: str, pattern: str) -> bool:
    """match.MatchLimit(text, pattern, 10000): `*`, `?`, `\\` escapes; over the limit, no match."""
    if pattern == "*":
        return True
    slen = len(text) if text.isascii() else len(_go_bytes(text))
    counter = [0]
    try:
        return _match(text, 0, len(text), pattern, 0, len(pattern), slen * _MATCH_LIMIT, counter)
    except (_MatchStop, RecursionError):
        return False


def _match(s: str, si: int, se: int, p: str, pi: int, pe: int, limit: int, counter: list[int]) -> bool:
    if counter[0] > limit:
        raise _MatchStop
    counter[0] += 1
    while pi < pe:
        wild = False
        pc = p[pi]
        if pc == "?":
            if si >= se:
                return False
        elif pc == "*":
            while pe - pi > 1 and p[pi + 1] == "*":
                pi += 1
            if pe - pi == 1:
                return True
            se, pe, ok = _match_trim_suffix(s, si, se, p, pi, pe)
            if not ok:
                return False
            if pe - pi == 1:
                return True
            if _match(s, si, se, p, pi + 1, pe, limit, counter):
                return True
            if si >= se:
                return False
            wild = True
        else:
            if si >= se:
                return False
            if pc == "\\":
                pi += 1
                if pi >= pe:
                    return False
                pc = p[pi]
            if s[si] != pc:
                return False
        si += 1
        if not wild:
            pi += 1
    return si >= se


def _match_trim_suffix(s: str, si: int, se: int, p: str, pi: int, pe: int) -> tuple[int, int, bool]:
    """Match and drop the literal tail after the last `*` (p[pi] is a `*`, pe - pi >= 2)."""
    while se > si and pe - pi > 1:
        pc = p[pe - 1]
        width = 1
        slashes = 0
        while p[pe - 1 - slashes - 1] == "\\":
            slashes += 1
        escaped = slashes % 2 == 1
        if escaped:
            width += 1
        if pc == "*" and not escaped:
            return se, pe, True
        if not ((pc == "?" and not escaped) or pc == s[se - 1]):
            return se, pe, False
        se -= 1
        pe -= width
    return se, pe, True


# --- path splitting (ported from gjson; cached per path string) ----------------------------------

_MODIFIER_NAMES = frozenset(
    {"pretty", "ugly", "reverse", "this", "flatten", "join", "valid", "keys", "values", "tostr", "fromstr"}
    | {"group", "dig"}
)


def _is_dot_piper_char(s: str) -> bool:
    """After a `.`: does a modifier, `[` or `{` start here (the rest then works like a pipe)?"""
    c = s[0]
    if c == "@":
        i = 1
        while i < len(s) and s[i] not in ".|:":
            i += 1
        return s[1:i] in _MODIFIER_NAMES
    return c in "[{"


class _ObjectPath(NamedTuple):
    part: str
    path: str
    pipe: str
    piped: bool
    wild: bool
    more: bool


@lru_cache(maxsize=4096)
def _parse_object_path(path: str) -> _ObjectPath:
    n = len(path)
    wild = False
    i = 0
    while i < n:
        c = path[i]
        if c == "|":
            return _ObjectPath(path[:i], "", path[i + 1 :], True, wild, False)
        if c == ".":
            if i < n - 1 and _is_dot_piper_char(path[i + 1 :]):
                return _ObjectPath(path[:i], "", path[i + 1 :], True, wild, False)
            return _ObjectPath(path[:i], path[i + 1 :], "", False, wild, True)
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
                        if i < n - 1 and _is_dot_piper_char(path[i + 1 :]):
                            return _ObjectPath(part, "", path[i + 1 :], True, wild, False)
                        return _ObjectPath(part, path[i + 1 :], "", False, wild, True)
                    elif c == "|":
                        return _ObjectPath("".join(epart), "", path[i + 1 :], True, wild, False)
                    else:
                        if c in "*?":
                            wild = True
                        epart.append(c)
                    i += 1
            return _ObjectPath("".join(epart), "", "", False, wild, False)
        i += 1
    return _ObjectPath(path, "", "", False, wild, False)


class _ArrayPath(NamedTuple):
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
def _parse_array_path(path: str) -> _ArrayPath:
    n = len(path)
    arrch = alogok = q_on = q_all = False
    alogkey = q_path = q_op = q_value = ""

    def split(part: str, rest: str, pipe: str, piped: bool, more: bool) -> _ArrayPath:
        # The query state read here is what the scan has gathered so far (closures bind late).
        return _ArrayPath(
            part, rest, pipe, piped, more, arrch, alogok, alogkey, q_on, q_all, q_path, q_op, q_value
        )

    i = 0
    while i < n:
        c = path[i]
        if c == "|":
            return split(path[:i], "", path[i + 1 :], True, False)
        if c == ".":
            if not arrch and i < n - 1 and _is_dot_piper_char(path[i + 1 :]):
                return split(path[:i], "", path[i + 1 :], True, False)
            return split(path[:i], path[i + 1 :], "", False, True)
        if c == "#":
            arrch = True
            if i == 0 and n > 1:
                if path[1] == ".":
                    alogok, alogkey = True, path[2:]
                elif path[1] in "[(":
                    q_on = True
                    query = _parse_query(path)
                    if query is None:
                        break  # a bad query: the whole path is the part
                    value = query.value
                    if len(value) >= 2 and value[0] == '"' and value[-1] == '"':
                        value = value[1:-1]
                        if query.vesc:
                            value = _go_unescape(value)
                    q_path, q_op, q_value = query.path, query.op, value
                    i = query.end - 1
                    if i + 1 < n and path[i + 1] == "#":
                        q_all = True
        i += 1
    return split(path, "", "", False, False)


class _Query(NamedTuple):
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
def _parse_query(query: str) -> _Query | None:
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
        return _Query(qpath, 2 + lead, "", "", i + 1, vesc)
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
    return _Query(qpath, 2 + lead, op, value, i + 1, vesc)


def _closing_quote(text: str, start: int) -> int:
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


def _squash(text: str) -> str:
    """gjson's squash: the leading bracketed (or quoted) value of `text`, brackets balanced."""
    i, depth = (0, 0) if text[0] == '"' else (1, 1)
    n = len(text)
    while i < n:
        c = text[i]
        if c == '"':
            i = _closing_quote(text, i + 1)
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
def _split_possible_pipe(path: str) -> tuple[str, str] | None:
    """gjson's splitPossiblePipe: (left, right) around the first `|` outside `.#(...)`."""
    if "|" not in path:
        return None
    if path[0] == "{":
        squashed = _squash(path[1:])
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
                            i += 1
                            while i < n:
                                if path[i] == "\\":
                                    i += 1
                                elif path[i] == '"':
                                    break
                                i += 1
                        i += 1
        elif c == "|":
            return path[:i], path[i + 1 :]
        i += 1
    return None


class _SubSelector(NamedTuple):
    path: str
    path_offset: int
    key: str  # the member name in a `{...}` multipath


class _SubSelectors(NamedTuple):
    subs: tuple[_SubSelector, ...]
    rest: str


@lru_cache(maxsize=4096)
def _parse_sub_selectors(path: str) -> _SubSelectors | None:
    """gjson's parseSubSelectors for `[p1,p2]` / `{p1,"name":p2}`; None when never closed."""
    subs: list[_SubSelector] = []
    modifier = colon = 0
    depth = start = i = 1
    n = len(path)

    def push() -> None:
        nonlocal colon, modifier, start
        if colon == 0:
            sub_path, offset, name = path[start:i], start, ""
        else:
            sub_path, offset, name = path[colon + 1 : i], colon + 1, path[start:colon]
        subs.append(_SubSelector(sub_path, offset, _member_name(name, sub_path)))
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
            i += 1
            while i < n:
                if path[i] == "\\":
                    i += 1
                elif path[i] == '"':
                    break
                i += 1
        elif c in "[({":
            depth += 1
        elif c in "])}":
            depth -= 1
            if depth == 0:
                push()
                return _SubSelectors(tuple(subs), path[i + 1 :])
        i += 1
    return None


def _member_name(name: str, sub_path: str) -> str:
    if name:
        if name[0] == '"':
            decoded = _go_loads(_go_bytes(name))
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


class _Modifier(NamedTuple):
    name: str
    args: str
    args_offset: int
    rest: str


@lru_cache(maxsize=4096)
def _split_modifier(path: str) -> _Modifier | None:
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
    if name not in _MODIFIER_NAMES:
        return None
    args = ""
    args_offset = len(path) - len(rest)
    if has_args:
        if rest[0] in '{["':
            args = _squash(rest)
        else:
            i = 0
            while i < len(rest) and rest[i] != "|":
                if rest[i] in '{["(':
                    i += len(_squash(rest[i:])) - 1
                i += 1
            args = rest[:i]
        rest = rest[len(args) :]
    return _Modifier(name, args, args_offset, rest)


class _Static(NamedTuple):
    value: Any
    rest: str
    supported: bool


_STATIC_NAMES = {"true": True, "false": False, "null": None}


@lru_cache(maxsize=1024)
def _split_static(path: str) -> _Static | None:
    """gjson's execStatic: `!true`, `!false`, `!null` here; other forms gjson evaluates are not
    supported (compile_path rejects them; at run time they give nothing); None: not a static."""
    name = path[1:]
    if name[0] in '{["+-0123456789':
        return _Static(_MISSING, name[len(_parse_squash(name)) :], False)
    rest = ""
    for i in range(1, len(path)):
        if path[i] in "|.":
            rest, name = path[i:], path[1:i]
            break
    if name.lower() not in ("true", "false", "null", "nan", "inf"):
        return None
    if name in _STATIC_NAMES:
        return _Static(_STATIC_NAMES[name], rest, True)
    return _Static(_MISSING, rest, False)


def _parse_squash(text: str) -> str:
    """gjson's parseSquash(text, 0): like squash, but the first character is always skipped."""
    i, depth, n = 1, 1, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            i = _closing_quote(text, i + 1)
        elif c in "{[(":
            depth += 1
        elif c in "}])":
            depth -= 1
            if depth == 0:
                return text[: i + 1]
        i += 1
    return text


# --- modifiers (on values; gjson re-parses the text each returns) ---------------------------------


def _option(args: str, name: str) -> bool:
    """A boolean option from a modifier's JSON argument, as gjson's Result.Bool reads it."""
    parsed = _go_loads(_go_bytes(args)) if args else _MISSING
    if not isinstance(parsed, dict):
        return False
    value = parsed.get(name)
    if value is True:
        return True
    if isinstance(value, str):
        return value.lower() in ("1", "t", "true")
    return _is_number(value) and _to_float(value) != 0


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
    if value is _MISSING:
        return []
    if isinstance(value, dict):
        return list(value)
    if isinstance(value, list):
        return [None] * len(value)
    return [None]


def _mod_values(value: Any, args: str) -> Any:
    if value is _MISSING:
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
    return "" if value is _MISSING else _dumps(value)


def _mod_fromstr(value: Any, args: str) -> Any:
    if value is _MISSING or value is None:
        return _MISSING
    if isinstance(value, str):
        valid, parsed = parse_json_strict(_go_bytes(value))
        return parsed if valid else _MISSING
    return value


def _mod_group(value: Any, args: str) -> Any:
    if not isinstance(value, dict):
        return _MISSING
    rows: list[dict[str, Any]] = []
    for key, column in value.items():
        if isinstance(column, list):
            for index, item in enumerate(column):
                if index == len(rows):
                    rows.append({})
                rows[index].setdefault(key, item)
    return rows


def _mod_dig(value: Any, args: str) -> Any:
    found: list[Any] = []

    def descend(node: Any) -> None:
        hit = _get(node, args)
        if hit is not _MISSING:
            found.append(hit)
        if isinstance(node, dict):
            for child in node.values():
                descend(child)
        elif isinstance(node, list):
            for child in node:
                descend(child)

    descend(value)
    return found


_MODIFIER_FUNCS: dict[str, Callable[[Any, str], Any]] = {
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
    "dig": _mod_dig,
}
assert set(_MODIFIER_FUNCS) == _MODIFIER_NAMES


# --- gjson's string unescape and JSON validator ---------------------------------------------------

_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_HEX = frozenset("0123456789abcdefABCDEF")


def _runeit(text: str) -> int:
    """strconv.ParseUint(text[:4], 16, 64) with the error ignored."""
    digits = text[:4]
    return int(digits, 16) if len(digits) == 4 and all(c in _HEX for c in digits) else 0


def _go_unescape(text: str) -> str:
    """gjson's unescape: stops at a control character or a bad escape; lone surrogates become U+FFFD."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c < " ":
            break
        if c != "\\":
            out.append(c)
            i += 1
            continue
        i += 1
        if i >= n:
            break
        e = text[i]
        if e in _SIMPLE_ESCAPES:
            out.append(_SIMPLE_ESCAPES[e])
            i += 1
            continue
        if e != "u" or i + 5 > n:
            break
        r = _runeit(text[i + 1 :])
        i += 5
        if 0xD800 <= r <= 0xDFFF and n - i >= 6 and text[i] == "\\" and text[i + 1] == "u":
            low = _runeit(text[i + 2 :])
            r = 0x10000 + ((r - 0xD800) << 10) + (low - 0xDC00) if r < 0xDC00 <= low < 0xE000 else 0xFFFD
            i += 6
        out.append("\ufffd" if 0xD800 <= r <= 0xDFFF else chr(r))
    return "".join(out)


_WS = b" \t\n\r"
_NUMBER = re.compile(rb"-?(?:0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
_STRING_BODY = re.compile(
    rb'[^"\\\x00-\x1f]*(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})[^"\\\x00-\x1f]*)*"'
)  # after the opening quote, up to and including the closing one


def _skip_ws(data: bytes, i: int) -> int:
    n = len(data)
    while i < n and data[i] in _WS:
        i += 1
    return i


def _read_string(data: bytes, i: int) -> tuple[str, int] | None:
    """The string whose opening quote is at i - 1: (decoded, index after the closing quote)."""
    m = _STRING_BODY.match(data, i)
    if m is None:
        return None
    raw = data[i : m.end() - 1].decode("utf-8", "surrogateescape")
    return (_go_unescape(raw) if "\\" in raw else raw), m.end()


def _go_loads(data: bytes) -> Any:
    """gjson's validator (RFC 8259 without UTF-8, surrogate, depth or range checks) that also
    builds the value: _MISSING when invalid. Iterative, so any depth; first duplicate key wins."""
    n = len(data)
    i = _skip_ws(data, 0)
    stack: list[Any] = []
    keys: list[str] = []
    while True:
        if i >= n:
            return _MISSING
        c = data[i]
        value: Any
        if c == 0x7B:  # {
            i = _skip_ws(data, i + 1)
            if i < n and data[i] == 0x7D:
                value, i = {}, i + 1
            else:
                member = _read_member_key(data, i)
                if member is None:
                    return _MISSING
                key, i = member
                stack.append({})
                keys.append(key)
                continue
        elif c == 0x5B:  # [
            i = _skip_ws(data, i + 1)
            if i < n and data[i] == 0x5D:
                value, i = [], i + 1
            else:
                stack.append([])
                keys.append("")
                continue
        elif c == 0x22:  # "
            read = _read_string(data, i + 1)
            if read is None:
                return _MISSING
            value, i = read
        elif c == 0x2D or 0x30 <= c <= 0x39:
            m = _NUMBER.match(data, i)
            if m is None:
                return _MISSING
            raw = m.group()
            value = float(raw) if m.group(1) or m.group(2) else int(raw)
            i = m.end()
        elif data.startswith(b"true", i):
            value, i = True, i + 4
        elif data.startswith(b"false", i):
            value, i = False, i + 5
        elif data.startswith(b"null", i):
            value, i = None, i + 4
        else:
            return _MISSING
        while True:  # attach the value, closing every container it completes
            i = _skip_ws(data, i)
            if not stack:
                return value if i == n else _MISSING
            top = stack[-1]
            if isinstance(top, list):
                top.append(value)
            elif keys[-1] not in top:
                top[keys[-1]] = value
            if i >= n:
                return _MISSING
            c = data[i]
            if c == 0x2C:  # ,
                i = _skip_ws(data, i + 1)
                if isinstance(top, dict):
                    member = _read_member_key(data, i)
                    if member is None:
                        return _MISSING
                    keys[-1], i = member
                break
            if c == (0x5D if isinstance(top, list) else 0x7D):
                i += 1
                value = stack.pop()
                keys.pop()
                continue
            return _MISSING


def _read_member_key(data: bytes, i: int) -> tuple[str, int] | None:
    """`"key" :` at i; returns the key and the index of the member's value."""
    if i >= len(data) or data[i] != 0x22:
        return None
    read = _read_string(data, i + 1)
    if read is None:
        return None
    key, i = read
    i = _skip_ws(data, i)
    if i >= len(data) or data[i] != 0x3A:
        return None
    return key, _skip_ws(data, i + 1)


# --- compile-time checks ----------------------------------------------------------------------------


class _Checker:
    """Walks a path the way gjson splits it and raises on what gjson cannot make sense of."""

    def __init__(self, source: str) -> None:
        self.source = source

    def error(self, message: str, offset: int) -> GjsonSyntaxError:
        return GjsonSyntaxError(message, self.source, offset)

    def check(self, path: str, base: int) -> None:
        """A path that gjson.Get starts on (the whole condition, a sub-path, after `|`)."""
        if path in ("[", "{"):
            raise self.error(f"'{path}' opens a multipath that is never closed", base)
        if len(path) > 1:
            head = path[0]
            if head == "@":
                mod = _split_modifier(path)
                if mod is not None:
                    if mod.name == "dig" and mod.args:
                        self.check(mod.args, base + mod.args_offset)
                    self._rest(mod.rest, base + len(path) - len(mod.rest))
                    return
            elif head == "!":
                static = _split_static(path)
                if static is not None:
                    if not static.supported:
                        raise self.error(
                            f"static value {path[: len(path) - len(static.rest)]!r} is not supported"
                            " (only !true, !false and !null are)",
                            base,
                        )
                    self._rest(static.rest, base + len(path) - len(static.rest))
                    return
            if head in "[{":
                sel = _parse_sub_selectors(path)
                if sel is None:
                    closer = "]" if head == "[" else "}"
                    raise self.error(f"'{head}' opens a multipath with no matching '{closer}'", base)
                for sub in sel.subs:
                    self.check(sub.path, base + sub.path_offset)
                rest_at = base + len(path) - len(sel.rest)
                if not sel.rest or sel.rest[0] in "|.":
                    self._rest(sel.rest, rest_at)
                else:
                    self.components(sel.rest, rest_at)
                return
        if path.startswith(".."):
            self.components(path[2:], base + 2)
            return
        self.components(path, base)

    def _rest(self, rest: str, base: int) -> None:
        if rest and rest[0] in "|.":
            self.check(rest[1:], base + 1)

    def components(self, path: str, base: int) -> None:
        """Keys, indexes and queries separated by `.`; `|` and piped `.` restart a whole path."""
        i, n = 0, len(path)
        component_start = 0
        while i < n:
            c = path[i]
            if i == component_start and c == "#" and i + 1 < n and path[i + 1] in "([":
                query = _parse_query(path[i:])
                if query is None:
                    closer = ")" if path[i + 1] == "(" else "]"
                    raise self.error(f"query '#{path[i + 1]}' has no matching '{closer}'", base + i)
                self.check(query.path, base + i + query.path_offset)
                i += query.end
                continue
            if c == "\\":
                if i + 1 >= n:
                    raise self.error("trailing '\\' escapes nothing", base + i)
                i += 2
                continue
            if c == "|":
                self.check(path[i + 1 :], base + i + 1)
                return
            if c == ".":
                rest = path[i + 1 :]
                if rest and (_is_dot_piper_char(rest) or path[component_start:i] == "#"):
                    self.check(rest, base + i + 1)
                    return
                component_start = i + 1
            i += 1
