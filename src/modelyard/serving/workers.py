"""One server as N processes on one port: the parent reserves the port (SO_REUSEPORT), spawns the
workers, which each bind it too and run their own event loop, and supervises them: a worker that
dies is started again, SIGINT/SIGTERM is passed on to every worker (each drains as a single process
does) and the parent exits when they all have. The workers share plain counters through
`SharedInts`, a file mapped into every process where each slot has one writer."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import multiprocessing
import os
import signal
import socket
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from modelyard.errors import ModelyardError

log = logging.getLogger("modelyard.serving")

WorkerTarget = Callable[..., None]
"""`target(index, ready, *args)` runs worker `index`; it sends its URL on `ready` once it serves."""

_MAX_RESTARTS = 5  # in _RESTART_WINDOW seconds; past that the group stops rather than crash-loop
_RESTART_WINDOW = 30.0


def reserve_port(host: str, port: int) -> socket.socket:
    """Bind (not listen) a SO_REUSEPORT socket on `host`:`port` (0 = a free port), which holds the
    port for the workers' own SO_REUSEPORT listeners while the group runs. OSError (address in use)
    when something listens there already, another group of workers included: SO_REUSEPORT alone
    would let the two share the port."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise OSError("listen.workers > 1 needs SO_REUSEPORT, which this platform lacks")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    address = (host or "0.0.0.0", port)  # "": every interface
    probe = socket.socket(family, socket.SOCK_STREAM)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if port:  # without SO_REUSEPORT: fails while any listener holds the port
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    finally:
        probe.close()
    return sock


class SharedInts:
    """`length` int64 slots in a file mapped into each process (a tmpfs file where there is one).
    Lock-free by discipline: each slot has a single writer; readers may see a sum a moment old."""

    def __init__(self, path: Path, length: int, *, create: bool) -> None:
        size = max(1, length) * 8
        if create:
            with path.open("wb") as file:
                file.truncate(size)
        with path.open("r+b") as file:
            self._map = mmap.mmap(file.fileno(), size)
        self.ints = memoryview(self._map).cast("q")

    def close(self) -> None:
        """Unmap, once nothing uses `ints` any more (a no-op while views of it are held). A worker
        never calls it: the loads it handed out use the map until the process exits."""
        with contextlib.suppress(BufferError):
            self.ints.release()
            self._map.close()


class WorkerFailed(ModelyardError):
    """A worker exited before it first served (its config, its port): the group stops at once."""


def supervise(
    target: WorkerTarget,
    args: Sequence[Any],
    count: int,
    on_ready: Callable[[list[str]], None],
    *,
    stop_timeout: float = 30.0,
    on_exit: Callable[[int], None] = lambda index: None,
) -> int:
    """Run `count` workers until SIGINT/SIGTERM and they have all exited; returns the exit status
    (0 when every worker drained and exited 0). `on_ready` gets the workers' URLs once all serve;
    `on_exit(index)` runs when a worker has exited, before it is started again. Stopping is bounded:
    workers still running `stop_timeout` seconds after the first signal (or at a third signal) are
    killed. Raises WorkerFailed when a worker exits before it first served."""
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no loop or lock inherited
    wake_read, wake_write = socket.socketpair()
    wake_read.setblocking(False)
    wake_write.setblocking(False)
    previous_fd = signal.set_wakeup_fd(wake_write.fileno())
    previous = {sig: signal.signal(sig, lambda _sig, _frame: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    workers: dict[int, BaseProcess] = {}
    sentinels: dict[int, int] = {}  # sentinel -> worker index
    pipes: dict[Connection, int] = {}  # the pipe a worker sends its URL on -> worker index
    urls: dict[int, str] = {}  # worker index -> its URL, once it served (kept across restarts)
    restarts: list[float] = []
    failed = announced = stopping = False
    failure: str | None = None
    signals = 0
    deadline: float | None = None  # once stopping: when the workers still running are killed

    def start(index: int) -> None:
        receive, send = context.Pipe(duplex=False)
        process = context.Process(
            target=_child, args=(target, index, send, *args), name=f"modelyard-worker-{index}"
        )
        process.start()
        send.close()
        workers[index] = process
        sentinels[process.sentinel] = index
        pipes[receive] = index

    def signal_all(sig: signal.Signals = signal.SIGTERM) -> None:
        for process in workers.values():
            if process.pid is not None and process.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, sig)

    def stop() -> None:
        nonlocal deadline, stopping
        if not stopping:
            stopping, deadline = True, time.monotonic() + stop_timeout
        signal_all()

    def receive_url(pipe: Connection) -> None:
        index = pipes.pop(pipe)
        try:
            if pipe.poll():
                urls[index] = pipe.recv()
        except (EOFError, OSError):
            pass  # it exited without serving: its sentinel says so
        pipe.close()

    try:
        for index in range(count):
            start(index)
        while workers:
            waiting: list[Any] = [wake_read, *sentinels, *pipes]
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready_now = wait(waiting, timeout)
            if deadline is not None and time.monotonic() >= deadline:
                log.error("workers still running %.0f s after the stop; killing them", stop_timeout)
                signal_all(signal.SIGKILL)
                failed = True
                deadline = None  # SIGKILL cannot be ignored: their sentinels follow
            for ready in ready_now:
                if ready is wake_read:
                    received = wake_read.recv(64)  # signal numbers
                    if received:
                        signals += len(received)
                        stop()  # a second one makes the workers stop now (serving/process.py)
                        if signals >= 3:  # a third: kill them, whatever they are doing
                            signal_all(signal.SIGKILL)
                            failed = True
                    continue
                if ready in pipes:
                    receive_url(ready)
                    if not announced and len(urls) == count:
                        announced = True
                        on_ready([urls[i] for i in range(count)])
                    continue
                index_or_none = sentinels.pop(ready, None) if isinstance(ready, int) else None
                if index_or_none is None:
                    continue  # handled already in this round
                index = index_or_none
                process = workers.pop(index)
                process.join()
                pipe = next((p for p, i in pipes.items() if i == index), None)
                if pipe is not None:  # what it sent before it exited still counts
                    receive_url(pipe)
                on_exit(index)
                if stopping:
                    failed = failed or process.exitcode != 0
                    continue
                now = time.monotonic()
                restarts = [t for t in restarts if now - t < _RESTART_WINDOW] + [now]
                if index not in urls:
                    failure = f"worker {index} exited with {process.exitcode} before it served"
                    failed = True
                    stop()
                    continue
                if len(restarts) > _MAX_RESTARTS:
                    log.error("worker %d exited with %s; stopping every worker", index, process.exitcode)
                    failed = True
                    stop()
                    continue
                log.warning("worker %d exited with %s; starting it again", index, process.exitcode)
                start(index)
    finally:
        signal_all()
        for process in workers.values():
            process.join(stop_timeout)
            if process.exitcode is None:
                process.kill()
                process.join()
        for pipe in pipes:
            pipe.close()
        signal.set_wakeup_fd(previous_fd)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        wake_read.close()
        wake_write.close()
    if failure is not None:
        raise WorkerFailed(failure + "; stopped every worker")
    return 1 if failed else 0


def _child(target: WorkerTarget, index: int, ready: Connection, *args: Any) -> None:
    # Its own process group: Ctrl-C in a terminal reaches the parent only, which passes it on once.
    os.setpgid(0, 0)
    target(index, ready, *args)


def watch_parent(on_gone: Callable[[], None]) -> None:
    """Call `on_gone` (once) on the running loop when the supervising process disappears."""
    parent = multiprocessing.parent_process()
    if parent is None or parent.sentinel is None:
        return
    loop = asyncio.get_running_loop()
    sentinel = parent.sentinel

    def gone() -> None:
        loop.remove_reader(sentinel)
        on_gone()

    loop.add_reader(sentinel, gone)
