"""What one worker's routing log hands the others (`--workers`): batches on its ring, cut to fit."""

from __future__ import annotations

from pathlib import Path

from modelyard.gateway.routing_log import RoutingLog
from modelyard.gateway.worker_log import BATCH_RECORDS, LOG_FILE, WorkerLog
from modelyard.state.siblings import LOG_RING_BYTES, create_rings


def _pair(tmp_path: Path) -> tuple[WorkerLog, WorkerLog]:
    create_rings(tmp_path / LOG_FILE, 2, LOG_RING_BYTES)
    return WorkerLog(tmp_path, 0, 2), WorkerLog(tmp_path, 1, 2)


def test_records_reach_the_other_worker_once_flushed_in_order(tmp_path: Path) -> None:
    first, second = _pair(tmp_path)
    made, taken = RoutingLog(worker=0), RoutingLog(worker=1, size=1000)
    made.share = first.share_record
    for n in range(3):
        made.record("m", "default", "*", f"w{n}", "round_robin", 200, 0.001, None, f"r{n}")
    second.follow(taken, {})
    assert taken.recent() == []  # not sent until the flush (the follow loop's, each round)
    first.flush()
    second.follow(taken, {})
    assert [(r.request_id, r.worker, r.seq) for r in taken.recent()] == [
        ("r0", 0, 1),
        ("r1", 0, 2),
        ("r2", 0, 3),
    ]


def test_a_long_batch_is_sent_without_waiting_and_cut_to_what_a_message_holds(tmp_path: Path) -> None:
    first, second = _pair(tmp_path)
    made, taken = RoutingLog(worker=0, size=BATCH_RECORDS + 10), RoutingLog(worker=1, size=BATCH_RECORDS + 10)
    made.share = first.share_record
    # A client's X-Request-Id: 512 of these are more than a message may hold (a quarter of the
    # ring), and less than the ring.
    long_id = "x" * 1000
    for n in range(BATCH_RECORDS):
        made.record("m", "default", "*", "w0", "round_robin", 200, 0.001, None, f"{n}-{long_id}")
    second.follow(taken, {})  # sent once BATCH_RECORDS waited, in several messages
    ids = [r.request_id.partition("-")[0] for r in taken.recent()]
    assert ids == [str(n) for n in range(BATCH_RECORDS)]
    assert first._rings.dropped == 0 and second._rings.dropped == 0


def test_a_request_id_with_bytes_that_are_not_utf8_goes_over_escaped(tmp_path: Path) -> None:
    first, second = _pair(tmp_path)
    made, taken = RoutingLog(worker=0), RoutingLog(worker=1)
    made.share = first.share_record
    raw = b"id-\xff".decode("utf-8", "surrogateescape")  # how the listener decodes such a header
    made.record("m", "default", "*", "w0", "round_robin", 200, 0.001, None, raw)
    made.record("m", "default", "*", "w0", "round_robin", 200, 0.001, None, "next")
    first.flush()
    second.follow(taken, {})
    assert [r.request_id for r in taken.recent()] == ["id-\\udcff", "next"]  # the batch whole
    assert [r.request_id for r in made.recent()] == ["id-\\udcff", "next"]  # JSON can carry it
