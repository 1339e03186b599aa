"""Compiling a condition: checked once, when a graph is loaded, so that a path gjson cannot make
sense of is a load error naming the offset, never a silent non-match at request time."""

from __future__ import annotations

from modelyard.graph.condition.evaluate import Condition
from modelyard.graph.condition.modifiers import split_modifier
from modelyard.graph.condition.multipath import parse_sub_selectors
from modelyard.graph.condition.statics import split_static
from modelyard.graph.condition.syntax import is_dot_piper_char, parse_query


class ConditionSyntaxError(ValueError):
    """A condition gjson cannot make sense of; `offset` is the character where the trouble starts."""

    def __init__(self, message: str, path: str, offset: int) -> None:
        super().__init__(f"{message} (at offset {offset} of {path!r})")
        self.path = path
        self.offset = offset


def compile_condition(path: str) -> Condition:
    """Check `path` once (at graph load) and return it ready to evaluate.

    Raises ConditionSyntaxError for an unclosed `#(`/`#[` query, an unbalanced `[`/`{` multipath,
    a trailing `\\`, and the static values this port does not evaluate (see the package docstring).
    Everything else gjson accepts is accepted, however odd (`{ .input.userId == 1 }` included).
    """
    _Checker(path).check(path, 0)
    return Condition(path)


class _Checker:
    """Walks a path the way gjson splits it and raises on what gjson cannot make sense of."""

    def __init__(self, source: str) -> None:
        self.source = source

    def error(self, message: str, offset: int) -> ConditionSyntaxError:
        return ConditionSyntaxError(message, self.source, offset)

    def check(self, path: str, base: int) -> None:
        """A path that gjson.Get starts on (the whole condition, a sub-path, after `|`)."""
        if path in ("[", "{"):
            raise self.error(f"'{path}' opens a multipath that is never closed", base)
        if len(path) > 1:
            head = path[0]
            if head == "@":
                mod = split_modifier(path)
                if mod is not None:
                    if mod.name == "dig" and mod.args:
                        self.check(mod.args, base + mod.args_offset)
                    self._rest(mod.rest, base + len(path) - len(mod.rest))
                    return
            elif head == "!":
                static = split_static(path)
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
                sel = parse_sub_selectors(path)
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
                query = parse_query(path[i:])
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
                if rest and (is_dot_piper_char(rest) or path[component_start:i] == "#"):
                    self.check(rest, base + i + 1)
                    return
                component_start = i + 1
            i += 1
