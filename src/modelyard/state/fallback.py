"""Remote state with a local fallback: routing never waits on, or fails because of, Redis.

After a failure the remote store is skipped for a backoff period (doubling up to 30 s) and the
local store answers; each fall back is reported through `on_fallback` (a counter and a log line).

What the remote store missed is written back when it returns, so that gateways which each learnt
their own affinities meanwhile agree again: the keys set while it was away (or whose write failed)
after it answers again, and every live local key when its `epoch` changes (Redis restarted empty,
whether or not an operation failed in between). The write-back runs in a background task, in
batches of SET NX with each entry's remaining TTL: a value already there, set by another gateway's
write-back or by a request since, wins, and `get` reads the remote first, so every gateway follows
it. What waits for write-back is bounded by the local store's `max_entries`; a write-back that
fails part way stops, and the rest goes on the next return. `on_writeback` gets the number of keys
each write-back set (0 when other gateways' values were there first).

Channels go to the remote store only, with their own backoff (the same 0.5 s doubling to 30 s): a
publish that fails skips the remote for publishes only, and one logged line says so; a message
published meanwhile is dropped at once (`publish` answers False: its sender counts what it lost).
Publishing neither reads nor decides routing, so a slow or failed publish (a large message) never
sends `get` and `set` to the local store, nor counts in `on_fallback`; nor does a failed `get` stop
publishing. A subscription waits for the remote to return (the remote reconnects).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable

from modelyard.errors import StateUnavailable
from modelyard.state.base import MAX_BACKOFF, MIN_BACKOFF, RemoteState
from modelyard.state.memory import MemoryState

log = logging.getLogger("modelyard.state")

_WRITEBACK_BATCH = 256  # SETs per pipelined round trip


class FallbackState:
    def __init__(
        self,
        remote: RemoteState,
        local: MemoryState,
        *,
        on_fallback: Callable[[Exception], None] | None = None,
        on_writeback: Callable[[int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._remote = remote
        self._local = local
        self._on_fallback = on_fallback
        self._on_writeback = on_writeback
        self._clock = clock
        self._retry_at = 0.0
        self._backoff = MIN_BACKOFF
        self._publish_retry_at = 0.0  # channels: their own backoff
        self._publish_backoff = MIN_BACKOFF
        self._epoch: str | None = None
        self._unsynced: OrderedDict[str, None] = OrderedDict()  # keys the remote may lack, oldest first
        self._writeback: asyncio.Task[None] | None = None
        self._writeback_wanted = False
        self._closed = False

    @property
    def degraded(self) -> bool:
        return self._retry_at > self._clock()

    @property
    def unsynced(self) -> int:
        """Keys waiting to be written back to the remote store."""
        return len(self._unsynced)

    async def get(self, key: str) -> str | None:
        if not self.degraded:
            try:
                value = await self._remote.get(key)
            except StateUnavailable as exc:
                self._failed(exc)
            else:
                self._succeeded()
                if value is not None:
                    return value
        # Also what was learnt locally while the remote was away.
        return await self._local.get(key)

    async def set(self, key: str, value: str, ttl: float) -> None:
        await self._local.set(key, value, ttl)
        if self.degraded:
            self._note_unsynced(key)
            return
        try:
            await self._remote.set(key, value, ttl)
        except StateUnavailable as exc:
            self._note_unsynced(key)
            self._failed(exc)
        else:
            self._unsynced.pop(key, None)  # the remote holds the newest value
            self._succeeded()

    @property
    def publish_degraded(self) -> bool:
        """Publishes are dropped without asking the remote (after one failed)."""
        return self._publish_retry_at > self._clock()

    async def publish(self, channel: str, payload: bytes) -> bool:
        if self.publish_degraded:
            return False
        try:
            await self._remote.publish(channel, payload)
        except StateUnavailable as exc:
            if not self.publish_degraded:  # publishes in flight when it failed: one backoff step
                log.warning(
                    "shared state channels unavailable, messages dropped for %.1fs: %s",
                    self._publish_backoff,
                    exc,
                )
                self._publish_retry_at = self._clock() + self._publish_backoff
                self._publish_backoff = min(self._publish_backoff * 2, MAX_BACKOFF)
            return False
        if self._publish_backoff != MIN_BACKOFF:
            log.info("shared state channels reachable again")
            self._publish_backoff = MIN_BACKOFF
        return True

    def subscribe(self, channel: str) -> AsyncIterator[bytes]:
        return self._remote.subscribe(channel)

    async def close(self) -> None:
        self._closed = True
        if self._writeback is not None:
            self._writeback.cancel()
            await asyncio.wait([self._writeback])
        await self._remote.close()
        await self._local.close()

    def _failed(self, exc: Exception) -> None:
        if self.degraded:
            return  # requests already in flight when it failed: one outage, one backoff step
        if self._on_fallback is not None:
            self._on_fallback(exc)
        log.warning("shared state unavailable, routing on local state for %.1fs: %s", self._backoff, exc)
        self._retry_at = self._clock() + self._backoff
        self._backoff = min(self._backoff * 2, MAX_BACKOFF)

    def _succeeded(self) -> None:
        epoch = self._remote.epoch
        if epoch is not None and epoch != self._epoch:
            if self._epoch is not None:
                log.info(
                    "shared state restarted (epoch %s -> %s), writing local state back", self._epoch, epoch
                )
                self._unsynced.update(dict.fromkeys(self._local.all_keys()))
                self._bound_unsynced()
                self._start_writeback()
            self._epoch = epoch
        if self._backoff != MIN_BACKOFF:
            log.info("shared state reachable again")
            self._backoff = MIN_BACKOFF
            self._start_writeback()

    def _note_unsynced(self, key: str) -> None:
        self._unsynced[key] = None
        self._unsynced.move_to_end(key)
        self._bound_unsynced()

    def _bound_unsynced(self) -> None:
        while len(self._unsynced) > self._local.max_entries:
            self._unsynced.popitem(last=False)  # evicted from the local store first anyway

    def _start_writeback(self) -> None:
        if self._closed or not self._unsynced:
            return
        self._writeback_wanted = True
        if self._writeback is None or self._writeback.done():
            self._writeback = asyncio.get_running_loop().create_task(
                self._writeback_loop(), name="modelyard-state-writeback"
            )

    async def _writeback_loop(self) -> None:
        while self._writeback_wanted:  # once more when asked again while writing back
            self._writeback_wanted = False
            try:
                await self._write_back()
            except Exception:  # a bug must not kill the task silently, nor reach routing
                log.exception("shared state write-back failed")

    async def _write_back(self) -> None:
        pending = list(self._unsynced)
        written = 0
        try:
            for start in range(0, len(pending), _WRITEBACK_BATCH):
                if self.degraded:
                    return  # gone again: the rest waits for the next return
                batch = pending[start : start + _WRITEBACK_BATCH]
                # Values and remaining TTLs as they are now: a key set again since goes with
                # its newest value, one expired or evicted since is skipped.
                entries = self._local.entries(batch)
                try:
                    written += await self._remote.set_many_if_absent(entries)
                except StateUnavailable as exc:
                    self._failed(exc)
                    return
                for key in batch:
                    self._unsynced.pop(key, None)
        finally:
            if pending:
                log.info("wrote %d of %d keys back to shared state", written, len(pending))
                if self._on_writeback is not None:
                    self._on_writeback(written)
