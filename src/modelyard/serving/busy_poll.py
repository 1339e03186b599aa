"""Busy polling: a worker that keeps polling its sockets for a moment around each request, instead
of sleeping in the poller (HAProxy's `busy-polling`; `listen.busy_poll`).

A CPU that sleeps while its process waits for the next read can take long to wake: on a virtual
machine the sleep hands the CPU back to the host, and the wake-up goes through it. At one
connection that wake-up is paid twice a request (the backend's answer, the client's next request),
and on the 2-CPU VM here it cost more than the gateway's own Python (benchmarks/README.md, "One
connection: busy polling"). A loop with a callback ready polls with a zero timeout (asyncio's loop
and uvloop both do), so a callback that queues itself again keeps the loop awake, and what arrives
within the window after a request begins or ends is read at once.

Only the lean listener's requests are counted and polled for (the proxied inference routes). It
polls only while at most one of them is being answered: with more in flight their own traffic keeps
the worker awake, and polling would only take CPU from other processes on the machine (in the
benchmark, the backends and wrk). Off by default: while requests keep coming within the window, it
keeps a CPU busy.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

# More requests than this being answered at once: the worker does not poll (see above).
MOST_ANSWERING = 1


class BusyPoll:
    """Polls on `loop` for `window` seconds after each request begins and ends, while at most
    MOST_ANSWERING are being answered. `clock`: monotonic seconds (a fake one in tests)."""

    __slots__ = ("_answering", "_clock", "_closed", "_loop", "_polling", "_until", "_window")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, window: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if window <= 0:
            raise ValueError("busy polling needs a window longer than 0 seconds")
        self._loop = loop
        self._window = window
        self._clock = clock
        self._answering = 0
        self._until = 0.0
        self._polling = False
        self._closed = False

    @property
    def polling(self) -> bool:
        """Whether the loop is being kept awake now."""
        return self._polling

    @property
    def answering(self) -> int:
        return self._answering

    def begin(self) -> None:
        """A request is being answered."""
        self._answering += 1
        self._extend()

    def end(self) -> None:
        """A request's answer ended (however it ended): the window runs on, for the next request."""
        self._answering -= 1
        self._extend()

    def close(self) -> None:
        """No more polling (the server stops)."""
        self._closed = True

    def _extend(self) -> None:
        if self._answering > MOST_ANSWERING or self._closed:
            return
        self._until = self._clock() + self._window
        if not self._polling:
            self._polling = True
            self._loop.call_soon(self._poll)

    def _poll(self) -> None:
        # Queued again, it keeps the loop from sleeping until the next turn (see the module's docstring).
        if self._closed or self._answering > MOST_ANSWERING or self._clock() >= self._until:
            self._polling = False
            return
        self._loop.call_soon(self._poll)
