"""Worker heartbeats (serving/workers.py): the parent's decision with a fake clock, and the worker's
timer on a real loop."""

from __future__ import annotations

import asyncio
import multiprocessing

from modelyard.serving.workers import HeartbeatWatch, ParentLink
from support import wait_until

TIMEOUT = 5.0
STEP = TIMEOUT / 10  # how often the parent looks (supervise)


def looks(watch: HeartbeatWatch, beats: list[int], start: float, until: float) -> dict[float, list[int]]:
    """Each look of the parent from `start` to `until`, every STEP: when -> the workers stalled."""
    found, now = {}, start
    while now <= until + 1e-9:
        found[round(now, 3)] = watch.stalled(beats, now)
        now += STEP
    return found


def test_a_worker_that_keeps_beating_is_never_stalled() -> None:
    watch = HeartbeatWatch(TIMEOUT)
    beats = [0, 0]
    watch.serving(0, 0, now=0.0)
    watch.serving(1, 0, now=0.0)
    now = 0.0
    for _ in range(200):  # 100 s, a beat of each per look
        now += STEP
        beats[0] += 1
        beats[1] += 1
        assert watch.stalled(beats, now) == []


def test_a_worker_whose_counter_stops_is_stalled_after_the_timeout_and_not_before() -> None:
    watch = HeartbeatWatch(TIMEOUT)
    beats = [7, 3]
    watch.serving(0, 7, now=10.0)
    watch.serving(1, 3, now=10.0)
    assert watch.stalled(beats, 10.0) == []
    beats[1] = 4  # worker 1's last beat, seen at 10.5; worker 0 never beats again
    assert watch.stalled(beats, 10.5) == []
    found = looks(watch, beats, 11.0, 16.0)
    assert [when for when, stalled in found.items() if stalled] == [15.0, 15.5, 16.0]
    assert found[15.0] == [0]  # 5 s after it was last seen to move
    assert found[15.5] == [0, 1]  # worker 1: 5 s after 10.5
    assert watch.stalled(beats, 16.5) == [0, 1]  # said again each look until it is gone


def test_a_worker_is_watched_from_when_it_serves_until_it_is_gone() -> None:
    watch = HeartbeatWatch(TIMEOUT)
    beats = [0, 0]
    assert watch.stalled(beats, 100.0) == []  # not serving yet (starting): not watched
    watch.serving(1, 0, now=100.0)
    found = looks(watch, beats, 100.5, 105.0)
    assert found[105.0] == [1] and not any(found[t] for t in found if t < 105.0)
    watch.gone(1)  # killed and reaped
    assert watch.stalled(beats, 105.5) == []
    watch.serving(1, 0, now=106.0)  # its replacement serves: a fresh count, the slot reused
    found = looks(watch, beats, 106.0, 111.0)
    assert found[111.0] == [1] and not any(found[t] for t in found if t < 111.0)


def test_time_the_parent_did_not_look_counts_against_nobody() -> None:
    watch = HeartbeatWatch(TIMEOUT)
    beats = [0]
    watch.serving(0, 0, now=0.0)
    assert watch.stalled(beats, 0.5) == []
    # The parent itself was stopped (or starved) for 20 s; the worker may have been too.
    assert watch.stalled(beats, 20.5) == []
    found = looks(watch, beats, 21.0, 25.5)  # counted from when the parent looked again
    assert found[25.5] == [0] and not any(found[t] for t in found if t < 25.5)


def test_a_look_late_by_less_than_half_the_timeout_still_counts() -> None:
    watch = HeartbeatWatch(TIMEOUT)
    beats = [0]
    watch.serving(0, 0, now=0.0)
    assert watch.stalled(beats, 2.4) == []
    assert watch.stalled(beats, 4.8) == []
    assert watch.stalled(beats, 5.0) == [0]  # looks 2.4 s apart: a loaded parent still judges


async def test_the_heartbeat_is_a_timer_of_the_loop_that_stops_when_the_loop_does() -> None:
    beats = [0, 0]
    receive, send = multiprocessing.Pipe(duplex=False)
    parent = ParentLink(send, beats, 1, interval=0.01)
    parent.start_heartbeat()
    assert beats == [0, 1]  # at once: the parent sees a count when the URL reaches it
    parent.serving("http://127.0.0.1:1")
    assert receive.recv() == "http://127.0.0.1:1"

    async def beating() -> bool:
        return beats[1] >= 4

    await wait_until(beating)
    before = beats[1]
    blocked_until = asyncio.get_running_loop().time() + 0.1
    while asyncio.get_running_loop().time() < blocked_until:  # a callback that does not return
        pass
    assert beats[1] == before  # no thread beats for a loop that does not turn
    assert beats[0] == 0  # only its own slot


async def test_without_a_slot_there_is_no_heartbeat() -> None:
    _receive, send = multiprocessing.Pipe(duplex=False)
    ParentLink(send, None, 0, interval=0.0).start_heartbeat()  # the parent does not watch: nothing


def test_a_started_worker_that_does_not_begin_serving_is_stalled_after_the_startup_timeout() -> None:
    """A restarted worker hanging before it serves was never watched: it held its place forever."""
    watch = HeartbeatWatch(TIMEOUT, startup_timeout=30.0)
    beats = [0, 0]
    watch.started(0, now=0.0)
    watch.started(1, now=0.0)
    found = looks(watch, beats, 0.0, 29.5)
    assert not any(found.values())
    watch.serving(1, 0, now=29.5)  # worker 1 made it in time; worker 0 did not
    beats[1] += 1
    assert watch.stalled(beats, 30.0) == [0]
    watch.gone(0)
    assert watch.stalled(beats, 30.5) == []


def test_time_the_parent_did_not_look_counts_against_no_starting_worker() -> None:
    watch = HeartbeatWatch(TIMEOUT, startup_timeout=30.0)
    watch.started(0, now=0.0)
    assert watch.stalled([0], 1.0) == []
    assert watch.stalled([0], 40.0) == []  # the parent was stopped for 39 s: not the worker's fault
    found = looks(watch, [0], 40.5, 69.5)  # looking as often as it does again
    assert not any(found.values())
    assert watch.stalled([0], 70.0) == [0]
