"""Quota stores: the counters behind tenants' limits (tenancy/limits.py) and their usage.

`take` admits one request against every scope it counts in (its tenant, its key) or refuses it,
in one step: nothing is counted anywhere when one scope refuses. `settle` ends it: its tokens go
into the token windows and the budget, its concurrency slot is freed, its usage is added up.

- `MemoryQuotas`: this process's counters (a gateway of one worker, the tests, and what the gateway
  falls back to while Redis is away).
- `RedisQuotas`: one Lua script per step, so every gateway and worker on one Redis shares exact
  counts: two gateways of two workers with a limit of 100 requests a minute let 100 through. Its
  clock is Redis' own (TIME), so gateways whose clocks disagree still share one window.

Windows are 60 one-second buckets (a hash of second -> count); a concurrency slot is a lease that
expires after `lease_seconds` (a gateway that died holding it cannot hold it for ever); a budget is
one counter of micro-USD per calendar period. Usage is kept per UTC day, per tenant and key.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from modelyard.errors import StateUnavailable
from modelyard.tenancy import Scope, Usage, Verdict, budget_period
from modelyard.tenancy.limits import WINDOW_SECONDS

log = logging.getLogger("modelyard.state")
REASONS = ("", "requests", "tokens", "concurrent", "budget")
USAGE_FIELDS = ("requests", "tokens", "errors", "refused", "cost")
USAGE_DAYS = 8  # how long a day's usage is kept
_MICRO = 1_000_000
MAX_COUNT = (1 << 62) - 1  # what a usage counter holds at most: Redis' and JSON's integers are 64-bit


# One request's end, as `settle` takes it: (scopes, lease, tenant, key, tokens, cost, error)
Settlement = tuple[Sequence[Scope], str, str, str, int, float, bool]


class QuotaStore(Protocol):
    async def take(self, scopes: Sequence[Scope], lease: str) -> Verdict: ...

    async def settle(
        self,
        scopes: Sequence[Scope],
        lease: str,
        tenant: str,
        key: str,
        tokens: int,
        cost: float,
        error: bool,
    ) -> None: ...

    async def refused(self, tenant: str, key: str) -> None: ...

    async def usage(self, day: str) -> list[Usage]: ...

    async def close(self) -> None: ...


def usage_day(now: float) -> str:
    """The UTC day of `now` (epoch seconds), as usage is kept: YYYY-MM-DD."""
    day = int(now // 86400)
    if _last_day[0] != day:  # (once a day, not once a request)
        _last_day[:] = [day, time.strftime("%Y-%m-%d", time.gmtime(day * 86400))]
    return str(_last_day[1])


_last_day: list[int | str] = [-1, ""]


class _Window:
    """One scope's one-second buckets in this process."""

    __slots__ = ("buckets",)

    def __init__(self) -> None:
        self.buckets: dict[int, int] = {}

    def read(self, second: int) -> tuple[int, int, int]:
        """(used in the window ending at `second`, its oldest bucket, its newest; -1 when empty),
        dropping what left the window."""
        used, oldest, newest = 0, -1, -1
        for bucket in [b for b in self.buckets if b <= second - WINDOW_SECONDS]:
            del self.buckets[bucket]
        for bucket, count in self.buckets.items():
            used += count
            oldest = bucket if oldest < 0 or bucket < oldest else oldest
            newest = max(newest, bucket)
        return used, oldest, newest


class _Counters:
    __slots__ = ("leases", "requests", "spent", "tokens")

    def __init__(self) -> None:
        self.requests = _Window()
        self.tokens = _Window()
        self.leases: dict[str, float] = {}
        self.spent: dict[str, int] = {}  # budget period -> micro-USD


class MemoryQuotas:
    """`share` divides every limit (at least 1 stays): a gateway of N workers without a shared
    store gives each worker 1/N of each limit, so that together they stay near it."""

    def __init__(
        self, *, share: int = 1, lease_seconds: float = 600.0, clock: Callable[[], float] = time.time
    ) -> None:
        self._share = max(1, share)
        self._lease_seconds = lease_seconds
        self._clock = clock
        self._scopes: dict[str, _Counters] = {}
        self._usage: dict[str, dict[tuple[str, str], list[int | float]]] = {}

    def _limit(self, value: int | None) -> int:
        assert value is not None
        return max(1, -(-value // self._share))

    async def take(self, scopes: Sequence[Scope], lease: str) -> Verdict:
        return self.take_now(scopes, lease)

    def take_now(self, scopes: Sequence[Scope], lease: str) -> Verdict:
        """`take` without a coroutine: this store never waits."""
        now = self._clock()
        second = int(now)
        tight = _Tightest()
        for name, limits in scopes:
            counters = self._scopes.setdefault(name, _Counters())
            if limits.requests_per_minute is not None:
                limit = self._limit(limits.requests_per_minute)
                used, oldest, newest = counters.requests.read(second)
                if used + 1 > limit:
                    return tight.refused("requests", name, oldest + WINDOW_SECONDS - now, limit, newest, now)
                tight.requests(limit, limit - used - 1, second + WINDOW_SECONDS - now)
            if limits.tokens_per_minute is not None:
                limit = self._limit(limits.tokens_per_minute)
                used, oldest, newest = counters.tokens.read(second)
                if used >= limit:
                    return tight.refused_tokens(name, oldest + WINDOW_SECONDS - now, limit, newest, now)
                tight.tokens(limit, limit - used, newest + WINDOW_SECONDS - now if newest >= 0 else 0.0)
            if limits.max_concurrent_requests is not None:
                for held in [k for k, until in counters.leases.items() if until <= now]:
                    del counters.leases[held]
                if len(counters.leases) >= self._limit(limits.max_concurrent_requests):
                    return tight.refused("concurrent", name, 1.0, None, -1, now)
            if limits.budget is not None:
                period, ends = budget_period(limits.budget_period, now)
                if counters.spent.get(period, 0) >= limits.budget * _MICRO / self._share:
                    return tight.refused("budget", name, ends - now, None, -1, now)
        for name, limits in scopes:
            counters = self._scopes[name]
            if limits.requests_per_minute is not None:
                counters.requests.buckets[second] = counters.requests.buckets.get(second, 0) + 1
            if limits.max_concurrent_requests is not None:
                counters.leases[lease] = now + self._lease_seconds
        return tight.verdict()

    async def settle(
        self,
        scopes: Sequence[Scope],
        lease: str,
        tenant: str,
        key: str,
        tokens: int,
        cost: float,
        error: bool,
    ) -> None:
        self.settle_now(scopes, lease, tenant, key, tokens, cost, error)

    def settle_now(
        self,
        scopes: Sequence[Scope],
        lease: str,
        tenant: str,
        key: str,
        tokens: int,
        cost: float,
        error: bool,
    ) -> None:
        now = self._clock()
        for name, limits in scopes:
            counters = self._scopes.get(name)
            if counters is None:
                continue
            counters.leases.pop(lease, None)
            if tokens > 0 and limits.tokens_per_minute is not None:
                buckets = counters.tokens.buckets
                buckets[int(now)] = buckets.get(int(now), 0) + tokens
            if cost > 0 and limits.budget is not None:
                period, _ = budget_period(limits.budget_period, now)
                if period not in counters.spent:  # a new period: the old ones are done with
                    counters.spent.clear()
                counters.spent[period] = counters.spent.get(period, 0) + round(cost * _MICRO)
        self._count(now, tenant, key, (1, tokens, int(error), 0, cost))

    async def refused(self, tenant: str, key: str) -> None:
        self.refused_now(tenant, key)

    def refused_now(self, tenant: str, key: str) -> None:
        self._count(self._clock(), tenant, key, (0, 0, 0, 1, 0.0))

    def _count(self, now: float, tenant: str, key: str, amounts: tuple[int | float, ...]) -> None:
        day = usage_day(now)
        if day not in self._usage:
            for old in sorted(self._usage)[: max(0, len(self._usage) - USAGE_DAYS + 1)]:
                del self._usage[old]
        row = self._usage.setdefault(day, {}).setdefault((tenant, key), [0, 0, 0, 0, 0.0])
        for index, amount in enumerate(amounts):
            row[index] = min(row[index] + amount, MAX_COUNT)  # (kept as a counter a report can write)

    async def usage(self, day: str) -> list[Usage]:
        rows = self._usage.get(day, {})
        return [
            Usage(tenant, key, int(r[0]), int(r[1]), int(r[2]), int(r[3]), r[4])
            for (tenant, key), r in sorted(rows.items())
        ]

    async def close(self) -> None:
        pass


class _Tightest:
    """The x-ratelimit-* values of the tightest scope so far."""

    __slots__ = ("left_r", "left_t", "limit_r", "limit_t", "reset_r", "reset_t")

    def __init__(self) -> None:
        self.limit_r: int | None = None
        self.left_r = -1
        self.reset_r = 0.0
        self.limit_t: int | None = None
        self.left_t = -1
        self.reset_t = 0.0

    def requests(self, limit: int, left: int, reset: float) -> None:
        if self.limit_r is None or left < self.left_r:
            self.limit_r, self.left_r, self.reset_r = limit, left, reset

    def tokens(self, limit: int, left: int, reset: float) -> None:
        if self.limit_t is None or left < self.left_t:
            self.limit_t, self.left_t, self.reset_t = limit, left, reset

    def refused(
        self, reason: str, scope: str, retry: float, limit: int | None, newest: int, now: float
    ) -> Verdict:
        if reason == "requests":
            assert limit is not None
            self.limit_r, self.left_r, self.reset_r = limit, 0, newest + WINDOW_SECONDS - now
        return self._verdict(False, reason, scope, retry)

    def refused_tokens(self, scope: str, retry: float, limit: int, newest: int, now: float) -> Verdict:
        self.limit_t, self.left_t, self.reset_t = limit, 0, newest + WINDOW_SECONDS - now
        return self._verdict(False, "tokens", scope, retry)

    def verdict(self) -> Verdict:
        return self._verdict(True, "", "", 0.0)

    def _verdict(self, allowed: bool, reason: str, scope: str, retry: float) -> Verdict:
        return Verdict(
            allowed,
            reason,
            scope,
            max(0.0, retry),
            self.limit_r,
            self.left_r if self.limit_r is not None else None,
            max(0.0, self.reset_r),
            self.limit_t,
            self.left_t if self.limit_t is not None else None,
            max(0.0, self.reset_t),
        )


# KEYS: four per scope (request window, token window, concurrency leases, budget of the period).
# ARGV: lease id, lease ms, then five per scope: requests/min, tokens/min, concurrent, budget in
# micro-USD (-1: none), the budget period's end (epoch ms).
# Returns {allowed, reason (REASONS' index), scope index, retry ms, then the tightest scope's
# request limit, remaining, reset ms and token limit, remaining, reset ms (-1: no limit)}.
_TAKE = """
local t = redis.call('TIME')
local sec = tonumber(t[1])
local now = sec * 1000 + math.floor(tonumber(t[2]) / 1000)
local n = #KEYS / 4
local function window(key)
  local fields = redis.call('HGETALL', key)
  local used, oldest, newest = 0, -1, -1
  for j = 1, #fields, 2 do
    local b = tonumber(fields[j])
    if b <= sec - 60 then
      redis.call('HDEL', key, fields[j])
    else
      used = used + tonumber(fields[j + 1])
      if oldest < 0 or b < oldest then oldest = b end
      if b > newest then newest = b end
    end
  end
  return used, oldest, newest
end
local lr, rr, sr, lt, rt, st = -1, -1, 0, -1, -1, 0
for i = 0, n - 1 do
  local a = 3 + i * 5
  local rpm, tpm = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
  local conc, budget = tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  if rpm >= 0 then
    local used, oldest, newest = window(KEYS[i * 4 + 1])
    if used + 1 > rpm then
      return {0, 1, i, (oldest + 60) * 1000 - now, rpm, 0, (newest + 60) * 1000 - now, lt, rt, st}
    end
    if rr < 0 or rpm - used - 1 < rr then lr, rr, sr = rpm, rpm - used - 1, (sec + 60) * 1000 - now end
  end
  if tpm >= 0 then
    local used, oldest, newest = window(KEYS[i * 4 + 2])
    if used >= tpm then
      return {0, 2, i, (oldest + 60) * 1000 - now, lr, rr, sr, tpm, 0, (newest + 60) * 1000 - now}
    end
    if rt < 0 or tpm - used < rt then
      lt, rt = tpm, tpm - used
      if newest >= 0 then st = (newest + 60) * 1000 - now else st = 0 end
    end
  end
  if conc >= 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[i * 4 + 3], '-inf', now)
    if redis.call('ZCARD', KEYS[i * 4 + 3]) >= conc then
      return {0, 3, i, 1000, lr, rr, sr, lt, rt, st}
    end
  end
  if budget >= 0 then
    local spent = tonumber(redis.call('GET', KEYS[i * 4 + 4]) or '0')
    if spent >= budget then
      return {0, 4, i, tonumber(ARGV[a + 4]) - now, lr, rr, sr, lt, rt, st}
    end
  end
end
for i = 0, n - 1 do
  local a = 3 + i * 5
  if tonumber(ARGV[a]) >= 0 then
    redis.call('HINCRBY', KEYS[i * 4 + 1], sec, 1)
    redis.call('EXPIRE', KEYS[i * 4 + 1], 61)
  end
  if tonumber(ARGV[a + 2]) >= 0 then
    redis.call('ZADD', KEYS[i * 4 + 3], now + tonumber(ARGV[2]), ARGV[1])
    redis.call('PEXPIRE', KEYS[i * 4 + 3], tonumber(ARGV[2]))
  end
end
return {1, 0, -1, 0, lr, rr, sr, lt, rt, st}
"""

# KEYS: three per scope (token window, concurrency leases, budget of the period), then the day's
# usage hash. ARGV: lease id, tokens, cost in micro-USD, seconds the budget is kept, the usage
# field prefix, 1 for an error, then two per scope: 1 when it has a token limit, 1 when a budget;
# last, the seconds a day's usage is kept.
_SETTLE = """
local sec = tonumber(redis.call('TIME')[1])
local tokens, cost = tonumber(ARGV[2]), tonumber(ARGV[3])
local n = (#KEYS - 1) / 3
for i = 0, n - 1 do
  redis.call('ZREM', KEYS[i * 3 + 2], ARGV[1])
end
for i = 0, n - 1 do
  if tokens > 0 and ARGV[7 + i * 2] == '1' then
    redis.call('HINCRBY', KEYS[i * 3 + 1], sec, tokens)
    redis.call('EXPIRE', KEYS[i * 3 + 1], 61)
  end
  if cost > 0 and ARGV[8 + i * 2] == '1' then
    redis.call('INCRBY', KEYS[i * 3 + 3], cost)
    redis.call('EXPIRE', KEYS[i * 3 + 3], tonumber(ARGV[4]))
  end
end
local usage, p = KEYS[#KEYS], ARGV[5]
redis.call('HINCRBY', usage, p .. 'requests', 1)
if tokens > 0 then redis.call('HINCRBY', usage, p .. 'tokens', tokens) end
if ARGV[6] == '1' then redis.call('HINCRBY', usage, p .. 'errors', 1) end
if cost > 0 then redis.call('HINCRBY', usage, p .. 'cost', cost) end
redis.call('EXPIRE', usage, tonumber(ARGV[7 + n * 2]))
"""

_SEPARATOR = "\x1f"  # between tenant, key and field in a usage hash's field: no name holds it


class RedisQuotas:
    def __init__(
        self, url: str, *, key_prefix: str = "modelyard:", timeout: float = 0.25, lease_seconds: float = 600.0
    ) -> None:
        self._client = aioredis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout, decode_responses=True
        )
        self._prefix = key_prefix + "quota:"
        self._timeout = timeout
        self._lease_ms = int(lease_seconds * 1000)
        self._take = self._client.register_script(_TAKE)
        self._settle = self._client.register_script(_SETTLE)

    async def take(self, scopes: Sequence[Scope], lease: str) -> Verdict:
        keys: list[str] = []
        args: list[object] = [lease, self._lease_ms]
        now = time.time()
        for name, limits in scopes:
            period, ends = budget_period(limits.budget_period, now)
            base = self._prefix + name
            keys += [base + ":r", base + ":t", base + ":c", f"{base}:b:{period}"]
            args += [
                _or_none(limits.requests_per_minute),
                _or_none(limits.tokens_per_minute),
                _or_none(limits.max_concurrent_requests),
                -1 if limits.budget is None else round(limits.budget * _MICRO),
                int(ends * 1000),
            ]
        reply = await self._run(self._take, keys, args)
        allowed, reason, index, retry, lr, rr, sr, lt, rt, st = (int(v) for v in reply)
        return Verdict(
            bool(allowed),
            REASONS[reason],
            scopes[index].name if index >= 0 else "",
            max(0.0, retry / 1000),
            None if lr < 0 else lr,
            None if lr < 0 else rr,
            max(0.0, sr / 1000),
            None if lt < 0 else lt,
            None if lt < 0 else rt,
            max(0.0, st / 1000),
        )

    async def settle(
        self,
        scopes: Sequence[Scope],
        lease: str,
        tenant: str,
        key: str,
        tokens: int,
        cost: float,
        error: bool,
    ) -> None:
        await self._run(self._settle, *self._settlement(scopes, lease, tenant, key, tokens, cost, error))

    async def settle_many(
        self, settlements: Sequence[Settlement], releases: Sequence[tuple[Sequence[Scope], str]] = ()
    ) -> None:
        """Several requests' ends in one round trip (a pipeline of the script); `releases`: the
        concurrency slots of requests a take may have counted here without the gateway knowing
        (it timed out, or was cancelled, after Redis ran it), given back."""
        try:
            async with asyncio.timeout(self._timeout * 4):
                async with self._client.pipeline(transaction=False) as pipe:
                    for settlement in settlements:
                        keys, args = self._settlement(*settlement)
                        await self._settle(keys=keys, args=args, client=pipe)  # type: ignore[arg-type]
                    for scopes, lease in releases:
                        for name, limits in scopes:
                            if limits.max_concurrent_requests is not None:
                                pipe.zrem(self._prefix + name + ":c", lease)
                    replies = await pipe.execute(raise_on_error=False)
        except (RedisError, OSError, TimeoutError) as exc:
            raise StateUnavailable(f"redis quota settlements failed: {exc!r}") from exc
        failed = [reply for reply in replies if isinstance(reply, Exception)]
        if failed:  # (one that Redis refuses is not tried again: it would be refused for ever)
            log.error("redis refused %d quota settlements, e.g.: %r", len(failed), failed[0])

    def _settlement(
        self,
        scopes: Sequence[Scope],
        lease: str,
        tenant: str,
        key: str,
        tokens: int,
        cost: float,
        error: bool,
    ) -> tuple[list[str], list[object]]:
        now = time.time()
        keys: list[str] = []
        flags: list[object] = []
        for name, limits in scopes:
            period, _ = budget_period(limits.budget_period, now)
            base = self._prefix + name
            keys += [base + ":t", base + ":c", f"{base}:b:{period}"]
            flags += [int(limits.tokens_per_minute is not None), int(limits.budget is not None)]
        keys.append(self._prefix + "usage:" + usage_day(now))
        keep = 400 * 86400  # a budget's counter outlives its period by far less than this
        usage_ttl = USAGE_DAYS * 86400
        args = [
            lease,
            min(tokens, 1 << 40),  # (a server's word: a counter must not overflow on it)
            min(round(cost * _MICRO), 1 << 50),
            keep,
            _usage_field(tenant, key),
            int(error),
            *flags,
            usage_ttl,
        ]
        return keys, args

    async def refused(self, tenant: str, key: str) -> None:
        usage = self._prefix + "usage:" + usage_day(time.time())
        try:
            async with asyncio.timeout(self._timeout):
                await self._client.hincrby(usage, _usage_field(tenant, key) + "refused", 1)
        except (RedisError, OSError, TimeoutError) as exc:
            raise StateUnavailable(f"redis quota usage failed: {exc!r}") from exc

    async def usage(self, day: str) -> list[Usage]:
        try:
            async with asyncio.timeout(self._timeout * 4):
                fields = await self._client.hgetall(self._prefix + "usage:" + day)
        except (RedisError, OSError, TimeoutError) as exc:
            raise StateUnavailable(f"redis quota usage failed: {exc!r}") from exc
        rows: dict[tuple[str, str], dict[str, int]] = {}
        for field, value in fields.items():
            parts = str(field).split(_SEPARATOR)
            if len(parts) != 3 or not str(value).lstrip("-").isdigit():
                continue  # not one this gateway wrote
            tenant, key, what = parts
            rows.setdefault((tenant, key), {})[what] = int(value)
        return [
            Usage(
                tenant,
                key,
                r.get("requests", 0),
                r.get("tokens", 0),
                r.get("errors", 0),
                r.get("refused", 0),
                r.get("cost", 0) / _MICRO,
            )
            for (tenant, key), r in sorted(rows.items())
        ]

    async def close(self) -> None:
        await self._client.aclose()

    async def _run(self, script: object, keys: list[str], args: list[object]) -> Any:
        try:
            async with asyncio.timeout(self._timeout):
                reply = await script(keys=keys, args=args)  # type: ignore[operator]
        except (RedisError, OSError, TimeoutError) as exc:
            raise StateUnavailable(f"redis quota script failed: {exc!r}") from exc
        return reply


def _or_none(value: int | None) -> int:
    return -1 if value is None else value


def _usage_field(tenant: str, key: str) -> str:
    return f"{tenant}{_SEPARATOR}{key}{_SEPARATOR}"
