"""Share prefix_aware's index between the gateways on one Redis.

Behind a load balancer each of N gateways sees 1/N of the traffic, and alone it would learn 1/N of
what the servers cache. What a gateway records after an answer (model, endpoint, the prompt's chunk
names: balancing/prefix.py) is also queued here without waiting, published in batches, and applied
by the other gateways to their PrefixIndex as if they had sent the prompt themselves.

- One channel, `prefix-index` under state.key_prefix: the gateways of one deployment share.
- A message is orjson `[2, sender, [[model, endpoint, chunk_chars, [chunk, ...]], ...]]`: the
  format version, the sending gateway's random id, and records whose chunk names are 64-bit ints
  of chunks of `chunk_chars` characters (the sender's prefix_aware.chunk_chars for the model).
- `offer` keeps only the head of a prompt that the model's index can hold (its tail would be
  evicted first anyway), so what waits is bounded by the index capacity, not the prompt's length.
- Batches go every `interval` (25 ms), or at once when `batch_records` wait, each under
  MAX_MESSAGE_BYTES. At most `max_pending` records, and `max_pending_chunks` chunk names in all,
  wait; more are dropped and counted, as are the records of a batch the store did not take (Redis
  away: FallbackState drops them at once) or that was being published when the gateway stopped.
- Received: its own messages, unknown models and endpoints are skipped; records of another
  chunk_chars than the model's here are skipped and counted (their names can never match one of
  this gateway's, and would only push real ones out of the index), and logged at most once a
  minute, as is a malformed or oversized message. Nothing here raises into routing, and a gateway
  that is not told about a prompt only routes it as if alone. A record with more chunks than the
  index here holds keeps its head (balancing/prefix.py evicts the tail first).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
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
VERSION = 2  # 1 had no chunk_chars
MAX_MESSAGE_BYTES = 1 << 20  # a larger message is refused unread
MAX_RECORD_CHUNKS = 16_384  # per record, whatever the index's capacity
_BATCH_BYTES = MAX_MESSAGE_BYTES // 2  # what a batch is cut at, by an estimate of its size
_CHUNK_BYTES = 21  # the most one chunk name takes: 20 digits and a comma
_RECORD_BYTES = 32  # a record's brackets, quotes, commas and chunk_chars
_REPORT_EVERY = 60.0  # seconds between two logs of malformed messages (or of mismatched records)


class Record(NamedTuple):
    """`endpoint` of `model` was sent a prompt with these names of chunks of `chunk_chars`."""

    model: str
    endpoint: str
    chunk_chars: int
    chunks: Sequence[int]


def encode(sender: str, records: Iterable[Record]) -> bytes:
    return orjson.dumps([VERSION, sender, [list(r) for r in records]])


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
        if not (isinstance(item, list) and len(item) == 4):
            raise ValueError("a record is not [model, endpoint, chunk_chars, chunks]")
        model, endpoint, chunk_chars, chunks = item
        if not (isinstance(model, str) and isinstance(endpoint, str) and isinstance(chunks, list)):
            raise ValueError("a record field of the wrong type")
        if type(chunk_chars) is not int or chunk_chars < 1:
            raise ValueError("a record's chunk_chars is not a positive int")
        if len(chunks) > MAX_RECORD_CHUNKS or not all(type(name) is int for name in chunks):
            raise ValueError(f"a record's chunks are not at most {MAX_RECORD_CHUNKS} ints")
        records.append(Record(model, endpoint, chunk_chars, chunks))
    return sender, records


class Applied(NamedTuple):
    applied: int  # records recorded in an index
    mismatched: int  # records skipped for names of another chunk_chars than the model's here
    mismatch: str = ""  # the last of those, as a log line says it


def apply(clusters: Mapping[str, Cluster], records: Iterable[Record]) -> Applied:
    """Record each record in its model's index, as if this gateway had sent the prompt. Records of
    models or endpoints this gateway does not know are skipped; so are, counted, those of another
    chunk_chars than the model's here (names that can never match a prompt's here)."""
    applied = mismatched = 0
    mismatch = ""
    for model, endpoint, chunk_chars, chunks in records:
        cluster = clusters.get(model)
        if cluster is None or not chunks:
            continue
        index = cluster.balancer.prefixes
        if chunk_chars != index.chunk_chars:
            mismatched += 1
            mismatch = f"model {model!r}: chunk_chars {chunk_chars} there, {index.chunk_chars} here"
            continue
        if not any(e.name == endpoint for e in cluster.endpoints):
            continue
        index.record(chunks, endpoint)
        applied += 1
    return Applied(applied, mismatched, mismatch)


def batch(pending: deque[Record], max_records: int) -> list[Record]:
    """Take the oldest pending records, up to `max_records` and the size of one message; at least
    one, when any is pending."""
    taken: list[Record] = []
    size = 0
    while pending and len(taken) < max_records:
        model, endpoint, _, chunks = pending[0]
        cost = len(model) + len(endpoint) + _RECORD_BYTES + _CHUNK_BYTES * len(chunks)
        if taken and size + cost > _BATCH_BYTES:
            break
        taken.append(pending.popleft())
        size += cost
    return taken


class _Throttled:
    """A warning about things skipped, logged at most once per _REPORT_EVERY with how many were
    skipped since the last one and what the last was."""

    def __init__(self, message: str, clock: Callable[[], float]) -> None:
        self._message = message  # formatted with the count and the last
        self._clock = clock
        self._count = 0
        self._report_at = float("-inf")

    def note(self, count: int, last: object) -> None:
        self._count += count
        now = self._clock()
        if now >= self._report_at:
            log.warning(self._message, self._count, last)
            self._count = 0
            self._report_at = now + _REPORT_EVERY


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
        max_pending_chunks: int = 1 << 18,  # about 12 MB of chunk names
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sender = os.urandom(8).hex()
        self._state = state
        self._clusters = clusters  # the gateway's own mapping: models placed later are found too
        self._interval = interval
        self._batch_records = batch_records
        self._max_pending = max_pending
        self._max_pending_chunks = max_pending_chunks
        self._pending: deque[Record] = deque()
        self._pending_chunks = 0  # chunk names in _pending
        self._waiting = asyncio.Event()  # records are pending
        self._full = asyncio.Event()  # a whole batch is pending
        shared = metrics.prefix_index_shared
        self._sent, self._received, self._dropped, self._skipped = (
            shared.labels(d) for d in ("sent", "received", "dropped", "skipped")
        )
        self._malformed = _Throttled(
            "skipped %d malformed prefix index message(s) from other gateways, the last: %s", clock
        )
        self._mismatched = _Throttled(
            "skipped %d prefix index record(s) from gateways with another prefix_aware.chunk_chars, "
            "the last: %s",
            clock,
        )
        self._tasks: list[asyncio.Task[None]] = []

    def offer(self, model: str, endpoint: str, chunks: Sequence[int]) -> None:
        """`endpoint` of `model` was sent a prompt with these chunks (a list the caller no longer
        changes), named by the model's index here. Never waits: kept are the chunks the index holds
        at most (a copy of them when they are fewer than the prompt's), and past `max_pending`
        waiting records or `max_pending_chunks` waiting chunks, the record is dropped."""
        cluster = self._clusters.get(model)
        if cluster is None or not chunks:
            return  # a model just removed: nobody has anything to learn from it
        index = cluster.balancer.prefixes
        keep = min(MAX_RECORD_CHUNKS, index.capacity)
        if keep == 0:
            return
        if len(chunks) > keep:
            chunks = list(itertools.islice(chunks, keep))
        if (
            len(self._pending) >= self._max_pending
            or self._pending_chunks + len(chunks) > self._max_pending_chunks
        ):
            self._dropped.inc()
            return
        self._pending.append(Record(model, endpoint, index.chunk_chars, chunks))
        self._pending_chunks += len(chunks)
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
            self._pending_chunks = 0

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
                records = batch(self._pending, self._batch_records)
                self._pending_chunks -= sum(len(record.chunks) for record in records)
                await self._publish(records)

    async def _publish(self, records: list[Record]) -> None:
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
        finally:  # cancelled by `stop` too: the batch is lost
            (self._sent if took else self._dropped).inc(len(records))

    async def _receive_loop(self) -> None:
        try:
            async for payload in self._state.subscribe(CHANNEL):
                try:
                    sender, records = decode(payload)
                except ValueError as exc:
                    self._malformed.note(1, exc)
                    continue
                if sender == self.sender:
                    continue
                applied, mismatched, mismatch = apply(self._clusters, records)
                if applied:
                    self._received.inc(applied)
                if mismatched:
                    self._skipped.inc(mismatched)
                    self._mismatched.note(mismatched, mismatch)
        except Exception:  # the store's subscription should never end; if it does, routing goes on
            log.exception("prefix index sharing stopped receiving")
