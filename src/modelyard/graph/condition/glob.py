"""tidwall/match as gjson's `%` and `!%` use it: `*` any run, `?` one character, `\\` escapes the
next; nothing else is special. Matching gives up, as no match, past 10000 steps per byte of text,
so a hostile pattern cannot stall a request."""

from __future__ import annotations

from modelyard.graph.condition.values import go_bytes

MATCH_LIMIT = 10000


class _MatchStop(Exception):
    pass


def match_limit(text: str, pattern: str) -> bool:
    """match.MatchLimit(text, pattern, 10000)."""
    if pattern == "*":
        return True
    # the limit counts bytes, as Go's strings do
    slen = len(text) if text.isascii() else len(go_bytes(text))
    counter = [0]
    try:
        return _match(text, 0, len(text), pattern, 0, len(pattern), slen * MATCH_LIMIT, counter)
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
