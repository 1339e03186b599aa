"""Attack: concurrency leases left in Redis (max_concurrent_requests) by a take that timed out
after Redis ran it, and by a settlement Redis refused (a huge usage)."""

import asyncio
import os

import redis.asyncio as aioredis

from modelyard.gateway.quotas import Quotas
from modelyard.security.api_keys import Caller
from modelyard.state.quotas import MemoryQuotas, RedisQuotas
from modelyard.tenancy import Limits, Scope


def _caller(name: str) -> Caller:
    scopes = (Scope(f"key/{name}", Limits(max_concurrent_requests=1)),)
    return Caller("t", name, None, 0, scopes)


def _quotas(url: str, prefix: str, timeout: float) -> tuple[Quotas, RedisQuotas]:
    shared = RedisQuotas(url, key_prefix=prefix, timeout=timeout)
    return Quotas(shared, MemoryQuotas(), "local", lambda c, r: None, lambda *a: None), shared


async def test_take_timed_out_after_redis_ran_it_does_not_hold_the_slot_for_ten_minutes(redis_url):
    prefix = f"atk-{os.urandom(4).hex()}:"
    quotas, shared = _quotas(redis_url, prefix, timeout=0.25)
    caller = _caller("k1")
    await shared.take(caller.scopes, "warm")  # (script loaded; then freed)
    await shared.settle(caller.scopes, "warm", "t", "k1", 0, 0.0, False)
    blocker = aioredis.Redis.from_url(redis_url)
    # Redis busy for 0.6 s (a slow command, a fork, a failover): the take's reply comes after its timeout
    busy = asyncio.ensure_future(
        blocker.eval(
            "local t0 = redis.call('TIME')[1] * 1 local i = 0 while i < 60000000 do i = i + 1 end return 1", 0
        )
    )
    await asyncio.sleep(0.05)
    permit = await quotas.take(caller)  # times out: counted locally ("local"), Redis runs it later
    assert permit.local
    quotas.end(permit)  # the request ends; settled locally only
    await asyncio.wait_for(busy, 30)
    await blocker.aclose()
    await quotas.settled()  # the slot the late take holds there is given back
    # Redis answers again: the key has nothing in flight, so its next request must be let in
    again = await quotas.take(caller)
    quotas.end(again)
    await quotas.close()


async def test_huge_usage_from_upstream_does_not_leave_the_lease_in_redis(redis_url):
    prefix = f"atk-{os.urandom(4).hex()}:"
    scopes = (Scope("key/k2", Limits(max_concurrent_requests=1, tokens_per_minute=1 << 41)),)
    caller = Caller("t", "k2", None, 0, scopes)
    quotas, _ = _quotas(redis_url, prefix, timeout=2.0)
    permit = await quotas.take(caller)
    assert not permit.local
    permit.ended(
        2**63, 0.0, 200
    )  # an upstream answer's usage.total_tokens (a counter that would overflow in Redis)
    quotas.end(permit)
    await quotas.settled()
    again = await quotas.take(caller)  # nothing is in flight
    quotas.end(again)
    await quotas.close()


async def test_settlements_past_max_settling_still_free_their_redis_slots(redis_url, monkeypatch):
    """A burst that ends while the shared store is slow: past MAX_SETTLING the settlements are
    counted locally only, and their leases stay in Redis for lease_seconds (600 s)."""
    import modelyard.gateway.quotas as quotas_module

    monkeypatch.setattr(quotas_module, "MAX_SETTLING", 1)  # (10 000 in production: the same path)
    prefix = f"atk-{os.urandom(4).hex()}:"
    scopes = (Scope("key/k3", Limits(max_concurrent_requests=2)),)
    caller = Caller("t", "k3", None, 0, scopes)
    quotas, _ = _quotas(redis_url, prefix, timeout=2.0)
    first, second = await quotas.take(caller), await quotas.take(caller)
    quotas.end(first)
    quotas.end(second)  # the pending list is full: settled in this process only
    await quotas.settled()
    again = [await quotas.take(caller), await quotas.take(caller)]  # nothing is in flight: 2 slots free
    for permit in again:
        quotas.end(permit)
    await quotas.close()
