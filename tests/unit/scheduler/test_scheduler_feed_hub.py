from __future__ import annotations

from modelyard.scheduler.feed import FeedHub


async def test_a_reader_that_falls_behind_is_dropped_and_others_are_not() -> None:
    hub = FeedHub(queue_size=2)
    slow, fast = hub.subscribe(), hub.subscribe()
    hub.publish({"n": 1})
    assert fast.get_nowait() == {"n": 1}
    hub.publish({"n": 2})
    hub.publish({"n": 3})  # slow holds 2 lines already: dropped
    assert [slow.get_nowait() for _ in range(3)] == [{"n": 1}, {"n": 2}, None]
    assert hub.readers == 1 and hub.dropped == 1
    assert [fast.get_nowait() for _ in range(2)] == [{"n": 2}, {"n": 3}]


async def test_close_ends_every_reader() -> None:
    hub = FeedHub()
    reader = hub.subscribe()
    hub.close()
    assert reader.get_nowait() is None and hub.readers == 0


async def test_a_reader_subscribing_after_close_ends_at_once() -> None:
    hub = FeedHub()
    hub.close()
    late = hub.subscribe()  # connected while the scheduler was stopping
    assert late.get_nowait() is None and hub.readers == 0
