"""`Changes`: a pulse after every scheduler mutation, for those waiting on the state (a drain, tests).

Waiters re-check their condition after each pulse instead of polling on a timer, so a drain answers
as soon as its models serve elsewhere."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable


class Changes:
    def __init__(self) -> None:
        self._event = asyncio.Event()

    def pulse(self) -> None:
        event, self._event = self._event, asyncio.Event()
        event.set()

    async def wait_for(self, condition: Callable[[], bool], within: float) -> bool:
        """Whether `condition()` held within `within` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while not condition():
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await self._event.wait()
        return True
