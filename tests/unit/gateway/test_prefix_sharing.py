"""Sharing prefix_aware's index: the message format, applying what other gateways sent, what waits
to be sent and batching, and two gateways' sharers over one in-process store (MemoryState delivers
within the process)."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
import pytest

from modelyard.balancing.prefix import PrefixIndex
from modelyard.config import ModelConfig
from modelyard.gateway.cluster import Cluster
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.gateway.prefix_sharing import (
    CHANNEL,
    MAX_MESSAGE_BYTES,
    MAX_RECORD_CHUNKS,
    Applied,
    PrefixSharing,
    Record,
    apply,
    batch,
    decode,
    encode,
)
from modelyard.state import MemoryState
from support import wait_until

PROMPT = "You are a careful assistant. Answer briefly. " * 4


def clusters(
    capacity: int = 1000, names: tuple[str, ...] = ("w0", "w1", "w2"), chunk_chars: int = 16
) -> dict[str, Cluster]:
    config = ModelConfig(
        name="m",
        endpoints=[{"name": n, "url": f"http://127.0.0.1:{i + 1}"} for i, n in enumerate(names)],
        strategy="prefix_aware",
        prefix_aware={"chunk_chars": chunk_chars, "max_chunks_per_endpoint": capacity},
    )
    return {"m": Cluster(config, {})}


def shared(metrics: GatewayMetrics, direction: str) -> float:
    value = metrics.registry.get_sample_value("modelyard_prefix_index_shared_total", {"direction": direction})
    return value or 0.0


def test_a_message_carries_the_sender_and_its_records_with_their_chunking_and_64_bit_names():
    records = [Record("m", "w0", 16, [0, 2**64 - 1, 12345]), Record("modèle", "w1", 64, [7])]
    payload = encode("abc123", records)
    assert decode(payload) == ("abc123", records)
    assert orjson.loads(payload) == [
        2,
        "abc123",
        [["m", "w0", 16, [0, 2**64 - 1, 12345]], ["modèle", "w1", 64, [7]]],
    ]


@pytest.mark.parametrize(
    "payload",
    [
        b"not json",
        orjson.dumps({"sender": "x"}),
        orjson.dumps([3, "x", []]),  # a later version
        orjson.dumps([1, "x", [["m", "w0", [1]]]]),  # version 1: no chunk_chars
        orjson.dumps([2, 5, []]),
        orjson.dumps([2, "x", {}]),
        orjson.dumps([2, "x", [["m", "w0", [1]]]]),
        orjson.dumps([2, "x", [["m", 0, 16, [1]]]]),
        orjson.dumps([2, "x", [["m", "w0", "16", [1]]]]),
        orjson.dumps([2, "x", [["m", "w0", 0, [1]]]]),
        orjson.dumps([2, "x", [["m", "w0", True, [1]]]]),
        orjson.dumps([2, "x", [["m", "w0", 16, ["1"]]]]),
        orjson.dumps([2, "x", [["m", "w0", 16, [1.5]]]]),
        orjson.dumps([2, "x", [["m", "w0", 16, [True]]]]),
        orjson.dumps([2, "x", [["m", "w0", 16, [1] * (MAX_RECORD_CHUNKS + 1)]]]),
        b" " * (MAX_MESSAGE_BYTES + 1),
    ],
    ids=lambda p: p[:40].decode(errors="replace").strip() or "oversized",
)
def test_a_malformed_message_is_a_value_error(payload: bytes):
    with pytest.raises(ValueError):
        decode(payload)


def test_applying_records_what_this_gateway_knows_and_skips_the_rest():
    known = clusters()
    index = known["m"].balancer.prefixes
    chunks = index.chunks(PROMPT)
    records = [
        Record("m", "w1", 16, chunks),
        Record("other-model", "w1", 16, chunks),
        Record("m", "w9", 16, chunks),  # an endpoint this gateway does not route to
        Record("m", "w2", 16, []),
    ]
    assert apply(known, records) == Applied(1, 0)
    assert index.matches(chunks, ["w0", "w1", "w2"]) == {"w0": 0, "w1": len(chunks), "w2": 0}
    assert index.sizes() == {"w1": len(chunks)}


def test_records_of_another_chunk_size_are_skipped_and_counted_and_leave_the_index_alone():
    known = clusters(capacity=4)  # chunk_chars 16
    index = known["m"].balancer.prefixes
    mine = index.chunks(PROMPT)[:4]
    index.record(mine, "w0")
    theirs = PrefixIndex(32, capacity=1000).chunks(PROMPT)  # the same prompt cut in 32 characters
    records = [Record("m", "w0", 32, theirs), Record("m", "w1", 16, mine), Record("m", "w2", 8, [1])]
    outcome = apply(known, records)
    assert outcome.applied == 1 and outcome.mismatched == 2
    assert "'m'" in outcome.mismatch and "chunk_chars 8 there, 16 here" in outcome.mismatch
    assert index.match(mine, "w0") == 4  # not pushed out by names that can never match here
    assert index.sizes() == {"w0": 4, "w1": 4}


def test_a_batch_is_bounded_by_records_and_by_the_size_of_a_message():
    pending = deque(Record("m", "w0", 16, [i]) for i in range(5))
    assert len(batch(pending, max_records=2)) == 2
    assert len(pending) == 3

    big = [2**64 - 1] * MAX_RECORD_CHUNKS  # the widest names: about a third of a message each
    pending = deque(Record("m", "w0", 16, big) for _ in range(7))
    sizes = []
    while pending:
        taken = batch(pending, max_records=256)
        sizes.append(len(taken))
        assert len(encode("0" * 16, taken)) <= MAX_MESSAGE_BYTES
    assert sum(sizes) == 7 and max(sizes) < 7


class Gateway:
    """What one gateway's sharer works with: its clusters, metrics and the common store."""

    def __init__(
        self, store: MemoryState, *, capacity: int = 1000, chunk_chars: int = 16, **options: Any
    ) -> None:
        self.store = store
        self.clusters = clusters(capacity=capacity, chunk_chars=chunk_chars)
        self.metrics = GatewayMetrics(lambda: ())
        self.sharing = PrefixSharing(store, self.clusters, self.metrics, **options)


@pytest.fixture
async def started() -> AsyncIterator[Callable[..., Gateway]]:
    sharers: list[PrefixSharing] = []
    store = MemoryState()

    def start(**options: Any) -> Gateway:
        gateway = Gateway(store, **options)
        gateway.sharing.start()
        sharers.append(gateway.sharing)
        return gateway

    yield start
    for sharing in sharers:
        await sharing.stop()


async def test_what_one_gateway_records_reaches_the_others_index_not_its_own(started):
    a, b = started(), started()
    chunks = a.clusters["m"].balancer.prefixes.chunks(PROMPT)

    async def applied_on_b() -> bool:
        a.sharing.offer("m", "w2", chunks)  # again until b is listening: a channel keeps nothing
        return shared(b.metrics, "received") >= 1

    await wait_until(applied_on_b)
    assert b.clusters["m"].balancer.prefixes.match(chunks, "w2") == len(chunks)
    assert shared(a.metrics, "sent") >= 1
    assert shared(a.metrics, "received") == 0  # its own messages come back and are skipped
    assert a.clusters["m"].balancer.prefixes.sizes() == {}


async def test_records_beyond_the_queue_bound_are_dropped_and_counted():
    gateway = Gateway(MemoryState(), max_pending=2)  # not started: nothing is sent
    for _ in range(5):
        gateway.sharing.offer("m", "w0", [1, 2, 3])
    assert shared(gateway.metrics, "dropped") == 3
    await gateway.sharing.stop()
    assert shared(gateway.metrics, "dropped") == 5  # what still waited at stop was never sent


async def test_what_waits_is_the_head_an_index_holds_and_is_bounded_in_chunk_names():
    gateway = Gateway(MemoryState(), capacity=3, max_pending_chunks=7)  # not started: all wait
    long_prompt = list(range(10))
    for _ in range(3):  # each waits as the 3 chunks an index holds: two fit, not the third
        gateway.sharing.offer("m", "w0", long_prompt)
    assert shared(gateway.metrics, "dropped") == 1
    gateway.sharing.offer("m", "w1", [1])  # 7 chunk names wait
    assert shared(gateway.metrics, "dropped") == 1
    gateway.sharing.offer("m", "w1", [2])
    assert shared(gateway.metrics, "dropped") == 2
    await gateway.sharing.stop()
    assert shared(gateway.metrics, "dropped") == 5


class RecordingStore(MemoryState):
    def __init__(self) -> None:
        super().__init__()
        self.published: list[bytes] = []

    async def publish(self, channel: str, payload: bytes) -> bool:
        self.published.append(payload)
        return await super().publish(channel, payload)


async def test_a_record_goes_with_the_head_an_index_holds_and_the_chunk_size_of_its_names():
    store = RecordingStore()
    gateway = Gateway(store, capacity=3)
    gateway.sharing.start()
    try:
        gateway.sharing.offer("m", "w0", list(range(10)))

        async def published() -> bool:
            return bool(store.published)

        await wait_until(published)
        assert decode(store.published[0]) == (gateway.sharing.sender, [Record("m", "w0", 16, [0, 1, 2])])
        assert shared(gateway.metrics, "sent") == 1
    finally:
        await gateway.sharing.stop()


class StuckStore(MemoryState):
    """A store whose publish never returns (a Redis that stopped answering, before its timeout)."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = asyncio.Event()

    async def publish(self, channel: str, payload: bytes) -> bool:
        self.entered.set()
        await asyncio.Event().wait()
        return True


async def test_a_batch_being_published_when_the_gateway_stops_counts_as_dropped():
    store = StuckStore()
    gateway = Gateway(store)
    gateway.sharing.start()
    for _ in range(3):
        gateway.sharing.offer("m", "w0", [1, 2, 3])
    async with asyncio.timeout(5):
        await store.entered.wait()
    await gateway.sharing.stop()
    assert shared(gateway.metrics, "dropped") == 3
    assert shared(gateway.metrics, "sent") == 0


async def test_records_of_a_gateway_with_another_chunk_size_are_skipped_counted_and_logged(started, caplog):
    caplog.set_level(logging.WARNING, "modelyard.gateway")
    a, b = started(chunk_chars=32), started()
    chunks = a.clusters["m"].balancer.prefixes.chunks(PROMPT)

    async def skipped_on_b() -> bool:
        a.sharing.offer("m", "w2", chunks)  # again until b is listening
        return shared(b.metrics, "skipped") >= 1

    await wait_until(skipped_on_b)
    assert shared(b.metrics, "received") == 0
    assert b.clusters["m"].balancer.prefixes.sizes() == {}
    warnings = [
        r.getMessage() for r in caplog.records if "another prefix_aware.chunk_chars" in r.getMessage()
    ]
    assert len(warnings) == 1 and "chunk_chars 32 there, 16 here" in warnings[0]


class AwayStore(MemoryState):
    """A store that is away: FallbackState answers so while Redis does not."""

    async def publish(self, channel: str, payload: bytes) -> bool:
        return False


async def test_a_batch_the_store_does_not_take_counts_as_dropped():
    gateway = Gateway(AwayStore())
    gateway.sharing.start()
    try:
        for _ in range(3):
            gateway.sharing.offer("m", "w0", [1, 2, 3])

        async def dropped() -> bool:
            return shared(gateway.metrics, "dropped") == 3

        await wait_until(dropped)
        assert shared(gateway.metrics, "sent") == 0
    finally:
        await gateway.sharing.stop()


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_malformed_messages_are_skipped_and_logged_once_a_minute(started, caplog):
    clock = FakeClock()
    b = started(clock=clock)
    store = b.store
    valid = encode("another-gateway", [Record("m", "w0", 16, [1, 2])])
    seen = 0.0

    async def sent_until_applied(*before: bytes) -> None:
        """Publish `before`, then a valid message, until one is applied: the channel keeps the
        order, so `before` was read by then."""
        nonlocal seen
        target = seen + 1

        async def applied() -> bool:
            for payload in (*before, valid):
                await store.publish(CHANNEL, payload)
            return shared(b.metrics, "received") >= target

        await wait_until(applied)
        seen = shared(b.metrics, "received")

    caplog.set_level(logging.WARNING, "modelyard.gateway")
    await sent_until_applied(b"garbage", b"[1]")
    clock.now += 30
    await sent_until_applied(b"more garbage")
    warnings = [r.getMessage() for r in caplog.records if "malformed prefix index" in r.getMessage()]
    assert len(warnings) == 1 and "skipped 1 " in warnings[0]

    clock.now += 31
    await sent_until_applied(b"{}")
    warnings = [r.getMessage() for r in caplog.records if "malformed prefix index" in r.getMessage()]
    assert len(warnings) == 2 and "skipped 1 " not in warnings[1]  # the ones not logged, counted
    assert b.clusters["m"].balancer.prefixes.match([1, 2], "w0") == 2
