"""Quotas: each keyed request is admitted against its tenant's and its key's limits before it is
routed, and settled when it ends (its tokens, its cost, its concurrency slot, its usage).

The counters live in a quota store (state/quotas.py): Redis with state.backend redis (exact across
every gateway and worker on it), else this process's (a gateway of N workers without Redis gives
each worker 1/N of every limit). While Redis does not answer, `auth.quota_store_down` decides:
`local` counts in this process with its share of the limits (a worker that cannot reach Redis
cannot know what the others counted), `allow` lets requests through uncounted, `refuse` answers
503. Never a stall: each store call has the state timeout.

Over a limit: 429 in the protocol's envelope, with Retry-After and OpenAI's x-ratelimit-* headers,
which every answer relayed to a limited key carries too. Tokens are what the answer's `usage` says
(prompt + completion; a stream's last event, which the gateway asks for: openai_route), so a
request is let in while its window has tokens left and its own are counted when it ends.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Callable, Sequence

from modelyard.errors import BudgetExceeded, QuotaExceeded, QuotaStoreUnavailable, StateUnavailable
from modelyard.security.api_keys import Caller
from modelyard.state.quotas import MemoryQuotas, RedisQuotas, Settlement
from modelyard.tenancy import Scope, Usage, Verdict, reset_text

log = logging.getLogger("modelyard.gateway")

MAX_SETTLING = 100_000  # settlements waiting for Redis while it is away; past it the oldest are dropped
MAX_RELEASES = 1_000_000  # concurrency slots to give back, kept while Redis is away
MIN_BACKOFF, MAX_BACKOFF = 0.5, 10.0  # seconds Redis is left alone after it did not answer
_UNLIMITED: tuple[tuple[bytes, bytes], ...] = ()


class Permit:
    """A request let in: who, its concurrency lease, whether the local store took it (Redis away),
    and the x-ratelimit-* fields its answers carry. Each exchange it makes (one, or one per model
    tried with fallbacks) adds its tokens and cost when it closes, and the last one's status is the
    request's; the handler that took it ends it once (`Quotas.end`), whatever happened between."""

    __slots__ = (
        "caller",
        "code",
        "cost",
        "fields",
        "lease",
        "local",
        "settled",
        "shed",
        "strip_usage",
        "tokens",
    )

    def __init__(
        self, caller: Caller, lease: str, local: bool, fields: tuple[tuple[bytes, bytes], ...]
    ) -> None:
        self.caller = caller
        self.lease = lease
        self.local = local
        self.fields = fields
        self.tokens = 0
        self.cost = 0.0
        self.code = 0  # 0: no exchange ended (refused or failed before one opened)
        self.settled = False
        self.shed = False  # the gateway refused it for room (429 overloaded: the queue full, or shed)
        # the gateway asked a stream for its usage (stream_options) on its own behalf, not the
        # client's: the usage event is not relayed
        self.strip_usage = False

    def ended(self, tokens: int, cost: float, code: int, shed: bool = False) -> None:
        """An exchange of this request closed (`shed`: refused by the gateway for room)."""
        self.tokens += tokens
        self.cost += cost
        self.code = code
        self.shed = shed


class Quotas:
    def __init__(
        self,
        shared: RedisQuotas | None,
        local: MemoryQuotas,
        on_store_down: str,
        on_refused: Callable[[Caller, str], None],
        on_ended: Callable[[str, int, int, float, bool], None],
    ) -> None:
        self._shared = shared  # None: the local store is the store (state.backend memory)
        self._local = local
        self._on_down = on_store_down
        self._on_refused = on_refused  # (tenant metrics: the caller, the reason)
        self._on_ended = on_ended  # (tenant metrics: tenant, status, tokens, cost, shed)
        self._lease_prefix = os.urandom(6).hex()
        self._leases = itertools.count(1)
        self._settling: set[asyncio.Task[None]] = set()
        self._pending: list[Settlement] = []  # ended, not yet sent to the shared store
        self._flushing: asyncio.Future[None] | None = None
        self._releases: list[tuple[Sequence[Scope], str]] = []  # slots a failed take may hold there
        self._down = False
        self._retry_at = 0.0  # (monotonic) Redis is not asked before this, after it did not answer
        self._away_for = MIN_BACKOFF
        self.dropped = 0  # settlements dropped (Redis away with MAX_SETTLING waiting)

    async def take(self, caller: Caller) -> Permit:
        """Let the caller's request in, or raise QuotaExceeded (429) saying which limit."""
        if not caller.scopes:
            return Permit(caller, "", False, _UNLIMITED)
        lease = f"{self._lease_prefix}{next(self._leases):x}"
        local = self._shared is None
        verdict: Verdict | None = None
        if self._shared is not None:
            if time.monotonic() < self._retry_at:  # away a moment ago: not asked again till then
                local = True
            else:
                try:
                    verdict = await self._shared.take(caller.scopes, lease)
                    self._store_answers()
                except StateUnavailable as exc:
                    self._store_away(exc)
                    self._release(caller, lease)  # (it may have run there after all)
                    local = True
                except asyncio.CancelledError:  # the client left: the slot it may hold there goes
                    self._release(caller, lease)
                    raise
            if local:
                if self._on_down == "allow":
                    return Permit(caller, "", True, _UNLIMITED)
                if self._on_down == "refuse":
                    raise QuotaStoreUnavailable(
                        "quotas cannot be checked: the quota store does not answer",
                        headers={"Retry-After": "1"},
                    )
        if verdict is None:
            verdict = self._local.take_now(caller.scopes, lease)
        fields = rate_limit_fields(verdict)
        if not verdict.allowed:
            self._on_refused(caller, verdict.reason)
            if local or self._shared is None:
                self._local.refused_now(caller.tenant, caller.key)
            else:
                self._spawn(self._shared.refused(caller.tenant, caller.key))
            raise _refusal(caller, verdict, fields)
        return Permit(caller, lease, local, fields)

    def end(self, permit: Permit, failed_with: int = 500) -> None:
        """The request is over (a second call does nothing): its tokens, cost and usage counted,
        its slot freed, its tenant's metrics counted. `failed_with`: its status when no exchange
        of it ended (it failed or was cancelled before one opened). In this process at once; in
        Redis with the others that ended meanwhile, in one round trip, in the background (the answer
        is not held for it, and a flood of requests is not a flood of round trips)."""
        if permit.settled:
            return
        permit.settled = True
        code = permit.code or failed_with
        self._on_ended(permit.caller.tenant, code, permit.tokens, permit.cost, permit.shed)
        caller = permit.caller
        settlement = (
            caller.scopes,
            permit.lease,
            caller.tenant,
            caller.key,
            permit.tokens,
            permit.cost,
            code >= 400,
        )
        if permit.local or self._shared is None:
            self._local.settle_now(*settlement)
            return
        self._pending.append(settlement)  # (taken in Redis, so settled there: its slot is there)
        self._send()

    def _release(self, caller: Caller, lease: str) -> None:
        if any(limits.max_concurrent_requests for _, limits in caller.scopes):
            self._releases.append((caller.scopes, lease))
            self._send()

    def _send(self) -> None:
        if len(self._pending) > MAX_SETTLING:  # Redis away for long: the oldest usage is lost
            dropped = self._pending[: len(self._pending) - MAX_SETTLING]
            del self._pending[: len(dropped)]
            # (their usage is lost, their concurrency slots not: a release is a few bytes)
            self._releases += [(scopes, lease) for scopes, lease, *_ in dropped if lease]
            self.dropped += 1
            if self.dropped == 1:
                log.warning(
                    "quotas: %d settlements wait for the quota store: the oldest dropped", MAX_SETTLING
                )
        if self._flushing is None:
            self._flushing = asyncio.ensure_future(self._flush())

    async def settled(self) -> None:
        """Until what ended so far reached Redis (or was given up on: close)."""
        while self._flushing is not None:
            await asyncio.shield(self._flushing)

    async def usage(self, day: str) -> tuple[list[Usage], bool]:
        """The day's usage, and whether it is every gateway's (the shared store's) or this
        worker's only."""
        if self._shared is not None:
            try:
                return await self._shared.usage(day), True
            except StateUnavailable:
                pass
        return await self._local.usage(day), self._shared is None

    async def close(self) -> None:
        waiting = [*self._settling, *([self._flushing] if self._flushing is not None else [])]
        if waiting:
            _, late = await asyncio.wait(waiting, timeout=1.0)
            for task in late:  # (Redis away: what still waits for it is lost)
                task.cancel()
        if self._shared is not None:
            await self._shared.close()

    async def _flush(self) -> None:
        """Send what ended since the last round trip, until nothing is left (each round trip takes
        what came in during the one before). While Redis does not answer, try again with backoff:
        a request taken there is settled there, or its concurrency slot would stay held until its
        lease ran out."""
        assert self._shared is not None
        backoff = MIN_BACKOFF
        try:
            while self._pending or self._releases:
                batch, self._pending = self._pending, []
                releases, self._releases = self._releases, []
                try:
                    await self._shared.settle_many(batch, releases)
                    self._store_answers()
                    backoff = MIN_BACKOFF
                except StateUnavailable as exc:
                    self._store_away(exc)
                    self._pending[:0] = batch
                    self._releases[:0] = releases[-MAX_RELEASES:]
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, MAX_BACKOFF)
        finally:
            self._flushing = None

    def _spawn(self, work: object) -> None:
        task = asyncio.ensure_future(self._quietly(work))  # type: ignore[arg-type]
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _quietly(self, work: asyncio.Future[None]) -> None:
        try:
            await work
        except StateUnavailable as exc:
            self._store_away(exc)

    def _store_away(self, exc: Exception) -> None:
        """Redis did not answer: requests do not ask it again for a while (doubling while it stays
        away), so that none waits state.timeout for it meanwhile."""
        self._away_for = min(self._away_for * 2, MAX_BACKOFF) if self._down else MIN_BACKOFF
        self._retry_at = time.monotonic() + self._away_for
        if not self._down:
            log.warning("quotas: the quota store does not answer (%s): %s", self._on_down, exc)
            self._down = True

    def _store_answers(self) -> None:
        if self._down:
            log.info("quotas: the quota store answers again")
            self._down = False
            self._retry_at = 0.0


def rate_limit_fields(verdict: Verdict) -> tuple[tuple[bytes, bytes], ...]:
    """OpenAI's x-ratelimit-* fields for what the verdict says of the tightest scope."""
    pairs: list[tuple[bytes, bytes]] = []
    if verdict.limit_requests is not None:
        pairs += [
            (b"x-ratelimit-limit-requests", b"%d" % verdict.limit_requests),
            (b"x-ratelimit-remaining-requests", b"%d" % (verdict.remaining_requests or 0)),
            (b"x-ratelimit-reset-requests", reset_text(verdict.reset_requests).encode()),
        ]
    if verdict.limit_tokens is not None:
        pairs += [
            (b"x-ratelimit-limit-tokens", b"%d" % verdict.limit_tokens),
            (b"x-ratelimit-remaining-tokens", b"%d" % (verdict.remaining_tokens or 0)),
            (b"x-ratelimit-reset-tokens", reset_text(verdict.reset_tokens).encode()),
        ]
    return tuple(pairs)


def _refusal(caller: Caller, verdict: Verdict, fields: tuple[tuple[bytes, bytes], ...]) -> QuotaExceeded:
    headers = {name.decode(): value.decode() for name, value in fields}
    headers["Retry-After"] = str(max(1, int(verdict.retry_after + 0.999)))
    scope = verdict.scope.replace("/", " ", 1)  # "tenant team-a", "key team-a-ci"
    if verdict.reason == "budget":
        return BudgetExceeded(
            f"{scope} has spent its budget for this period (key {caller.key!r})", headers=headers
        )
    what = {
        "requests": "requests per minute",
        "tokens": "tokens per minute",
        "concurrent": "concurrent requests",
    }[verdict.reason]
    return QuotaExceeded(
        f"rate limit reached: {scope} is at its {what} (key {caller.key!r}); "
        f"retry after {headers['Retry-After']}s",
        headers=headers,
    )
