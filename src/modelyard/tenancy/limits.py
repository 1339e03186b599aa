"""What a tenant or one of its keys may spend, and how a quota store answers.

    limits:
      requests_per_minute: 600        # requests begun in any 60 s
      tokens_per_minute: 200000       # prompt + completion tokens (from the answers' usage) in any 60 s
      max_concurrent_requests: 16     # in flight at once
      budget: 25.0                    # USD per budget_period, at the endpoints' cost_per_1k_tokens
      budget_period: day              # hour | day | week | month (calendar, UTC)

A request passes when every scope it belongs to (its tenant, its key) has room: one more request
in the last 60 s within requests_per_minute, fewer tokens than tokens_per_minute used in the last
60 s (its own are counted when it ends: the answer says how many), a free concurrency slot, and
budget left. The window is 60 one-second buckets, so "per minute" holds for any 60 s aligned to a
second, in every store (state/quotas.py).
"""

from __future__ import annotations

import calendar
import math
import time
from typing import Any, NamedTuple

WINDOW_SECONDS = 60
PERIODS = ("hour", "day", "week", "month")
_FIELDS = {
    "requests_per_minute": "a whole number over 0",
    "tokens_per_minute": "a whole number over 0",
    "max_concurrent_requests": "a whole number over 0",
    "budget": "a number of USD over 0",
    "budget_period": "one of " + ", ".join(PERIODS),
}


class Limits(NamedTuple):
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None
    budget: float | None = None
    budget_period: str = "day"

    @property
    def any(self) -> bool:
        return (
            self.requests_per_minute is not None
            or self.tokens_per_minute is not None
            or self.max_concurrent_requests is not None
            or self.budget is not None
        )

    def plain(self) -> dict[str, Any]:
        """As the keys file and the admin API write it: only the limits that are set."""
        shown: dict[str, Any] = {k: v for k, v in self._asdict().items() if v is not None}
        if self.budget is None:
            shown.pop("budget_period")
        return shown


NO_LIMITS = Limits()


class Scope(NamedTuple):
    """One holder of limits a request counts against: `tenant/<name>` or `key/<name>`."""

    name: str
    limits: Limits


class Verdict(NamedTuple):
    """A quota store's answer. Refused: `reason` (requests, tokens, concurrent, budget), the scope
    that refused and `retry_after` seconds. Either way, what OpenAI's x-ratelimit-* headers say for
    the tightest scope: limit, remaining, seconds until the window is whole again (None: no limit
    of that kind)."""

    allowed: bool
    reason: str = ""
    scope: str = ""
    retry_after: float = 0.0
    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests: float = 0.0
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens: float = 0.0


class Usage(NamedTuple):
    """What one tenant's key used in one UTC day."""

    tenant: str
    key: str
    requests: int
    tokens: int
    errors: int
    refused: int
    cost: float


def parse_limits(value: object, where: str, problems: list[str]) -> Limits:
    """The limits of a keys file's (or the admin API's) `limits:` mapping; each problem, with
    its field path, added to `problems`."""
    if value is None:
        return NO_LIMITS
    if not isinstance(value, dict):
        problems.append(f"{where}: expected a mapping of limits ({', '.join(_FIELDS)})")
        return NO_LIMITS
    found: dict[str, Any] = {}
    for field, given in value.items():
        expected = _FIELDS.get(str(field))
        if expected is None:
            problems.append(f"{where}.{field}: unknown limit (expected {', '.join(_FIELDS)})")
        elif field == "budget_period":
            if given not in PERIODS:
                problems.append(f"{where}.{field}: expected {expected}, got {given!r}")
            else:
                found[field] = given
        elif field == "budget":
            if isinstance(given, bool) or not isinstance(given, int | float) or not 0 < given < math.inf:
                problems.append(f"{where}.{field}: expected {expected}, got {given!r}")
            else:
                found[field] = float(given)
        elif type(given) is not int or not 0 < given <= 1 << 40:
            # (0 would refuse everything: a key that may do nothing is a revoked key)
            problems.append(f"{where}.{field}: expected {expected}, got {given!r}")
        else:
            found[field] = given
    if "budget_period" in found and "budget" not in found:
        problems.append(f"{where}.budget_period: set with budget only")
    return Limits(**found)


def budget_period(period: str, now: float) -> tuple[str, float]:
    """The calendar period (UTC) holding `now` (epoch seconds): its name (part of the store's
    key, so that a new period starts from nothing) and when it ends (epoch seconds)."""
    if period == "hour":
        start = int(now // 3600) * 3600
        return f"h{start}", start + 3600.0
    if period == "day":
        start = int(now // 86400) * 86400
        return f"d{start}", start + 86400.0
    if period == "week":  # ISO weeks begin on Monday; the epoch was a Thursday
        start = int((now + 3 * 86400) // (7 * 86400)) * 7 * 86400 - 3 * 86400
        return f"w{start}", start + 7 * 86400.0
    moment = time.gmtime(now)
    year, month = moment.tm_year, moment.tm_mon
    first = calendar.timegm((year, month, 1, 0, 0, 0))
    following = calendar.timegm((year + month // 12, month % 12 + 1, 1, 0, 0, 0))
    return f"m{first}", float(following)


def reset_text(seconds: float) -> str:
    """OpenAI's way of writing a reset time: `1s`, `6m0s`, `20ms`."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    whole = math.ceil(seconds)
    minutes, rest = divmod(whole, 60)
    return f"{minutes}m{rest}s" if minutes else f"{rest}s"
