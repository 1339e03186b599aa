"""The routing log: where each request went and how it ended, kept for the dashboard and
`/admin/log`, and streamed to whoever follows it (`/admin/log/stream`). A request refused before
routing (an unknown model, one not placed, a bad body) has a record too, marked `refused`.

On the request path a record costs a small object, an append to a bounded ring and, only while
someone follows the log, a `put_nowait` per subscriber: nothing awaits, nothing blocks. A subscriber
that falls behind loses records (its queue is bounded) and is told how many; it never slows a
request. The subscribers are bounded too (`admin.max_log_streams`): one more is refused.

A refused request costs its client nothing (no model to name, no token), so what refusals may take
is bounded twice. Their records are kept in a ring of their own, half the routed ring's size, so
that no number of them pushes a routed record out (a rate alone would not do: a slow, steady stream
of refusals would still replace an idle gateway's last real requests). And each worker makes at
most REFUSED_PER_SECOND of them (a token bucket holding REFUSED_BURST), so that a flood neither fills
the followers' queues, which would lose routed records too, nor the rings the workers share records
through; the others are counted (`refusals_unrecorded`), their access lines still written. Routed
records are never held back.

The workers of one gateway (`--workers`) each keep a log: each hands its records to `share` as it
makes them (gateway/worker_log.py sends them in batches on a ring the others read) and `adopt`s
theirs, so that every worker's log, and the dashboard following any of them, shows every request.
An adopted record takes the next `seq` of the log it joins, up to about 0.1 s after its `time`.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from operator import itemgetter
from typing import Any

import orjson

from modelyard.errors import TooManyLogStreams
from modelyard.telemetry import safe_text

DEFAULT_SIZE = 500  # routed records kept for /admin/log (and half as many refused ones)
DEFAULT_SUBSCRIBER_QUEUE = 4096  # records a subscriber may lag behind before it loses some
DEFAULT_MAX_SUBSCRIBERS = 16  # admin.max_log_streams' default
MAX_REFUSED_NAME = 200  # characters kept of a refused request's model name (client text, any size)
REFUSED_PER_SECOND = 50.0  # refused requests recorded per second per worker, at most
REFUSED_BURST = 50.0  # and at most this many at once


@dataclass(slots=True)
class RoutingRecord:
    """One counted try or answer: `backend` is "" when no endpoint was chosen (503, 429);
    `cache_hit` is None for strategies without affinity; `time` is seconds since the epoch;
    `worker` is the worker that answered (`--workers`), None for a gateway of one process;
    `refused`: answered before routing (an unknown model, a model not placed, a bad body), so no
    route, strategy or backend, and `model` is the name asked for ("" when none could be read);
    `fallback_for`: the model the request asked for, when `model` is one of its fallbacks (the
    asked model's own records, with the same request id, say how it failed)."""

    seq: int
    time: float
    model: str
    route: str
    subset: str
    backend: str
    strategy: str
    status: int
    latency_ms: float
    cache_hit: bool | None
    request_id: str
    tenant: str = ""  # auth.enabled: the tenant of the key that called
    worker: int | None = None
    refused: bool = False
    fallback_for: str = ""


# A record as the log keeps it, RoutingRecord's fields in order: a tuple is built without a call
# (the log takes one per request), and a batch of them is encoded for the other workers as it is.
Entry = tuple[int, float, str, str, str, str, str, int, float, bool | None, str, str, int | None, bool, str]
_FIELDS = len(fields(RoutingRecord))
_REFUSED_AT = [f.name for f in fields(RoutingRecord)].index("refused")
# A record another worker shared: (its seq here, its fields as they came, with the seq it had there).
_Shared = tuple[int, list[Any]]
_SEQ = itemgetter(0)
_REFUSED = itemgetter(_REFUSED_AT)  # a record's `refused`


def _decoded(entry: Entry | _Shared) -> RoutingRecord:
    if len(entry) == 2:  # another worker's
        seq, row = entry
        return RoutingRecord(seq, *row[1:])
    return RoutingRecord(*entry)


def encode_shared(entries: list[Entry]) -> bytes:
    """Records for the other workers' logs, as one message (each adopting log gives them its own
    seq)."""
    return orjson.dumps(entries)


class _End:
    """Put in a subscriber's queue when the log closes (the gateway stops)."""


END = _End()


class Subscription:
    """One reader of the live log. `next` waits for the next record (None after `seconds`, END
    once the log closed); `take_dropped` says how many records were lost since it last asked."""

    __slots__ = ("_queue", "dropped")

    def __init__(self, limit: int) -> None:
        self._queue: asyncio.Queue[RoutingRecord | _End] = asyncio.Queue(limit)
        self.dropped = 0

    def push(self, record: RoutingRecord | _End) -> None:
        try:
            self._queue.put_nowait(record)
        except asyncio.QueueFull:
            self.dropped += 1

    def end(self) -> None:
        if self._queue.full():  # make room for the end marker: the subscriber is leaving anyway
            self._queue.get_nowait()
            self.dropped += 1
        self._queue.put_nowait(END)

    async def next(self, seconds: float) -> RoutingRecord | _End | None:
        try:
            async with asyncio.timeout(seconds):
                return await self._queue.get()
        except TimeoutError:
            return None

    def ready(self) -> Iterator[RoutingRecord | _End]:
        """What is queued now, without waiting."""
        while not self._queue.empty():
            yield self._queue.get_nowait()

    def take_dropped(self) -> int:
        dropped, self.dropped = self.dropped, 0
        return dropped


class RoutingLog:
    """The last `size` routed records and `size // 2` refused ones, and at most `max_subscribers`
    subscribers following new ones (each may lag `subscriber_queue` records behind before it loses
    some). `refused` counts the subscribers turned away because that many were following;
    `refusals_unrecorded` the refused requests not recorded (over REFUSED_PER_SECOND). `clock` is
    monotonic seconds, for that rate."""

    def __init__(
        self,
        size: int = DEFAULT_SIZE,
        subscriber_queue: int = DEFAULT_SUBSCRIBER_QUEUE,
        max_subscribers: int = DEFAULT_MAX_SUBSCRIBERS,
        worker: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ring: deque[Entry | _Shared] = deque(maxlen=size)
        self._refused_ring: deque[Entry | _Shared] = deque(maxlen=max(1, size // 2))
        self._clock = clock
        self._tokens = REFUSED_BURST
        self._filled_at = clock()
        self.refusals_unrecorded = 0  # since the log began
        self._worker = worker
        self._subscribers: list[Subscription] = []
        self.subscriber_queue = subscriber_queue
        self.max_subscribers = max_subscribers
        self.refused = 0
        self._seq = 0
        self.closed = False
        self.share: Callable[[Entry], None] | None = None  # this log's records, for the others

    def record(
        self,
        model: str,
        route: str,
        subset: str,
        backend: str,
        strategy: str,
        status: int,
        seconds: float,
        cache_hit: bool | None,
        request_id: str,
        tenant: str = "",
        fallback_for: str = "",
    ) -> Entry:
        """A try or an answer counted; the record as kept (`RoutingRecord(*entry)` reads it)."""
        self._seq += 1
        entry = (
            self._seq,
            time.time(),
            model,
            route,
            subset,
            backend,
            strategy,
            status,
            int(seconds * 1_000_000.0 + 0.5) / 1000.0,  # ms to the microsecond (round() is slower)
            cache_hit,
            # (a header's bytes 0x80-0xFF came as lone surrogates, which JSON cannot carry)
            request_id if request_id.isascii() else safe_text(request_id),
            tenant,
            self._worker,
            False,
            fallback_for,
        )
        self._ring.append(entry)
        if self._subscribers:
            self._push(RoutingRecord(*entry))
        if self.share is not None:
            self.share(entry)
        return entry

    def record_refused(self, model: str, status: int, seconds: float, request_id: str) -> None:
        """A request answered before routing, with no route, strategy or backend: `model` as the
        client named it ("" when none could be read), cut to MAX_REFUSED_NAME characters. Over
        REFUSED_PER_SECOND, only counted (`refusals_unrecorded`)."""
        now = self._clock()
        tokens = min(REFUSED_BURST, self._tokens + (now - self._filled_at) * REFUSED_PER_SECOND)
        self._filled_at = now
        if tokens < 1.0:
            self._tokens = tokens
            self.refusals_unrecorded += 1
            return
        self._tokens = tokens - 1.0
        self._seq += 1
        entry: Entry = (
            self._seq,
            time.time(),
            safe_text(model[:MAX_REFUSED_NAME]),
            "",
            "",
            "",
            "",
            status,
            int(seconds * 1_000_000.0 + 0.5) / 1000.0,
            None,
            safe_text(request_id),
            "",
            self._worker,
            True,
            "",
        )
        self._refused_ring.append(entry)
        if self._subscribers:
            self._push(RoutingRecord(*entry))
        if self.share is not None:
            self.share(entry)

    def adopt(self, shared: bytes) -> None:
        """Records another worker's log shared (`encode_shared`), added as if made here. Kept as
        they came until read, or until someone follows the log: a worker adopts every other
        worker's requests, and most are never read. ValueError or TypeError (nothing added) when
        `shared` is not a list of records."""
        records = orjson.loads(shared)
        # (checked and added in C: a worker adopts every other worker's requests)
        if not isinstance(records, list) or (
            records and (set(map(type, records)) != {list} or set(map(len, records)) != {_FIELDS})
        ):
            raise ValueError("a routing-log batch is a list of records' fields")
        first = self._seq + 1
        self._seq += len(records)
        numbered = zip(range(first, self._seq + 1), records, strict=True)
        if any(map(_REFUSED, records)):  # (the other worker bounded them; kept apart here too)
            for numbered_row in numbered:
                (self._refused_ring if numbered_row[1][_REFUSED_AT] else self._ring).append(numbered_row)
        else:
            self._ring.extend(numbered)
        if self._subscribers:
            for seq, row in enumerate(records, first):
                self._push(RoutingRecord(seq, *row[1:]))

    def _push(self, record: RoutingRecord) -> None:
        for subscriber in self._subscribers:
            subscriber.push(record)

    def recent(self, after: int = 0) -> list[RoutingRecord]:
        """The records kept, routed and refused, oldest first; with `after`, only those with a
        greater `seq`."""
        kept = heapq.merge(self._ring, self._refused_ring, key=_SEQ)  # each in seq order
        return [_decoded(r) for r in kept if r[0] > after]

    def subscribe(self) -> Subscription:
        """A new subscriber; it gets every record from now on (an ended one if the log is closed).
        TooManyLogStreams when `max_subscribers` are following: nothing is registered then."""
        subscriber = Subscription(self.subscriber_queue)
        if self.closed:
            subscriber.end()
        elif len(self._subscribers) >= self.max_subscribers:
            self.refused += 1
            raise TooManyLogStreams(
                f"live-log streams open: {len(self._subscribers)}, as many as admin.max_log_streams "
                "allows; try again once one closes"
            )
        else:
            self._subscribers.append(subscriber)
        return subscriber

    def unsubscribe(self, subscriber: Subscription) -> None:
        if subscriber in self._subscribers:
            self._subscribers.remove(subscriber)

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    def close(self) -> None:
        """End every subscriber's stream (the gateway is stopping)."""
        self.closed = True
        subscribers, self._subscribers = self._subscribers, []
        for subscriber in subscribers:
            subscriber.end()
