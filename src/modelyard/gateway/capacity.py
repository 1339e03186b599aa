"""Envoy's circuit breakers for one cluster: an in-flight limit per endpoint and a bounded queue of
requests waiting for room, woken in order as endpoints free up.

The order (auth.enabled gives each request its key's tenant and priority; with auth off every
request is tenant "" at priority 0, and the queue is plain FIFO):
- a higher priority first, always;
- within a priority, fair between tenants: a tenant with a single request waiting is served before
  the tenants with a backlog, and those take turns one request at a time (fq_codel's new and old
  flows, with a tenant for a flow). A light tenant's request so waits for the next endpoint to free
  up, not for a round of the flooding tenants': each of those waits behind its own requests. (Plain
  round-robin would put a tenant that joins behind every backlogged one; "least recently served"
  needs a clock per tenant. A tenant served as new joins the back of the rotation even with nothing
  left waiting, so sending one request at a time cannot keep it ahead of the others.);
- within a tenant, first come first served.
A full queue takes a newcomer only by shedding a waiter (Overloaded, 429): one of a lower priority,
or, at the newcomer's priority, one of a tenant with at least two more requests waiting than the
newcomer's; the shed one is the newest of the tenant with the most waiting at the lowest priority
(a flood is shed before the tenants it would crowd out).
A newcomer queues behind the waiters of its priority or higher, whatever their tenant (an endpoint
free while they wait is one promised to a waiter already woken; fairness serves the newcomer at
the next one if it is its turn), and never behind lower priorities: no endpoint stays idle while
a request waits. A wake looks at the head of each tenant's FIFO in turn (the first usually takes
it; waiters for another subset are passed over), so it costs about the number of tenants waiting.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterable

from modelyard.balancing.routes import ALL_SUBSETS
from modelyard.cluster import Endpoint
from modelyard.config import CircuitBreakerConfig
from modelyard.errors import Overloaded


class _Waiter:
    """One request waiting for room: the subset it wants, who sent it, the future that wakes it."""

    __slots__ = ("future", "priority", "subset", "tenant")

    def __init__(self, subset: str, tenant: str, priority: int, future: asyncio.Future[None]) -> None:
        self.subset = subset
        self.tenant = tenant
        self.priority = priority
        self.future = future

    def serves(self, subset: str) -> bool:
        """An endpoint of `subset` freed up: this waiter may take it."""
        return not self.future.done() and self.subset in (subset, ALL_SUBSETS)


class _Level:
    """The waiters of one priority: per tenant a FIFO; tenants with one request waiting and no
    turn in the rotation first (`fresh`, in arrival order), then the backlogged ones in turn
    (`rotation`, its first the next served). A tenant is in one of them at most; one in `rotation`
    may have nothing waiting (it was served as new, or its waiters left), and is dropped when its
    turn comes."""

    __slots__ = ("count", "fresh", "rotation")

    def __init__(self) -> None:
        self.fresh: dict[str, deque[_Waiter]] = {}
        self.rotation: dict[str, deque[_Waiter]] = {}
        self.count = 0

    def add(self, waiter: _Waiter) -> None:
        tenant = waiter.tenant
        waiters = self.rotation.get(tenant)
        if waiters is not None:
            waiters.append(waiter)
        else:
            waiters = self.fresh.pop(tenant, None)
            if waiters is None:
                self.fresh[tenant] = deque((waiter,))
            else:  # a second one waiting: a backlog, at the back of the turns
                waiters.append(waiter)
                self.rotation[tenant] = waiters
        self.count += 1

    def tenant_waiters(self, tenant: str) -> deque[_Waiter] | None:
        waiters = self.fresh.get(tenant)
        return waiters if waiters is not None else self.rotation.get(tenant)

    def remove(self, waiter: _Waiter) -> bool:
        waiters = self.tenant_waiters(waiter.tenant)
        if waiters is None or waiter not in waiters:
            return False
        waiters.remove(waiter)
        self.count -= 1
        if not waiters and waiter.tenant in self.fresh:  # (never served: it leaves no turn behind)
            del self.fresh[waiter.tenant]
        return True

    def take(self, subset: str) -> _Waiter | None:
        """The next waiter an endpoint of `subset` can serve, out of the queue, the turns moved on."""
        new = next(((t, q, w) for t, q in self.fresh.items() if (w := _first(q, subset)) is not None), None)
        if new is not None:
            tenant, waiters, found = new
            del self.fresh[tenant]
            self.rotation[tenant] = waiters  # to the back of the rotation, even with none left
            return self._taken(waiters, found)
        idle: list[str] = []
        chosen: tuple[str, deque[_Waiter], _Waiter] | None = None
        for tenant, waiters in self.rotation.items():
            if not waiters:
                idle.append(tenant)
                continue
            first = _first(waiters, subset)
            if first is not None:
                chosen = (tenant, waiters, first)
                break
        for tenant in idle:  # (their turn came with nothing waiting: out of the rotation)
            del self.rotation[tenant]
        if chosen is None:
            return None
        tenant, waiters, found = chosen
        del self.rotation[tenant]
        if len(waiters) > 1:
            self.rotation[tenant] = waiters  # to the back
        return self._taken(waiters, found)

    def _taken(self, waiters: deque[_Waiter], found: _Waiter) -> _Waiter:
        if waiters[0] is found:
            waiters.popleft()
        else:
            waiters.remove(found)
        self.count -= 1
        return found

    def competes(self, subset: str) -> bool:
        """Some waiter here wants an endpoint that a request for `subset` could also take."""
        anywhere = subset == ALL_SUBSETS
        for waiters in (*self.fresh.values(), *self.rotation.values()):
            for w in waiters:
                if not w.future.done() and (anywhere or w.subset in (subset, ALL_SUBSETS)):
                    return True
        return False

    def longest(self) -> deque[_Waiter] | None:
        """The waiters of the tenant with the most waiting."""
        return max((*self.fresh.values(), *self.rotation.values()), key=len, default=None)


def _first(waiters: deque[_Waiter], subset: str) -> _Waiter | None:
    for waiter in waiters:
        if waiter.serves(subset):
            return waiter
    return None


class CapacityQueue:
    def __init__(self, model: str, config: CircuitBreakerConfig) -> None:
        self._model = model
        self.config = config
        self._levels: dict[int, _Level] = {}
        self._priorities: list[int] = []  # those in _levels, the highest first
        self._count = 0

    def has_room(self, endpoint: Endpoint) -> bool:
        limit = self.config.max_requests
        return limit == 0 or endpoint.in_flight < limit

    def refuse_if_full(self, endpoints: Iterable[Endpoint], tenant: str = "", priority: int = 0) -> None:
        """Raise Overloaded (429) when a request could not be taken anyway: every endpoint at
        `max_requests` and the queue full of requests it may not shed. Lets a server refuse before
        reading a body."""
        if (
            self.config.max_requests
            and self._count >= self.config.max_pending_requests
            and not any(self.has_room(e) for e in endpoints)
            and self._victim(tenant, priority) is None
        ):
            raise self._full()

    def queued_for(self, subset: str, priority: int = 0) -> bool:
        """Requests of `priority` or higher wait for an endpoint that a request for `subset` could
        also take: a newcomer queues behind them rather than jumping the queue. (A newcomer of a
        tenant with nothing waiting queues too: it is served when the next endpoint frees up.)"""
        if not self._count:
            return False
        for level_priority in self._priorities:
            if level_priority < priority:
                return False
            if self._levels[level_priority].competes(subset):
                return True
        return False

    async def wait(self, subset: str, until: float, tenant: str = "", priority: int = 0) -> None:
        """Wait until an endpoint of `subset` frees up, or until `until` (monotonic time, one
        deadline across re-waits); raises Overloaded (429 with Retry-After) when the queue is full
        (and the request may shed no waiter), when time is up, or when it is shed itself."""
        if self._count >= self.config.max_pending_requests:
            victim = self._victim(tenant, priority)
            if victim is None:
                raise self._full()
            self._shed(victim, priority)
        waiter = _Waiter(subset, tenant, priority, asyncio.get_running_loop().create_future())
        self._add(waiter)
        try:
            async with asyncio.timeout(max(0.0, until - time.monotonic())):
                await waiter.future
        except TimeoutError:
            self._pass_on(waiter)
            raise Overloaded(
                f"model {self._model!r} is at capacity: no endpoint freed up within "
                f"{self.config.queue_timeout:g}s"
            ) from None
        except asyncio.CancelledError:
            self._pass_on(waiter)
            raise
        finally:
            self._remove(waiter)

    def wake(self, subset: str) -> None:
        """An endpoint of `subset` freed up: wake the next waiter it can serve (a waiter for every
        endpoint of the model is served by any): the highest priority, the tenants in turn."""
        for priority in self._priorities:
            level = self._levels[priority]
            waiter = level.take(subset)
            if waiter is not None:
                self._count -= 1
                if not level.count:
                    self._drop_level(priority)
                waiter.future.set_result(None)
                return

    def wake_all(self) -> None:
        """The endpoints changed: every waiter looks again (and waits again, to its own deadline)."""
        levels = self._levels
        self._levels, self._priorities, self._count = {}, [], 0
        for level in levels.values():
            for waiters in (*level.fresh.values(), *level.rotation.values()):
                for waiter in waiters:
                    if not waiter.future.done():
                        waiter.future.set_result(None)

    def __len__(self) -> int:
        return self._count

    def _add(self, waiter: _Waiter) -> None:
        level = self._levels.get(waiter.priority)
        if level is None:
            level = self._levels[waiter.priority] = _Level()
            self._priorities.append(waiter.priority)
            self._priorities.sort(reverse=True)  # (a handful of priorities at most)
        level.add(waiter)
        self._count += 1

    def _remove(self, waiter: _Waiter) -> None:
        level = self._levels.get(waiter.priority)
        if level is not None and level.remove(waiter):
            self._count -= 1
            if not level.count:
                self._drop_level(waiter.priority)

    def _drop_level(self, priority: int) -> None:
        del self._levels[priority]
        self._priorities.remove(priority)

    def _victim(self, tenant: str, priority: int) -> _Waiter | None:
        """The waiter a newcomer to a full queue may shed: the newest of the tenant with the most
        waiting at the lowest priority, when that priority is lower than the newcomer's, or the same
        and that tenant has at least two more waiting than the newcomer's (so that shedding evens
        the tenants out rather than swapping which one is ahead); None: the newcomer is refused."""
        if not self._priorities:
            return None
        lowest = self._priorities[-1]
        if priority < lowest:
            return None
        level = self._levels[lowest]
        longest = level.longest()
        if not longest:
            return None
        if priority == lowest:
            own = level.tenant_waiters(tenant)
            if len(longest) < (len(own) if own is not None else 0) + 2:
                return None
        for waiter in reversed(longest):
            if not waiter.future.done():
                return waiter
        return None

    def _shed(self, victim: _Waiter, priority: int) -> None:
        self._remove(victim)
        if victim.priority < priority:
            why = "higher-priority traffic"
        else:
            why = "another tenant's request: its tenant had the most requests waiting"
        victim.future.set_exception(
            Overloaded(
                f"model {self._model!r} is at capacity: this request waited for an endpoint and was "
                f"shed for {why}"
            )
        )

    def _pass_on(self, waiter: _Waiter) -> None:
        future = waiter.future
        if future.done() and not future.cancelled() and future.exception() is None:
            self.wake(waiter.subset)  # woken, but leaving anyway (timed out or cancelled): the next one goes

    def _full(self) -> Overloaded:
        return Overloaded(
            f"model {self._model!r} is at capacity: every endpoint has max_requests in flight and "
            f"{self.config.max_pending_requests} requests already wait"
        )
