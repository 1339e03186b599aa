"""The gateway feed: each model's entry (where its traffic may go), and the hub that fans feed lines
out to `GET /v1/feed` readers.

A reader that falls behind must never slow the scheduler: each has a bounded queue, and one that
fills up is dropped (its response ends), so it reconnects and starts again from a fresh snapshot.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from modelyard.placement import routable_assignment
from modelyard.scheduler.records import Model, Server

FeedLine = dict[str, Any]


def feed_entry(model: Model, servers: Mapping[str, Server]) -> FeedLine:
    """`{"name", "version", "state", "reason", "endpoints"}` per docs/placement.md: the routable
    replicas of the latest version, or while it has none, of the newest version that has some.

    Unlike Seldon, which splits traffic between the old and new version during a rollout (and can
    divide by zero doing it, compat §6.2), traffic goes to one version: the newest that can serve."""
    latest = model.latest
    endpoints: list[dict[str, str]] = []
    for version in reversed(model.versions):
        server = servers.get(version.server) if version.server is not None else None
        indexes = routable_assignment(version.states()) if server is not None else ()
        if server is None or not indexes:
            continue
        for index in indexes:
            replica = server.replicas.get(index)
            if replica is not None:
                endpoints.append({"name": replica.endpoint_name, "url": replica.inference_url})
        if endpoints:
            break
    return {
        "name": model.name,
        "version": latest.version,
        "state": latest.status.state.value,
        "reason": latest.status.reason,
        "endpoints": endpoints,
    }


class FeedHub:
    """Feed readers and the lines sent to them. `subscribe()` returns a queue that yields lines, then
    None when the reader was dropped (too slow) or the hub closed. A reader subscribing after
    `close()` (it connected while the scheduler was stopping) gets None at once: nothing would
    ever end it, and the HTTP server's shutdown would wait for it."""

    def __init__(self, queue_size: int = 1024) -> None:
        self._queue_size = queue_size
        self._readers: set[asyncio.Queue[FeedLine | None]] = set()
        self.dropped = 0
        self._closed = False

    @property
    def readers(self) -> int:
        return len(self._readers)

    def subscribe(self) -> asyncio.Queue[FeedLine | None]:
        # One slot more than the lines, so that the None that ends a dropped reader always fits.
        queue: asyncio.Queue[FeedLine | None] = asyncio.Queue(self._queue_size + 1)
        if self._closed:
            queue.put_nowait(None)
            return queue
        self._readers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[FeedLine | None]) -> None:
        self._readers.discard(queue)

    def publish(self, line: FeedLine) -> None:
        for queue in list(self._readers):
            if queue.qsize() >= self._queue_size:
                self._drop(queue)
            else:
                queue.put_nowait(line)

    def close(self) -> None:
        self._closed = True
        for queue in list(self._readers):
            self._drop(queue)

    def _drop(self, queue: asyncio.Queue[FeedLine | None]) -> None:
        self._readers.discard(queue)
        self.dropped += 1
        queue.put_nowait(None)
