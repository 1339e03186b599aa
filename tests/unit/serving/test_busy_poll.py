"""Busy polling (serving/busy_poll.py): how long the loop is kept awake, and when it is not. A fake
clock decides the window; the loop's own turns run the poller."""

from __future__ import annotations

import asyncio

import pytest

from modelyard.serving.busy_poll import MOST_ANSWERING, BusyPoll


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def turns(n: int = 3) -> None:
    """Let the loop go round n times (the poller runs once a turn)."""
    for _ in range(n):
        await asyncio.sleep(0)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def busy(clock: Clock) -> BusyPoll:
    return BusyPoll(asyncio.get_running_loop(), 0.001, clock)


async def test_it_polls_from_a_request_until_the_window_after_its_end(busy: BusyPoll, clock: Clock) -> None:
    assert not busy.polling
    busy.begin()
    await turns()
    assert busy.polling
    clock.now += 0.0005
    busy.end()  # the window runs from here again
    clock.now += 0.0009
    await turns()
    assert busy.polling and busy.answering == 0
    clock.now += 0.0002
    await turns()
    assert not busy.polling


async def test_a_request_that_outlasts_the_window_lets_the_loop_sleep(busy: BusyPoll, clock: Clock) -> None:
    busy.begin()
    clock.now += 0.002
    await turns()
    assert not busy.polling and busy.answering == 1
    busy.end()  # its end polls again, for the client's next request
    await turns()
    assert busy.polling


async def test_it_does_not_poll_while_more_requests_are_answered(busy: BusyPoll) -> None:
    for _ in range(MOST_ANSWERING + 1):
        busy.begin()
    await turns()
    assert not busy.polling  # their own traffic keeps the loop awake
    busy.end()
    await turns()
    assert busy.polling and busy.answering == MOST_ANSWERING


async def test_closed_it_stops_at_the_next_turn_and_never_starts_again(busy: BusyPoll) -> None:
    busy.begin()
    await turns()
    busy.close()
    await turns()
    assert not busy.polling
    busy.end()
    busy.begin()
    await turns()
    assert not busy.polling


async def test_a_window_of_zero_is_refused() -> None:
    with pytest.raises(ValueError, match="longer than 0"):
        BusyPoll(asyncio.get_running_loop(), 0.0)
