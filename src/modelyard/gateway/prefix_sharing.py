"""Share prefix_aware's index between the gateways on one Redis.

Behind a load balancer each of N gateways sees 1/N of the traffic, and alone it would learn 1/N of
what the servers cache. What a gateway records after an answer (model, endpoint, the prompt's chunk
names: balancing/prefix.py) is also queued here without waiting, published in batches, and applied
by the other gateways to their PrefixIndex as if they had sent the prompt themselves.

- One channel, `prefix-index` under state.key_prefix: the gateways of one deployment share.
- A message is orjson `[1, sender, [[model, endpoint, [chunk, ...]], ...]]`: the format version,
  the sending gateway's random id, and records whose chunk names are 64-bit ints, each cut to the
  chunks an index keeps (the head of a prompt; its tail would be evicted first anyway).
- Batches go every `interval` (25 ms), or at once when `batch_records` wait, each under
  MAX_MESSAGE_BYTES. At most `max_pending` records wait; more are dropped and counted, as are the
  records of a batch the store did not take (Redis away: FallbackState drops them at once).
- Received: its own messages, unknown models and endpoints are skipped; a malformed or oversized
  message is skipped and logged at most once a minute. Nothing here raises into routing, and a
  gateway that is not told about a prompt only routes it as if alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple

import orjson

from modelyard.gateway.cluster import Cluster
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.state import SharedState

log = logging.getLogger("modelyard.gateway")

CHANNEL = "prefix-index"
VERSION = 1
MAX_MESSAGE_BYTES = 1 << 20  # a larger message is refused unread
MAX_RECORD_CHUNKS = 16_384  # per record, whatever the index's capacity
_BATCH_BYTES = MAX_MESSAGE_BYTES // 2  # what a batch is cut at, by an estimate of its size
_CHUNK_BYTES = 21  # the most one chunk name takes: 20 digits and a comma
_REPORT_EVERY = 60.0  # seconds between two logs of malformed messages


class Record(NamedTuple):
    """`endpoint` of `model` was sent a prompt with these chunk names."""

    model: str
    endpoint: str
    chunks: Sequence[int]


def encode(sender: str, records: Iterable[Record]) -> bytes:
    return orjson.dumps([VERSION, sender, [[r.model, r.endpoint, r.chunks] for r in records]])


def decode(payload: bytes) -> tuple[str, list[Record]]:
    """The sender and records of a message; ValueError when it is not one (too large, not JSON,
    another version, or a field of the wrong type)."""
    if len(payload) > MAX_MESSAGE_BYTES:
        raise ValueError(f"{len(payload)} bytes, more than {MAX_MESSAGE_BYTES}")
    data = orjson.loads(payload)  # orjson.JSONDecodeError is a ValueError
    if not (isinstance(data, list) and len(data) == 3 and data[0] == VERSION):
        raise ValueError(f"not a version {VERSION} message")
    _, sender, items = data
    if not isinstance(sender, str) or not isinstance(items, list):
        raise ValueError("sender or records of the wrong type")
    records = []
    for item in items:
        if not (isinstance(item, list) and len(item) == 3):
            raise ValueError("a record is not [model, endpoint, chunks]")
        model, endpoint, chunks = item
        if not (isinstance(model, str) and isinstance(endpoint, str) and isinstance(chunks, list)):
            raise ValueError("a record field of the wrong type")
        if len(chunks) > MAX_RECORD_CHUNKS or not all(type(name) is int for name in chunks):
            raise ValueError(f"a record's chunks are not at most {MAX_RECORD_CHUNKS} ints")
        records.append(Record(model, endpoint, chunks))
    return sender, records


def apply(clusters: Mapping[str, Cluster], records: Iterable[Record]) -> int:
    """Record each record in its model's index, as if this gateway had sent the prompt; the number
    applied (records of models or endpoints this gateway does not know are skipped)."""
    applied = 0
    for model, endpoint, chunks in records:
        cluster = clusters.get(model)
        if cluster is None or not chunks or not any(e.name == endpoint for e in cluster.endpoints):
            continue
        cluster.prefixes.record(chunks, endpoint)
        applied += 1
    return applied


def batch(pending: deque[Record], clusters: Mapping[str, Cluster], max_records: int) -> list[Record]:
    """Take the oldest pending records, up to `max_records` and the size of one message, each cut
    to the chunks its model's index keeps; at least one, when any is pending."""
    taken: list[Record] = []
    size = 0
    while pending and len(taken) < max_records:
        model, endpoint, chunks = pending[0]
        cluster = clusters.get(model)
        keep = min(MAX_RECORD_CHUNKS, cluster.prefixes.capacity if cluster is not None else 0)
        cost = len(model) + len(endpoint) + 16 + _CHUNK_BYTES * min(keep, len(chunks))
        if taken and size + cost > _BATCH_BYTES:
            break
        pending.popleft()
        size += cost
        if keep:
            taken.append(Record(model, endpoint, chunks[:keep] if len(chunks) > keep else chunks))
    return taken


class PrefixSharing:
    """One per gateway: `offer` from the request path, `start` and `stop` with the gateway."""

    def __init__(
        self,
        state: SharedState,
        clusters: Mapping[str, Cluster],
        metrics: GatewayMetrics,
        *,
        interval: float = 0.025,
        batch_records: int = 256,
        max_pending: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sender = os.urandom(8).hex()
        self._state = state
        self._clusters = clusters  # the gateway's own mapping: models placed later are found too
        self._interval = interval
        self._batch_records = batch_records
        self._max_pending = max_pending
        self._clock = clock
        self._pending: deque[Record] = deque()
        self._waiting = asyncio.Event()  # records are pending
        self._full = asyncio.Event()  # a whole batch is pending
        shared = metrics.prefix_index_shared
        self._sent, self._received, self._dropped = (
            shared.labels(d) for d in ("sent", "received", "dropped")
        )
        self._malformed = 0
        self._report_at = float("-inf")
        self._tasks: list[asyncio.Task[None]] = []

    def offer(self, model: str, endpoint: str, chunks: Sequence[int]) -> None:
        """`endpoint` of `model` was sent a prompt with these chunks (a list the caller no longer
        changes). Never waits: past `max_pending` waiting records, it is dropped."""
        if len(self._pending) >= self._max_pending:
            self._dropped.inc()
            return
        self._pending.append(Record(model, endpoint, chunks))
        self._waiting.set()
        if len(self._pending) >= self._batch_records:
            self._full.set()

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._publish_loop(), name="prefix-sharing-publish"),
            asyncio.create_task(self._receive_loop(), name="prefix-sharing-receive"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._pending:
            self._dropped.inc(len(self._pending))
            self._pending.clear()

    async def _publish_loop(self) -> None:
        while True:
            await self._waiting.wait()
            if len(self._pending) < self._batch_records:
                self._full.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._interval):  # gather a batch
                        await self._full.wait()
            self._waiting.clear()
            self._full.clear()
            while self._pending:
                await self._publish(batch(self._pending, self._clusters, self._batch_records))

    async def _publish(self, records: list[Record]) -> None:
        if not records:
            return
        took = False
        try:
            payload = encode(self.sender, records)
            if len(payload) <= MAX_MESSAGE_BYTES:
                took = await self._state.publish(CHANNEL, payload)
            else:  # names of thousands of characters: no other gateway would read it
                log.warning(
                    "prefix index batch of %d bytes not shared: over %d", len(payload), MAX_MESSAGE_BYTES
                )
        except Exception as exc:  # StateUnavailable from a bare remote store, or a bug: never the loop
            log.warning("prefix index batch not shared: %r", exc)
        (self._sent if took else self._dropped).inc(len(records))

    async def _receive_loop(self) -> None:
        try:
            async for payload in self._state.subscribe(CHANNEL):
                try:
                    sender, records = decode(payload)
                except ValueError as exc:
                    self._skip(exc)
                    continue
                if sender == self.sender:
                    continue
                applied = apply(self._clusters, records)
                if applied:
                    self._received.inc(applied)
        except Exception:  # the store's subscription should never end; if it does, routing goes on
            log.exception("prefix index sharing stopped receiving")

    def _skip(self, exc: ValueError) -> None:
        self._malformed += 1
        now = self._clock()
        if now >= self._report_at:
            log.warning(
                "skipped %d malformed prefix index message(s) from other gateways, the last: %s",
                self._malformed,
                exc,
            )
            self._malformed = 0
            self._report_at = now + _REPORT_EVERY
