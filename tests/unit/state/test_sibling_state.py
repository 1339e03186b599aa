"""state/siblings.py: the workers' rings of messages, and SiblingState kept in step over them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from modelyard.state import MemoryState
from modelyard.state import siblings as module
from modelyard.state.siblings import RING_BYTES, RINGS_FILE, Rings, SiblingState, create_rings


@pytest.fixture
def rings(tmp_path: Path) -> list[Rings]:
    create_rings(tmp_path / RINGS_FILE, 3)
    opened = [Rings(tmp_path / RINGS_FILE, index, 3) for index in range(3)]
    yield opened
    for ring in opened:
        ring.close()


def test_each_message_reaches_every_other_worker_once(rings):
    first, second, third = rings
    assert first.send(b"a") and first.send(b"") and third.send(b"c" * 1000)
    assert second.receive() == [b"a", b"", b"c" * 1000]
    assert second.receive() == []
    assert first.receive() == [b"c" * 1000]  # never its own
    assert third.receive() == [b"a", b""]


def test_messages_wrap_around_the_end_of_a_ring(rings):
    writer, reader, _ = rings
    big = bytes(range(256)) * 4096  # 1 MiB: four of them and a bit fill a ring
    for round_ in range(10):  # 10 MiB through a 4 MiB ring, read as it goes
        message = bytes([round_]) + big[: module.MAX_MESSAGE - 5]
        assert writer.send(message)
        assert reader.receive() == [message]
    assert reader.dropped == 0


def test_a_reader_lapped_by_the_writer_drops_what_it_missed_and_goes_on(rings):
    writer, reader, _ = rings
    chunk = b"x" * (RING_BYTES // 8)
    for _ in range(9):  # more than a ring's worth, unread
        writer.send(chunk)
    assert reader.receive() == []
    assert reader.dropped == 1
    writer.send(b"after")
    assert reader.receive() == [b"after"]


def test_a_message_too_large_is_dropped_and_counted(rings):
    writer, reader, _ = rings
    assert not writer.send(b"x" * module.MAX_MESSAGE)
    assert writer.dropped == 1 and reader.receive() == []


def test_a_restarted_worker_writes_on_and_reads_from_now(rings, tmp_path):
    first, second, _ = rings
    first.send(b"before")
    second.send(b"old news")
    again = Rings(tmp_path / RINGS_FILE, 0, 3)  # worker 0 started again
    again.send(b"after")
    assert second.receive() == [b"before", b"after"]
    assert again.receive() == []  # what was sent before it started is not replayed
    second.send(b"new")
    assert again.receive() == [b"new"]
    again.close()


async def test_sibling_states_learn_what_the_others_set_and_publish(rings):
    one, two = SiblingState(MemoryState(), rings[0]), SiblingState(MemoryState(), rings[1])
    heard = two.subscribe("prefix-index")
    await one.set("affinity:k", "w2", 60.0)
    assert await two.get("affinity:k") is None  # not yet applied
    await two.apply()
    assert await two.get("affinity:k") == "w2"
    receiving = asyncio.ensure_future(heard.__anext__())
    await asyncio.sleep(0)  # one turn of the loop: the subscription starts and registers
    assert await one.publish("prefix-index", b"\x00payload")
    await two.apply()
    assert await asyncio.wait_for(receiving, 5) == b"\x00payload"
    await heard.aclose()


async def test_two_workers_that_set_one_key_agree_on_the_later_set(rings):
    events: list[tuple[str, int]] = []
    one = SiblingState(MemoryState(), rings[0], lambda event, count: events.append((event, count)))
    two = SiblingState(MemoryState(), rings[1])
    await one.set("affinity:k", "w0", 60.0)  # both missed the key and chose, one after the other
    await two.set("affinity:k", "w1", 60.0)
    await one.apply()
    await two.apply()
    assert await one.get("affinity:k") == await two.get("affinity:k") == "w1"
    assert events == [("sent", 1), ("applied", 1)]


async def test_a_set_whose_time_is_over_is_not_applied(rings):
    one, two = SiblingState(MemoryState(), rings[0]), SiblingState(MemoryState(), rings[1])
    await one.set("affinity:k", "w0", -1.0)
    await two.apply()
    assert await two.get("affinity:k") is None


def test_the_rings_file_is_allocated_when_made(tmp_path):
    path = tmp_path / RINGS_FILE
    create_rings(path, 2)
    assert path.stat().st_blocks * 512 >= module.rings_size(2)  # not sparse: no SIGBUS when a ring wraps


async def test_a_publish_the_ring_refuses_is_not_reported_sent(rings):
    one = SiblingState(MemoryState(), rings[0])
    assert not await one.publish("prefix-index", b"x" * module.MAX_MESSAGE)
