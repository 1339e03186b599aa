"""`serve_until_signal`'s drain step: the drain runs until it ends or a second signal comes."""

from __future__ import annotations

import asyncio

from modelyard.serving.process import _until_second


async def test_a_drain_that_ends_returns_at_once() -> None:
    second = asyncio.Event()
    ran: list[str] = []

    async def drain() -> None:
        ran.append("drained")

    await asyncio.wait_for(_until_second(drain(), second), 5)
    assert ran == ["drained"]


async def test_a_second_signal_cancels_the_drain() -> None:
    second = asyncio.Event()
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def drain() -> None:
        started.set()
        try:
            await asyncio.Event().wait()  # never ends by itself
        except asyncio.CancelledError:
            cancelled.set()
            raise

    waiting = asyncio.create_task(_until_second(drain(), second))
    await asyncio.wait_for(started.wait(), 5)
    second.set()
    await asyncio.wait_for(waiting, 5)
    assert cancelled.is_set()
