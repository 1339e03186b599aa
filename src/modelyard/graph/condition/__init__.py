"""KServe's switch and sequence conditions: a port of tidwall/gjson (v1.18) path evaluation, for
`Exists()` only.

KServe's router asks `gjson.GetBytes(body, condition).Exists()` after `gjson.ValidBytes(body)`.
This package answers the same question on the value `orjson` parsed, by porting gjson's own path
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

`compile_condition` rejects only what gjson cannot make sense of (Go silently reads these in odd ways):
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

Where each part lives: `syntax` (how gjson splits a path into components, queries and pipes),
`multipath` (`[...]`/`{...}`), `modifiers` (`@name`), `statics` (`!true`), `evaluate` (gjson.Get on
parsed values), `query` (queryMatches), `glob` (tidwall/match), `go_strconv` (Go's number, bool
and escape reading), `strict_json` (gjson's validator) and `check` (compile_condition). The names
exported here are the whole surface; the modules' other names are for each other.
"""

from modelyard.graph.condition.check import ConditionSyntaxError, compile_condition
from modelyard.graph.condition.evaluate import Condition, condition_exists
from modelyard.graph.condition.strict_json import parse_json_strict

__all__ = ["Condition", "ConditionSyntaxError", "compile_condition", "condition_exists", "parse_json_strict"]
