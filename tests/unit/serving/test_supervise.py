"""`supervise` (serving/workers.py) with real spawned workers: failures before serving, bounded
stops, and what it reserves."""

from __future__ import annotations

import errno
import os
import signal
import socket
import threading
from multiprocessing.connection import Connection
from typing import Any

import pytest

from modelyard.serving import workers as workers_module
from modelyard.serving.workers import WorkerFailed, reserve_port, supervise

# Worker targets: module-level, so that a spawned interpreter can import them.


def exit_at_once(index: int, ready: Connection) -> None:
    ready.close()


def serve_ignoring_sigterm(index: int, ready: Connection) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready.send(f"worker {index}")
    ready.close()
    threading.Event().wait()  # until killed


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
