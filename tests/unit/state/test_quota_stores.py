"""The quota stores: a request is let in only when every scope it counts in has room, counted in
all of them or in none; tokens and cost come in when it ends; concurrency slots are leases. The
same behaviour from this process's counters and from Redis (shared by every gateway on it)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from modelyard.state.quotas import MemoryQuotas, RedisQuotas, usage_day
from modelyard.tenancy import Limits, Scope


class Clock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[MemoryQuotas | RedisQuotas]:
    if request.param == "memory":
        yield MemoryQuotas()
        return
    url = request.getfixturevalue("redis_url")
    prefix = f"test-{id(request)}:"
    made = RedisQuotas(url, key_prefix=prefix, timeout=2.0)
    yield made
    await made.close()


def tenant(name: str, **limits: object) -> Scope:
    return Scope(f"tenant/{name}", Limits(**limits))  # type: ignore[arg-type]


async def test_requests_per_minute_lets_exactly_the_limit_through(store):
    scopes = [tenant("a", requests_per_minute=5)]
    verdicts = [await store.take(scopes, f"l{i}") for i in range(8)]
    assert [v.allowed for v in verdicts] == [True] * 5 + [False] * 3
    assert [v.remaining_requests for v in verdicts[:5]] == [4, 3, 2, 1, 0]
    refused = verdicts[5]
    assert refused.reason == "requests" and refused.scope == "tenant/a"
    assert 0 < refused.retry_after <= 60 and refused.limit_requests == 5


async def test_a_refusal_by_one_scope_counts_in_none(store):
    """The key has room, its tenant has not: nothing is counted against the key."""
    key = Scope("key/k1", Limits(requests_per_minute=10))
    busy = tenant("b", requests_per_minute=2)
    for i in range(2):
        assert (await store.take([busy], f"x{i}")).allowed
    refused = await store.take([busy, key], "y")
    assert not refused.allowed and refused.scope == "tenant/b"
    # the key alone still has all of its 10
    assert (await store.take([key], "z")).remaining_requests == 9


async def test_tokens_are_counted_when_the_request_ends(store):
    scopes = [tenant("c", tokens_per_minute=100)]
    first = await store.take(scopes, "t1")
    assert first.allowed and first.remaining_tokens == 100  # nothing used yet
    await store.settle(scopes, "t1", "c", "k", 60, 0.0, False)
    second = await store.take(scopes, "t2")
    assert second.allowed and second.remaining_tokens == 40
    await store.settle(scopes, "t2", "c", "k", 60, 0.0, False)
    third = await store.take(scopes, "t3")
    assert not third.allowed and third.reason == "tokens" and third.remaining_tokens == 0


async def test_concurrent_requests_hold_a_slot_until_they_end(store):
    scopes = [tenant("d", max_concurrent_requests=2)]
    assert (await store.take(scopes, "c1")).allowed
    assert (await store.take(scopes, "c2")).allowed
    refused = await store.take(scopes, "c3")
    assert not refused.allowed and refused.reason == "concurrent"
    await store.settle(scopes, "c1", "d", "k", 0, 0.0, False)
    assert (await store.take(scopes, "c4")).allowed


async def test_a_spent_budget_refuses_until_the_period_ends(store):
    scopes = [tenant("e", budget=0.01, budget_period="day")]
    assert (await store.take(scopes, "b1")).allowed
    await store.settle(scopes, "b1", "e", "k", 1000, 0.004, False)
    assert (await store.take(scopes, "b2")).allowed
    await store.settle(scopes, "b2", "e", "k", 1000, 0.006, False)
    refused = await store.take(scopes, "b3")
    assert not refused.allowed and refused.reason == "budget"
    assert 0 < refused.retry_after <= 86400


async def test_usage_adds_up_by_tenant_and_key(store):
    scopes = [tenant("f", requests_per_minute=100)]
    for i, (tokens, error) in enumerate([(10, False), (5, True)]):
        await store.take(scopes, f"u{i}")
        await store.settle(scopes, f"u{i}", "f", "f-key", tokens, 0.5, error)
    await store.refused("f", "f-key")
    rows = [row for row in await store.usage(usage_day(time.time())) if row.tenant == "f"]
    assert len(rows) == 1
    row = rows[0]
    assert (row.key, row.requests, row.tokens, row.errors, row.refused) == ("f-key", 2, 15, 1, 1)
    assert row.cost == pytest.approx(1.0)


async def test_the_window_slides_a_second_at_a_time():
    clock = Clock()
    store = MemoryQuotas(clock=clock)
    scopes = [tenant("g", requests_per_minute=3)]
    for step in range(3):  # one a second
        assert (await store.take(scopes, f"s{step}")).allowed
        clock.now += 1
    refused = await store.take(scopes, "s3")
    assert not refused.allowed and refused.retry_after == pytest.approx(57.0)
    clock.now += 57  # the first request's second leaves the window
    assert (await store.take(scopes, "s4")).allowed
    assert not (await store.take(scopes, "s5")).allowed


async def test_a_lease_its_gateway_never_ended_expires():
    clock = Clock()
    store = MemoryQuotas(clock=clock, lease_seconds=30)
    scopes = [tenant("h", max_concurrent_requests=1)]
    assert (await store.take(scopes, "dead")).allowed
    assert not (await store.take(scopes, "next")).allowed
    clock.now += 31
    assert (await store.take(scopes, "next")).allowed


async def test_a_workers_share_of_each_limit():
    store = MemoryQuotas(share=2)
    scopes = [tenant("i", requests_per_minute=5)]  # 3 for each of two workers (rounded up)
    assert [(await store.take(scopes, f"w{i}")).allowed for i in range(4)] == [True] * 3 + [False]


async def test_redis_counts_are_exact_under_concurrent_gateways(redis_url):
    """Four stores (as four workers) on one Redis take at once: exactly the limit passes."""
    prefix = "test-exact:"
    stores = [RedisQuotas(redis_url, key_prefix=prefix, timeout=2.0) for _ in range(4)]
    scopes = [tenant("j", requests_per_minute=100)]
    try:
        verdicts = await asyncio.gather(*(stores[i % 4].take(scopes, f"r{i}") for i in range(300)))
        assert sum(v.allowed for v in verdicts) == 100
    finally:
        for made in stores:
            await made.close()


async def test_redis_settles_many_in_one_round_trip(redis_url):
    store = RedisQuotas(redis_url, key_prefix="test-many:", timeout=2.0)
    scopes = [tenant("k", tokens_per_minute=100, max_concurrent_requests=2)]
    try:
        assert (await store.take(scopes, "m1")).allowed
        assert (await store.take(scopes, "m2")).allowed
        assert not (await store.take(scopes, "m3")).allowed  # both slots held
        await store.settle_many(
            [(scopes, "m1", "k", "k1", 30, 0.0, False), (scopes, "m2", "k", "k1", 50, 0.0, True)]
        )
        verdict = await store.take(scopes, "m4")
        assert verdict.allowed and verdict.remaining_tokens == 20
        rows = [r for r in await store.usage(usage_day(time.time())) if r.tenant == "k"]
        assert [(r.requests, r.tokens, r.errors) for r in rows] == [(2, 80, 1)]
    finally:
        await store.close()
