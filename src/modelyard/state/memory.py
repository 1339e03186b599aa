"""In-process state: a TTL map bounded to `max_entries` with least-recently-used eviction."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable


class MemoryState:
    def __init__(self, max_entries: int = 100_000, clock: Callable[[], float] = time.monotonic) -> None:
        self._entries: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._max_entries = max_entries
        self._clock = clock

    def __len__(self) -> int:
        return len(self._entries)

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
        self._entries[key] = (value, self._clock() + ttl)
        self._entries.move_to_end(key)
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)

    async def close(self) -> None:
        self._entries.clear()
