"""Envoy's circuit breakers for one cluster: an in-flight limit per endpoint and a bounded queue of
requests waiting for room, woken in order as endpoints free up."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterable

from modelyard.balancing.routes import ALL_SUBSETS
from modelyard.cluster import Endpoint
from modelyard.config import CircuitBreakerConfig
from modelyard.errors import Overloaded

_Waiter = tuple[str, asyncio.Future[None]]  # (the subset it wants, the future that wakes it)


class CapacityQueue:
    def __init__(self, model: str, config: CircuitBreakerConfig) -> None:
        self._model = model
        self.config = config
        self._waiters: deque[_Waiter] = deque()

    def has_room(self, endpoint: Endpoint) -> bool:
        limit = self.config.max_requests
        return limit == 0 or endpoint.in_flight < limit

    def refuse_if_full(self, endpoints: Iterable[Endpoint]) -> None:
        """Raise Overloaded (429) when a request could not be taken anyway: every endpoint at
        `max_requests` and the queue full. Lets a server refuse before reading a body."""
        if (
            self.config.max_requests
            and len(self._waiters) >= self.config.max_pending_requests
            and not any(self.has_room(e) for e in endpoints)
        ):
            raise self._full()

    def queued_for(self, subset: str) -> bool:
        """Requests wait for an endpoint that a request for `subset` could also take: a newcomer
        queues behind them rather than jumping the queue."""
        if not self._waiters:
            return False
        return any(
            not waiter.done() and (subset == ALL_SUBSETS or wanted in (subset, ALL_SUBSETS))
            for wanted, waiter in self._waiters
        )

    async def wait(self, subset: str, until: float) -> None:
        """Wait until an endpoint of `subset` frees up, or until `until` (monotonic time, one
        deadline across re-waits); raises Overloaded (429 with Retry-After) when the queue is full
        or time is up."""
        if len(self._waiters) >= self.config.max_pending_requests:
            raise self._full()
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (subset, waiter)
        self._waiters.append(entry)
        try:
            async with asyncio.timeout(max(0.0, until - time.monotonic())):
                await waiter
        except TimeoutError:
            self._pass_on(entry)
            raise Overloaded(
                f"model {self._model!r} is at capacity: no endpoint freed up within "
                f"{self.config.queue_timeout:g}s"
            ) from None
        except asyncio.CancelledError:
            self._pass_on(entry)
            raise
        finally:
            if entry in self._waiters:
                self._waiters.remove(entry)

    def wake(self, subset: str) -> None:
        """An endpoint of `subset` freed up: wake the first waiter it can serve (a waiter for every
        endpoint of the model is served by any)."""
        for entry in self._waiters:
            wanted, waiter = entry
            if not waiter.done() and wanted in (subset, ALL_SUBSETS):
                self._waiters.remove(entry)
                waiter.set_result(None)
                return

    def wake_all(self) -> None:
        """The endpoints changed: every waiter looks again (and waits again, to its own deadline)."""
        while self._waiters:
            _subset, waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    def __len__(self) -> int:
        return len(self._waiters)

    def _pass_on(self, entry: _Waiter) -> None:
        subset, waiter = entry
        if waiter.done() and not waiter.cancelled():
            self.wake(subset)  # woken, but leaving anyway (timed out or cancelled): the next one goes

    def _full(self) -> Overloaded:
        return Overloaded(
            f"model {self._model!r} is at capacity: every endpoint has max_requests in flight and "
            f"{self.config.max_pending_requests} requests already wait"
        )
