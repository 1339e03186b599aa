"""Remote state with a local fallback: routing never waits on, or fails because of, Redis.

After a failure the remote store is skipped for a backoff period (doubling up to 30 s) and the
local store answers; each fall back is reported through `on_fallback` (a counter and a log line).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from modelyard.errors import StateUnavailable
from modelyard.state.base import SharedState

log = logging.getLogger("modelyard.state")

_MIN_BACKOFF = 0.5
_MAX_BACKOFF = 30.0


class FallbackState:
    def __init__(
        self,
        remote: SharedState,
        local: SharedState,
        *,
        on_fallback: Callable[[Exception], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._remote = remote
        self._local = local
        self._on_fallback = on_fallback
        self._clock = clock
        self._retry_at = 0.0
        self._backoff = _MIN_BACKOFF

    @property
    def degraded(self) -> bool:
        return self._retry_at > self._clock()

    async def get(self, key: str) -> str | None:
        if not self.degraded:
            try:
                value = await self._remote.get(key)
            except StateUnavailable as exc:
                self._failed(exc)
            else:
                self._recovered()
                if value is not None:
                    return value
        # Also what was learnt locally while the remote was away.
        return await self._local.get(key)

    async def set(self, key: str, value: str, ttl: float) -> None:
        await self._local.set(key, value, ttl)
        if not self.degraded:
            try:
                await self._remote.set(key, value, ttl)
            except StateUnavailable as exc:
                self._failed(exc)
            else:
                self._recovered()

    async def close(self) -> None:
        await self._remote.close()
        await self._local.close()

    def _failed(self, exc: Exception) -> None:
        if self.degraded:
            return  # requests already in flight when it failed: one outage, one backoff step
        if self._on_fallback is not None:
            self._on_fallback(exc)
        log.warning("shared state unavailable, routing on local state for %.1fs: %s", self._backoff, exc)
        self._retry_at = self._clock() + self._backoff
        self._backoff = min(self._backoff * 2, _MAX_BACKOFF)

    def _recovered(self) -> None:
        if self._backoff != _MIN_BACKOFF:
            log.info("shared state reachable again")
            self._backoff = _MIN_BACKOFF
