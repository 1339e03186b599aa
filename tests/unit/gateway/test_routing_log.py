"""The routing log: a bounded ring, subscribers with bounded queues that lose (and count) what they
cannot keep, and an end for every subscriber when the gateway stops."""

from __future__ import annotations

import time
from dataclasses import astuple

import orjson
import pytest

from modelyard.errors import TooManyLogStreams
from modelyard.gateway.routing_log import (
    END,
    MAX_REFUSED_NAME,
    REFUSED_BURST,
    REFUSED_PER_SECOND,
    Entry,
    RoutingLog,
    RoutingRecord,
    encode_shared,
)


def record(log: RoutingLog, backend: str = "w0", status: int = 200, cache_hit: bool | None = None) -> None:
    log.record("m", "default", "*", backend, "round_robin", status, 0.0123456, cache_hit, "req-1")


def test_a_record_holds_where_the_request_went_and_how_it_ended():
    log = RoutingLog()
    before = time.time()
    record(log, "w1", 503, cache_hit=True)
    (entry,) = log.recent()
    assert before <= entry.time <= time.time()
    assert entry == RoutingRecord(
        1, entry.time, "m", "default", "*", "w1", "round_robin", 503, 12.346, True, "req-1"
    )
    assert orjson.loads(orjson.dumps(entry)) == {
        "seq": 1,
        "time": entry.time,
        "model": "m",
        "route": "default",
        "subset": "*",
        "backend": "w1",
        "strategy": "round_robin",
        "status": 503,
        "latency_ms": 12.346,
        "cache_hit": True,
        "request_id": "req-1",
        "tenant": "",
        "worker": None,
        "refused": False,
        "fallback_for": "",
    }


def test_a_fallback_models_record_names_the_model_asked_for():
    log = RoutingLog()
    sent: list[Entry] = []
    log.share = sent.append
    log.record("spare", "default", "*", "w0", "round_robin", 200, 0.001, None, "req-1", fallback_for="main")
    (entry,) = log.recent()
    assert entry.model == "spare" and entry.fallback_for == "main" and not entry.refused
    adopted = RoutingLog()  # another worker's log: shared as it was made
    adopted.adopt(encode_shared(sent))
    assert adopted.recent()[0].fallback_for == "main"


def test_a_refused_request_is_recorded_with_the_model_asked_for_and_no_backend():
    log = RoutingLog(worker=2)
    subscription = log.subscribe()
    sent: list[Entry] = []
    log.share = sent.append
    log.record_refused("chat-huge", 503, 0.0004, "r-1")
    log.record_refused("x" * 10_000 + "\udcff", 404, 0.0, "id-\udcff")  # client text, any size
    huge, unknown = log.recent()
    assert huge == RoutingRecord(
        1, huge.time, "chat-huge", "", "", "", "", 503, 0.4, None, "r-1", "", 2, True
    )
    assert unknown.model == "x" * MAX_REFUSED_NAME and unknown.refused
    assert unknown.request_id == "id-\\udcff"  # as JSON can carry it
    assert orjson.loads(orjson.dumps(unknown))["status"] == 404
    assert list(subscription.ready()) == [huge, unknown]  # followed and shared as any record
    assert [RoutingRecord(*entry).refused for entry in sent] == [True, True]
    record(log)
    assert log.recent()[-1].refused is False


def test_the_ring_keeps_the_latest_records_in_order():
    log = RoutingLog(size=3)
    for _ in range(5):
        record(log)
    assert [r.seq for r in log.recent()] == [3, 4, 5]
    assert [r.seq for r in log.recent(after=4)] == [5]
    assert log.recent(after=5) == []
    assert [r.seq for r in log.recent(after=0)] == [3, 4, 5]


def test_a_subscriber_gets_the_records_made_after_it_subscribed():
    log = RoutingLog()
    record(log, "before")
    subscription = log.subscribe()
    record(log, "w0")
    record(log, "w1")
    assert [r.backend for r in subscription.ready() if isinstance(r, RoutingRecord)] == ["w0", "w1"]
    assert list(subscription.ready()) == []
    log.unsubscribe(subscription)
    record(log, "after")
    assert list(subscription.ready()) == []
    assert log.subscribers == 0


async def test_next_waits_for_a_record_and_gives_none_when_none_comes():
    log = RoutingLog()
    subscription = log.subscribe()
    assert await subscription.next(0) is None
    record(log)
    got = await subscription.next(1)
    assert isinstance(got, RoutingRecord) and got.seq == 1


def test_a_subscriber_that_falls_behind_loses_records_and_is_told_how_many():
    log = RoutingLog(subscriber_queue=2)
    slow, other = log.subscribe(), log.subscribe()
    for _ in range(5):
        record(log)
    assert [r.seq for r in slow.ready() if isinstance(r, RoutingRecord)] == [1, 2]
    assert slow.take_dropped() == 3
    assert slow.take_dropped() == 0  # told once
    record(log)
    assert [r.seq for r in slow.ready() if isinstance(r, RoutingRecord)] == [6]
    assert other.take_dropped() == 4  # each subscriber its own queue
    assert [r.seq for r in log.recent()] == [1, 2, 3, 4, 5, 6]  # the ring lost nothing


def test_closing_ends_every_subscriber_even_a_full_one():
    log = RoutingLog(subscriber_queue=2)
    idle, full = log.subscribe(), log.subscribe()
    list(idle.ready())
    for _ in range(2):
        record(log)
    list(idle.ready())
    log.close()
    assert list(idle.ready()) == [END]
    assert list(full.ready())[-1] is END
    assert log.subscribers == 0
    late = log.subscribe()  # the gateway is stopping: a new stream ends at once
    assert list(late.ready()) == [END]
    assert log.subscribers == 0


def test_subscribers_are_bounded_and_those_refused_are_counted():
    log = RoutingLog(max_subscribers=2)
    first, second = log.subscribe(), log.subscribe()
    with pytest.raises(TooManyLogStreams) as refused:
        log.subscribe()
    assert (refused.value.status, refused.value.headers) == (503, {"Retry-After": "5"})
    assert "admin.max_log_streams" in refused.value.message
    assert (log.subscribers, log.refused) == (2, 1)
    record(log)
    assert [len(list(s.ready())) for s in (first, second)] == [1, 1]  # nobody else was fed
    log.unsubscribe(first)
    third = log.subscribe()
    assert (log.subscribers, log.refused) == (2, 1)
    record(log)
    assert isinstance(next(third.ready()), RoutingRecord)


def test_another_workers_records_join_the_log_with_its_own_seq():
    mine, theirs = RoutingLog(), RoutingLog()
    shared: list[bytes] = []
    theirs.share = lambda entry: shared.append(encode_shared([entry]))
    sent: list[Entry] = []
    mine.share = sent.append
    record(mine, "w0")
    follower = mine.subscribe()
    record(theirs, "w1", 503, cache_hit=False)
    for data in shared:
        mine.adopt(data)
    (made_there,) = theirs.recent()
    first, adopted = mine.recent()
    assert (first.backend, adopted.seq) == ("w0", 2)
    assert adopted == RoutingRecord(2, *astuple(made_there)[1:])  # all but seq, as it was made
    assert list(follower.ready()) == [adopted]
    assert [RoutingRecord(*entry).backend for entry in sent] == ["w0"]  # an adopted one is not shared again


def test_a_shared_record_nobody_follows_is_read_back_whole():
    theirs, quiet = RoutingLog(), RoutingLog()
    shared: list[bytes] = []
    theirs.share = lambda entry: shared.append(encode_shared([entry]))
    record(theirs, "w1", 200, cache_hit=True)
    quiet.adopt(shared[0])  # nobody follows quiet: kept as it came
    (made_there,) = theirs.recent()
    assert quiet.recent() == [made_there]  # seq 1 in both
    assert quiet.recent(after=1) == []


def test_a_batch_from_another_worker_joins_in_order_and_a_malformed_one_adds_nothing():
    theirs, mine = RoutingLog(worker=1), RoutingLog(worker=0)
    sent: list[Entry] = []
    theirs.share = sent.append
    for backend in ("w0", "w1", "w2"):
        record(theirs, backend)
    mine.adopt(encode_shared(sent))  # one message for the three
    assert [(r.seq, r.backend, r.worker) for r in mine.recent()] == [(1, "w0", 1), (2, "w1", 1), (3, "w2", 1)]
    for malformed in (b'{"seq": 1}', orjson.dumps([[1, 2.0, "m"]]), orjson.dumps([sent[0], "x"])):
        with pytest.raises(ValueError):
            mine.adopt(malformed)
    assert len(mine.recent()) == 3 and mine.recent(after=3) == []


class Clock:
    """Monotonic seconds that move only when told."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def refuse(log: RoutingLog, request_id: str = "nope") -> None:
    log.record_refused("nope", 404, 0.0001, request_id)


def test_refusals_over_the_rate_are_counted_not_recorded_nor_followed_nor_shared():
    clock = Clock()
    log = RoutingLog(clock=clock)
    follower = log.subscribe()
    sent: list[Entry] = []
    log.share = sent.append
    for _ in range(int(REFUSED_BURST) + 30):  # all at once: the burst is recorded
        refuse(log)
    assert (len(log.recent()), log.refusals_unrecorded) == (REFUSED_BURST, 30)
    assert len(list(follower.ready())) == len(sent) == REFUSED_BURST
    clock.now += 2.5 / REFUSED_PER_SECOND  # room for two more (and half of another)
    for _ in range(3):
        refuse(log)
    assert (len(log.recent()), log.refusals_unrecorded) == (REFUSED_BURST + 2, 31)
    record(log)  # a routed record is never held back
    assert log.recent()[-1].refused is False
    assert [r.seq for r in log.recent()] == list(range(1, int(REFUSED_BURST) + 4))


def test_no_number_of_refusals_pushes_a_routed_record_out():
    clock = Clock()
    log = RoutingLog(size=10, clock=clock)
    for backend in ("w0", "w1", "w2"):
        record(log, backend)
    for i in range(100):  # slowly enough to be recorded, every one
        clock.now += 1.0
        refuse(log, f"r{i}")
    record(log, "w3")
    kept = log.recent()
    assert log.refusals_unrecorded == 0
    assert [r.backend for r in kept if not r.refused] == ["w0", "w1", "w2", "w3"]
    assert [r.request_id for r in kept if r.refused] == [f"r{i}" for i in range(95, 100)]  # half the ring
    assert [r.seq for r in kept] == [1, 2, 3, *range(99, 105)]  # oldest first, merged
    assert [r.seq for r in log.recent(after=101)] == [102, 103, 104]


def test_another_workers_refusals_are_kept_apart_from_its_routed_records_too():
    clock = Clock()
    theirs, mine = RoutingLog(worker=1, clock=clock), RoutingLog(size=4, worker=0)
    sent: list[Entry] = []
    theirs.share = sent.append
    record(theirs, "w0")
    for i in range(10):
        clock.now += 1.0
        refuse(theirs, f"r{i}")
    record(theirs, "w1")
    mine.adopt(encode_shared(sent))
    kept = mine.recent()
    assert [(r.backend, r.worker) for r in kept if not r.refused] == [("w0", 1), ("w1", 1)]
    assert [(r.request_id, r.seq) for r in kept if r.refused] == [("r8", 10), ("r9", 11)]
