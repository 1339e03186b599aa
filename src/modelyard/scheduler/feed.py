"""The gateway feed: each model's entry (where its traffic may go), and the hub that fans feed lines
out to `GET /v1/feed` readers.

A reader that falls behind must never slow the scheduler: each has a bounded queue, and one that
fills up is dropped (its response ends), so it reconnects and starts again from a fresh snapshot.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from modelyard.placement import ModelState, routable_assignment, traffic_split
from modelyard.scheduler.records import Model, Server, ServerReplica, Version

FeedLine = dict[str, Any]


def feed_entry(model: Model, servers: Mapping[str, Server]) -> FeedLine:
    """`{"name", "version", "state", "reason", "available_replicas", "unavailable_replicas",
    "endpoints", "versions"}` per docs/placement.md: the state, reason and replica counts are the
    latest version's, as `GET /v1/models` gives them (the gateway's dashboard shows them).

    During a rollout the entry names both versions' routable replicas, and `versions` gives each
    version's share of the traffic (`traffic_split`, compat §6.2 step 3): while the latest version
    has routable replicas but is not ModelAvailable, and an older version still has routable
    replicas (the cleaner has not retired it). Seldon's condition is "the last ModelAvailable
    version is not the latest"; here a superseded version's status turns ModelTerminating as soon
    as a new version is applied, so the one that still serves is the newest older one routable.
    Otherwise the entry names the routable replicas of the latest version, or while it has none,
    of the newest version that has some (the old version keeps serving during a move), with the
    whole share. Each endpoint says its version. A replica where the new version was placed over
    the old one serves the new one only: two versions are never loaded side by side on a replica."""
    latest = model.latest
    groups: list[tuple[Version, list[ServerReplica]]] = []
    new = _routable(latest, servers) if latest.status.state is not ModelState.AVAILABLE else []
    if new:
        taken = {r.key for r in new}
        for version in reversed(model.versions[:-1]):
            if old := [r for r in _routable(version, servers) if r.key not in taken]:
                groups = [(version, old), (latest, new)]
                break
    if not groups:
        for version in reversed(model.versions):
            if replicas := _routable(version, servers):
                groups = [(version, replicas)]
                break
    shares = [100] * len(groups)
    if len(groups) == 2:
        split = traffic_split(len(groups[0][1]), len(groups[1][1]))
        assert split is not None  # both groups have replicas
        shares = list(split)
    return {
        "name": model.name,
        "version": latest.version,
        "state": latest.status.state.value,
        "reason": latest.status.reason,
        "available_replicas": latest.status.available,
        "unavailable_replicas": latest.status.unavailable,
        "endpoints": [
            {"name": r.endpoint_name, "url": r.inference_url, "version": version.version}
            for version, replicas in groups
            for r in replicas
        ],
        "versions": [
            {"version": version.version, "weight": share}
            for (version, _), share in zip(groups, shares, strict=True)
        ],
    }


def _routable(version: Version, servers: Mapping[str, Server]) -> list[ServerReplica]:
    """The server replicas the version's traffic may go to (`routable_assignment`), by index."""
    server = servers.get(version.server) if version.server is not None else None
    if server is None:
        return []
    found = (server.replicas.get(index) for index in routable_assignment(version.states()))
    return [replica for replica in found if replica is not None]


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
