"""The circuit breakers' wait queue under overload: the highest priority first, tenants in turn
within a priority (a tenant with one request waiting before a backlog), first come first served
within a tenant; a full queue sheds the lowest priority's (and a flooding tenant's) newest waiter.
No timers: each test drives the event loop one turn at a time."""

from __future__ import annotations

import asyncio
import time

import pytest

from modelyard.balancing.routes import ALL_SUBSETS
from modelyard.cluster import BackendLoad, Endpoint
from modelyard.config import CircuitBreakerConfig
from modelyard.errors import Overloaded
from modelyard.gateway.capacity import CapacityQueue


def queue(max_pending: int = 10) -> CapacityQueue:
    return CapacityQueue("m", CircuitBreakerConfig(max_requests=1, max_pending_requests=max_pending))


def far() -> float:
    return time.monotonic() + 60


class Waiting:
    """Waiters by name, started one at a time; `woken` says in which order wakes reached them."""

    def __init__(self, q: CapacityQueue) -> None:
        self.q = q
        self.tasks: dict[str, asyncio.Task[None]] = {}

    async def add(
        self, name: str, tenant: str = "", priority: int = 0, subset: str = "default", *, sheds: bool = False
    ) -> None:
        before = len(self.q)
        self.tasks[name] = asyncio.create_task(self.q.wait(subset, far(), tenant, priority))
        await asyncio.sleep(0)  # one turn of the loop: the task runs up to its await
        assert len(self.q) == before + (0 if sheds else 1)  # (one that sheds takes another's place)

    async def woken(self, times: int, subset: str = "default") -> list[str]:
        order = []
        for _ in range(times):
            pending = {name for name, task in self.tasks.items() if not task.done()}
            self.q.wake(subset)
            await asyncio.sleep(0)  # the woken task runs to its end
            order += [name for name in pending if self.tasks[name].done()]
        return order


def full_endpoint() -> Endpoint:
    load = BackendLoad("http://e", "e", in_flight=1)
    return Endpoint("e", load.url, load)


async def test_a_higher_priority_is_woken_first_whatever_came_first() -> None:
    w = Waiting(queue())
    await w.add("low1", "a", 0)
    await w.add("mid", "b", 5)
    await w.add("low2", "a", 0)
    await w.add("high", "c", 10)
    assert await w.woken(4) == ["high", "mid", "low1", "low2"]
    assert len(w.q) == 0


async def test_a_tenant_with_one_request_waiting_goes_before_a_backlog() -> None:
    w = Waiting(queue())
    for name in ("a1", "a2", "a3"):
        await w.add(name, "a")
    await w.add("b1", "b")  # tenant a floods; b's one request waits for one endpoint to free up
    assert await w.woken(4) == ["b1", "a1", "a2", "a3"]


async def test_backlogged_tenants_take_turns_each_in_its_own_order() -> None:
    w = Waiting(queue())
    for name in ("a1", "a2", "a3", "b1", "b2", "b3"):
        await w.add(name, name[0])
    assert await w.woken(6) == ["a1", "b1", "a2", "b2", "a3", "b3"]


async def test_a_tenant_served_as_new_waits_its_turn_the_next_time() -> None:
    w = Waiting(queue())
    for name in ("a1", "a2", "a3"):
        await w.add(name, "a")
    await w.add("b1", "b")
    assert await w.woken(1) == ["b1"]
    await w.add("b2", "b")  # one at a time is no way to stay ahead: b now takes turns with a
    assert await w.woken(4) == ["a1", "b2", "a2", "a3"]


async def test_a_tenant_alone_is_first_come_first_served() -> None:
    w = Waiting(queue())
    for name in ("x1", "x2", "x3"):
        await w.add(name)  # auth off: every request is tenant "" at priority 0
    assert await w.woken(3) == ["x1", "x2", "x3"]


async def test_a_freed_endpoint_goes_to_the_first_waiter_in_order_that_can_take_it() -> None:
    w = Waiting(queue())
    await w.add("high-wants-b", "a", 5, subset="b")
    await w.add("low-any", "a", 0, subset=ALL_SUBSETS)
    assert await w.woken(1, subset="a") == ["low-any"]
    assert await w.woken(1, subset="b") == ["high-wants-b"]


async def test_a_full_queue_sheds_the_newest_lowest_priority_waiter_for_a_higher_one() -> None:
    w = Waiting(queue(max_pending=3))
    await w.add("low1", "a", 0)
    await w.add("low2", "a", 0)
    await w.add("mid", "b", 1)
    await w.add("high", "c", 5, sheds=True)  # full: low2 (the newest of the lowest priority) makes room
    with pytest.raises(Overloaded, match="shed for higher-priority traffic") as info:
        await w.tasks["low2"]
    assert info.value.status == 429 and info.value.headers == {"Retry-After": "1"}
    assert len(w.q) == 3
    assert await w.woken(3) == ["high", "mid", "low1"]


async def test_the_shed_waiter_is_the_flooding_tenants_at_the_lowest_priority() -> None:
    w = Waiting(queue(max_pending=3))
    await w.add("a1", "a")
    await w.add("c1", "c")
    await w.add("c2", "c")
    await w.add("high", "b", 1, sheds=True)
    with pytest.raises(Overloaded):
        await w.tasks["c2"]
    assert await w.woken(3) == ["high", "a1", "c1"]


async def test_at_one_priority_a_full_queue_sheds_a_flood_for_another_tenant_not_for_its_own() -> None:
    w = Waiting(queue(max_pending=3))
    for name in ("a1", "a2", "a3"):
        await w.add(name, "a")
    with pytest.raises(Overloaded, match="already wait"):  # a's own newcomer: refused
        await w.q.wait("default", far(), "a", 0)
    await w.add("b1", "b", sheds=True)  # a has 3 waiting, b none: a's newest makes room
    with pytest.raises(Overloaded, match="another tenant's request"):
        await w.tasks["a3"]
    with pytest.raises(Overloaded, match="already wait"):  # a 2, b 1: shedding would only swap them
        await w.q.wait("default", far(), "b", 0)
    assert await w.woken(3) == ["b1", "a1", "a2"]


async def test_a_newcomer_that_may_shed_nobody_is_refused_and_refuse_if_full_agrees() -> None:
    w = Waiting(queue(max_pending=2))
    await w.add("p5", "a", 5)
    await w.add("p5-too", "b", 5)
    busy = [full_endpoint()]
    for tenant, priority in (("c", 0), ("c", 5), ("a", 5)):
        with pytest.raises(Overloaded, match="already wait"):
            w.q.refuse_if_full(busy, tenant, priority)
        with pytest.raises(Overloaded, match="already wait"):
            await w.q.wait("default", far(), tenant, priority)
    w.q.refuse_if_full(busy, "c", 6)  # a higher priority would shed one: not refused before its body
    assert len(w.q) == 2
    assert await w.woken(2) == ["p5", "p5-too"]


async def test_queued_for_counts_only_waiters_of_the_newcomers_priority_or_higher() -> None:
    w = Waiting(queue())
    assert not w.q.queued_for(ALL_SUBSETS, 0)
    await w.add("low", "a", 0)
    assert w.q.queued_for(ALL_SUBSETS, 0) and w.q.queued_for("default", -3)
    assert not w.q.queued_for(ALL_SUBSETS, 1)  # a higher priority does not queue behind it
    assert not w.q.queued_for("other", 0)  # nor a request for endpoints it does not want
    await w.add("high", "b", 7)
    assert w.q.queued_for(ALL_SUBSETS, 7) and not w.q.queued_for(ALL_SUBSETS, 8)
    await w.woken(2)
    assert not w.q.queued_for(ALL_SUBSETS, -100)


async def test_a_cancelled_waiter_leaves_and_a_woken_one_passes_its_turn_on_in_order() -> None:
    w = Waiting(queue())
    for name in ("a1", "a2"):
        await w.add(name, "a")
    await w.add("b1", "b")
    await w.add("c1", "c")
    w.tasks["c1"].cancel()  # its client left while it waited
    await asyncio.gather(w.tasks["c1"], return_exceptions=True)
    assert len(w.q) == 3
    w.q.wake("default")  # b1 is woken...
    w.tasks["b1"].cancel()  # ...but its client has gone before it ran: the turn goes on to a1
    await asyncio.gather(w.tasks["b1"], return_exceptions=True)
    await asyncio.sleep(0)
    assert w.tasks["a1"].done() and not w.tasks["a2"].done()
    assert await w.woken(1) == ["a2"]
    assert len(w.q) == 0 and not w.q.queued_for(ALL_SUBSETS)


async def test_time_up_leaves_the_queue_with_429_and_the_others_in_order() -> None:
    w = Waiting(queue())
    await w.add("a1", "a")
    await w.add("a2", "a")
    with pytest.raises(Overloaded, match="no endpoint freed up"):
        await w.q.wait("default", time.monotonic(), "b", 3)  # its deadline has passed already
    assert len(w.q) == 2 and not w.q.queued_for(ALL_SUBSETS, 3)
    assert await w.woken(2) == ["a1", "a2"]


async def test_wake_all_wakes_every_waiter_and_empties_the_queue() -> None:
    w = Waiting(queue())
    await w.add("a1", "a", 0)
    await w.add("b1", "b", 9)
    await w.add("a2", "a", 0)
    w.q.wake_all()
    await asyncio.sleep(0)
    assert all(task.done() for task in w.tasks.values())
    assert len(w.q) == 0 and not w.q.queued_for(ALL_SUBSETS, -100)
    await w.add("c1", "c", 1)  # and it works as new afterwards
    assert await w.woken(1) == ["c1"]
