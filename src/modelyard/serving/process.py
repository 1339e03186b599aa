"""Running a server process: the event loop (uvloop when installed), and the wait for SIGINT or
SIGTERM followed by the drain and a bounded stop. One place for every `modelyard` server command."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

from modelyard.serving.server import HttpServer

log = logging.getLogger("modelyard.serving")


def run(main: Coroutine[Any, Any, None]) -> None:
    """Run `main` to completion on uvloop when it is installed, else on asyncio's loop."""
    raise_open_file_limit()
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main)


async def serve_until_signal(
    servers: Sequence[HttpServer],
    stop: Callable[[], Awaitable[None]] | None = None,
    drain: Callable[[], Awaitable[object]] | None = None,
) -> None:
    """Wait for SIGINT or SIGTERM; then drain `servers` for their longest `listen.drain_seconds`, or
    run `drain` (which bounds itself) instead when given (a second signal ends either at once), and
    call `stop` (default: stop each server)."""
    loop = asyncio.get_running_loop()
    first, second = asyncio.Event(), asyncio.Event()

    def received() -> None:
        (second if first.is_set() else first).set()

    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):  # no signal handlers on Windows' loop
            loop.add_signal_handler(sig, received)
            installed.append(sig)
    settle_garbage_collector()
    try:
        await first.wait()
        seconds = max((server.listen.drain_seconds for server in servers), default=0.0)
        for server in servers:
            server.begin_drain()
        if drain is not None:
            log.info("draining; signal again to stop now")
            await _until_second(drain(), second)
        elif seconds > 0:
            log.info("draining for %gs (readiness answers 503); signal again to stop now", seconds)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(seconds):
                    await second.wait()
    finally:
        try:
            if stop is not None:
                await stop()
            else:
                for server in servers:
                    await server.stop()
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)


async def _until_second(work: Awaitable[object], second: asyncio.Event) -> None:
    """Run `work` until it ends or `second` is set, whichever comes first (the other is cancelled)."""
    task = asyncio.ensure_future(work)
    interrupted = asyncio.ensure_future(second.wait())
    try:
        await asyncio.wait({task, interrupted}, return_when=asyncio.FIRST_COMPLETED)
        if interrupted.done() and not task.done():
            log.info("second signal: stopping without waiting for the drain")
    finally:
        for pending in (task, interrupted):
            pending.cancel()
        await asyncio.gather(task, interrupted, return_exceptions=True)


def settle_garbage_collector() -> None:
    """Move everything built at start-up out of the collector's view and collect less often: the
    request path allocates many short-lived objects, and full collections that walk the whole
    heap were the gateway's tail latency under load."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 50, 100)


def raise_open_file_limit() -> None:
    """As Go's runtime does at start: lift the soft limit on open files to the hard one, so that
    listen.max_connections, not EMFILE at accept, is what bounds connections."""
    try:
        import resource
    except ImportError:  # Windows
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):  # e.g. macOS refuses an unlimited hard limit
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
