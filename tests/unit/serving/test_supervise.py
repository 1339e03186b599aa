"""`supervise` (serving/workers.py) with real spawned workers: failures before serving, bounded
stops, a worker whose event loop stops turning, and what it reserves."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from modelyard.serving import workers as workers_module
from modelyard.serving.workers import ParentLink, WorkerFailed, reserve_port, supervise

# Worker targets: module-level, so that a spawned interpreter can import them.


def exit_at_once(index: int, parent: ParentLink) -> None:
    pass  # its pipe closes as it exits: it never served


def serve_ignoring_sigterm(index: int, parent: ParentLink) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent.serving(f"worker {index}")
    threading.Event().wait()  # until killed


def block_the_loop_once(index: int, parent: ParentLink, marker: str) -> None:
    """Serves with a heartbeat until SIGTERM. Worker 1's first life, once worker 0 serves, runs a
    CPU loop inside its event loop (a handler that never returns); its second life, once it serves,
    stops the group."""
    zero_serves, first_life = Path(marker + ".0"), Path(marker)
    blocks = index == 1 and not first_life.exists()
    if blocks:
        first_life.write_text(f"{os.getpid()}\n", "utf-8")
        until = time.monotonic() + 60
        while not zero_serves.exists() and time.monotonic() < until:
            time.sleep(0.01)  # not serving yet: not watched

    async def main() -> None:
        stopped = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopped.set)
        parent.start_heartbeat()
        parent.serving(f"worker {index}")
        if index == 0:
            await asyncio.to_thread(zero_serves.touch)
        elif blocks:
            until = time.monotonic() + 60  # bounded, should the parent never kill it
            while time.monotonic() < until:
                pass
            return
        else:
            os.kill(os.getppid(), signal.SIGTERM)  # replaced and serving: the test is over
        await stopped.wait()

    asyncio.run(main())


def _never_ready(urls: list[str]) -> None:
    raise AssertionError(f"announced {urls}")


def test_a_worker_that_exits_before_it_serves_stops_the_group(monkeypatch: pytest.MonkeyPatch) -> None:
    real_wait = workers_module.wait

    def wait_for_every_exit(objects: list[Any], timeout: float | None = None) -> list[Any]:
        # Deterministic: every worker has exited before supervise looks, so that its pipe (EOF)
        # and its sentinel come back from the same wait(), the sentinels first.
        pending = [o for o in objects if isinstance(o, int)]
        while pending:
            done = real_wait(pending, 30)
            assert done, "a worker did not exit"
            pending = [o for o in pending if o not in done]
        ready = real_wait(objects, timeout)
        return sorted(ready, key=lambda o: not isinstance(o, int))

    monkeypatch.setattr(workers_module, "wait", wait_for_every_exit)
    exits: list[int] = []
    with pytest.raises(WorkerFailed, match=r"worker \d exited with 0 before it served"):
        supervise(exit_at_once, (), 2, _never_ready, on_exit=exits.append)
    assert sorted(exits) == [0, 1]


def test_workers_that_ignore_sigterm_are_killed_after_the_stop_timeout() -> None:
    urls: list[str] = []
    exits: list[int] = []

    def stop(ready: list[str]) -> None:
        urls.extend(ready)
        os.kill(os.getpid(), signal.SIGTERM)  # supervise's handler has it

    assert supervise(serve_ignoring_sigterm, (), 2, stop, stop_timeout=0.2, on_exit=exits.append) == 1
    assert urls == ["worker 0", "worker 1"]
    assert sorted(exits) == [0, 1]


def test_a_third_signal_kills_the_workers_at_once() -> None:
    def signal_three_times(_urls: list[str]) -> None:
        for _ in range(3):
            os.kill(os.getpid(), signal.SIGTERM)

    # stop_timeout is far beyond the test's patience: only the third signal can end it.
    assert supervise(serve_ignoring_sigterm, (), 2, signal_three_times, stop_timeout=3600) == 1


def test_a_port_something_listens_on_is_not_shared() -> None:
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # as a worker's listener
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        with pytest.raises(OSError) as raised:
            reserve_port("127.0.0.1", listener.getsockname()[1])
        assert raised.value.errno == errno.EADDRINUSE
    reserved = reserve_port("127.0.0.1", 0)  # a free port: nothing to probe
    reserved.close()


def test_a_worker_whose_event_loop_blocks_is_killed_once_and_started_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    marker = tmp_path / "first-life"
    exits: list[int] = []
    caplog.set_level(logging.WARNING, logger="modelyard.serving")
    status = supervise(
        block_the_loop_once, (str(marker),), 2, lambda urls: None, on_exit=exits.append, heartbeat_timeout=1.0
    )
    assert status == 0  # worker 1's second life stopped the group; both drained and exited 0
    first_pid = int(marker.read_text("utf-8"))
    lines = [r.getMessage() for r in caplog.records]
    stalled = [line for line in lines if "sent no heartbeat" in line]
    assert stalled == [
        f"worker 1 (pid {first_pid}) sent no heartbeat for 1.0 s (stopped, or its event loop blocked): "
        "killing it and starting it again"
    ], lines
    assert not any("exited with" in line for line in lines), lines  # said once, with the reason
    assert sorted(exits) == [0, 1, 1]  # worker 1 twice: killed, then stopped with the group
    with pytest.raises(ProcessLookupError):
        os.kill(first_pid, 0)  # killed and reaped, not left to end its loop
