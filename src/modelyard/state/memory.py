"""In-process state: a TTL map bounded to `max_entries` with least-recently-used eviction, and
channels delivered within the process (a gateway alone has no peers; tests run several in one)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterable, Sequence

from modelyard.state.base import Entry

_SUBSCRIBER_QUEUE = 1024  # messages a slow subscriber may fall behind by before it loses some


class MemoryState:
    def __init__(self, max_entries: int = 100_000, clock: Callable[[], float] = time.monotonic) -> None:
        self._entries: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._max_entries = max_entries
        self._clock = clock
        self._epoch = uuid.uuid4().hex  # what is set here lives as long as this object
        self._subscribers: dict[str, set[asyncio.Queue[bytes]]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def max_entries(self) -> int:
        return self._max_entries

    @property
    def epoch(self) -> str:
        return self._epoch

    async def get(self, key: str) -> str | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        value, expires = entry
        if expires <= self._clock():
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return value

    async def set(self, key: str, value: str, ttl: float) -> None:
        self.set_until(key, value, self._clock() + ttl)

    def set_until(self, key: str, value: str, expires: float) -> None:
        """Set `key` until `expires`, an instant of this state's clock."""
        self._entries[key] = (value, expires)
        self._entries.move_to_end(key)
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)

    def held(self, key: str) -> tuple[str, float] | None:
        """(value, when it expires) of a live `key`; its recency is left as it is."""
        entry = self._entries.get(key)
        return entry if entry is not None and entry[1] > self._clock() else None

    async def set_many_if_absent(self, entries: Sequence[Entry]) -> int:
        now = self._clock()
        written = 0
        for key, value, ttl in entries:
            held = self._entries.get(key)
            if held is None or held[1] <= now:
                await self.set(key, value, ttl)
                written += 1
        return written

    def all_keys(self) -> list[str]:
        """Every key held, least recently used first (some may have expired)."""
        return list(self._entries)

    def entries(self, keys: Iterable[str]) -> list[Entry]:
        """The live entries among `keys`, with the time each has left; recency is left as it is."""
        now = self._clock()
        found = []
        for key in keys:
            held = self._entries.get(key)
            if held is not None and held[1] > now:
                found.append(Entry(key, held[0], held[1] - now))
        return found

    async def publish(self, channel: str, payload: bytes) -> bool:
        for queue in self._subscribers.get(channel, ()):
            if not queue.full():  # one that falls behind loses messages, as on Redis
                queue.put_nowait(payload)
        return True

    async def subscribe(self, channel: str) -> AsyncIterator[bytes]:
        queue: asyncio.Queue[bytes] = asyncio.Queue(_SUBSCRIBER_QUEUE)
        subscribers = self._subscribers.setdefault(channel, set())
        subscribers.add(queue)
        try:
            while True:
                yield await queue.get()
        finally:
            subscribers.discard(queue)
            if not subscribers and self._subscribers.get(channel) is subscribers:
                del self._subscribers[channel]

    async def close(self) -> None:
        self._entries.clear()
