"""The circuit breakers' wait queue: bounded, in order, per subset, one deadline, cancellation-safe."""

from __future__ import annotations

import asyncio
import time

import pytest

from modelyard.balancing.routes import ALL_SUBSETS
from modelyard.cluster import BackendLoad, Endpoint
from modelyard.config import CircuitBreakerConfig
from modelyard.errors import Overloaded
from modelyard.gateway.capacity import CapacityQueue


def endpoint(name: str, subset: str = "default", in_flight: int = 0) -> Endpoint:
    load = BackendLoad(f"http://{name}", name, in_flight=in_flight)
    return Endpoint(name, load.url, load, subset=subset)


def queue(max_requests: int = 1, max_pending: int = 2, queue_timeout: float = 5.0) -> CapacityQueue:
    config = CircuitBreakerConfig(
        max_requests=max_requests, max_pending_requests=max_pending, queue_timeout=queue_timeout
    )
    return CapacityQueue("m", config)


def far() -> float:
    return time.monotonic() + 60


async def started(q: CapacityQueue, subset: str) -> asyncio.Task[None]:
    """A waiter in the queue (the task has run up to its await)."""
    before = len(q)
    task = asyncio.create_task(q.wait(subset, far()))
    await asyncio.sleep(0)  # one turn of the loop: the task runs up to its first await
    assert len(q) == before + 1
    return task


def test_room_is_the_in_flight_limit_and_zero_means_none() -> None:
    assert queue(max_requests=2).has_room(endpoint("a", in_flight=1))
    assert not queue(max_requests=2).has_room(endpoint("a", in_flight=2))
    assert queue(max_requests=0).has_room(endpoint("a", in_flight=10_000))


async def test_waiters_are_woken_in_arrival_order() -> None:
    q = queue(max_pending=3)
    first, second = await started(q, "default"), await started(q, "default")
    q.wake("default")
    await asyncio.sleep(0)
    assert first.done() and not second.done()
    q.wake("default")
    await asyncio.gather(first, second)
    assert len(q) == 0


async def test_a_freed_endpoint_wakes_only_waiters_it_can_serve() -> None:
    q = queue(max_pending=3)
    wants_b = await started(q, "b")
    wants_any = await started(q, ALL_SUBSETS)
    q.wake("a")  # an endpoint of subset a: the first waiter wants b, the second takes anything
    await asyncio.sleep(0)
    assert wants_any.done() and not wants_b.done()
    q.wake("b")
    await wants_b


async def test_queued_for_sees_waiters_a_newcomer_would_compete_with() -> None:
    q = queue(max_pending=3)
    assert not q.queued_for("a")
    task = await started(q, "b")
    assert q.queued_for("b") and q.queued_for(ALL_SUBSETS) and not q.queued_for("a")
    q.wake("b")
    await task
    assert not q.queued_for("b")


async def test_a_full_queue_refuses_at_once_with_429() -> None:
    q = queue(max_pending=1)
    waiting = await started(q, "default")
    with pytest.raises(Overloaded) as info:
        await q.wait("default", far())
    assert info.value.status == 429 and info.value.headers == {"Retry-After": "1"}
    q.wake("default")
    await waiting


async def test_time_up_is_429_and_leaves_the_queue() -> None:
    q = queue()
    with pytest.raises(Overloaded, match="no endpoint freed up"):
        await q.wait("default", time.monotonic() + 0.01)
    assert len(q) == 0


async def test_a_woken_waiter_that_leaves_passes_its_turn_on() -> None:
    q = queue(max_pending=3)
    first, second = await started(q, "default"), await started(q, "default")
    q.wake("default")  # first is woken...
    first.cancel()  # ...but its client has gone before it ran
    await asyncio.gather(first, return_exceptions=True)
    await asyncio.wait_for(second, 1)  # the slot went to the next one instead of being lost
    assert len(q) == 0


def test_refuse_if_full_only_when_no_endpoint_has_room_and_the_queue_is_full() -> None:
    busy, idle = endpoint("busy", in_flight=1), endpoint("idle")
    q = queue(max_requests=1, max_pending=0)
    q.refuse_if_full([busy, idle])  # idle has room
    with pytest.raises(Overloaded):
        q.refuse_if_full([busy])
    queue(max_requests=0, max_pending=0).refuse_if_full([busy])  # no limit at all
