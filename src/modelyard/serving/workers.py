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

log = logging.getLogger("modelyard.serving")

WorkerTarget = Callable[..., None]
"""`target(index, ready, *args)` runs worker `index`; it sends its URL on `ready` once it serves."""

_MAX_RESTARTS = 5  # in _RESTART_WINDOW seconds; past that the group stops rather than crash-loop
_RESTART_WINDOW = 30.0


def reserve_port(host: str, port: int) -> socket.socket:
    """Bind (not listen) a SO_REUSEPORT socket on `host`:`port` (0 = a free port), which holds the
    port for the workers' own SO_REUSEPORT listeners while the group runs."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise OSError("listen.workers > 1 needs SO_REUSEPORT, which this platform lacks")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host or "0.0.0.0", port))  # "": every interface
    except BaseException:
        sock.close()
        raise
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
        """Unmap (a no-op while views of it are still held: the process exit unmaps it then)."""
        with contextlib.suppress(BufferError):
            self.ints.release()
            self._map.close()


def supervise(
    target: WorkerTarget,
    args: Sequence[Any],
    count: int,
    on_ready: Callable[[list[str]], None],
) -> int:
    """Run `count` workers until SIGINT/SIGTERM and they have all exited; returns the exit status
    (0 when every worker drained and exited 0). `on_ready` gets the workers' URLs once all serve."""
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no loop or lock inherited
    wake_read, wake_write = socket.socketpair()
    wake_read.setblocking(False)
    wake_write.setblocking(False)
    previous_fd = signal.set_wakeup_fd(wake_write.fileno())
    previous = {sig: signal.signal(sig, lambda _sig, _frame: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    workers: dict[int, BaseProcess] = {}
    pipes: dict[int, Connection] = {}
    urls: dict[int, str] = {}
    ever_ready: set[int] = set()
    restarts: list[float] = []
    stopping = failed = announced = False

    def start(index: int) -> None:
        receive, send = context.Pipe(duplex=False)
        process = context.Process(
            target=_child, args=(target, index, send, *args), name=f"modelyard-worker-{index}"
        )
        process.start()
        send.close()
        workers[index], pipes[index] = process, receive

    def signal_all() -> None:
        for process in workers.values():
            if process.pid is not None and process.exitcode is None:
                os.kill(process.pid, signal.SIGTERM)

    try:
        for index in range(count):
            start(index)
        while workers:
            waiting: list[Any] = [wake_read, *(p.sentinel for p in workers.values()), *pipes.values()]
            for ready in wait(waiting):
                if ready is wake_read:
                    if wake_read.recv(64):  # signal numbers; a second one makes the workers stop now
                        stopping = True
                        signal_all()
                    continue
                sender = next((i for i, pipe in pipes.items() if pipe is ready), None)
                if sender is not None:
                    try:
                        urls[sender] = pipes[sender].recv()
                        ever_ready.add(sender)
                    except (EOFError, OSError):
                        pass
                    pipes.pop(sender).close()
                    if not announced and len(urls) == count:
                        announced = True
                        on_ready([urls[i] for i in range(count)])
                    continue
                index = next(i for i, p in workers.items() if p.sentinel == ready)
                process = workers.pop(index)
                process.join()
                pipe = pipes.pop(index, None)
                if pipe is not None:
                    pipe.close()
                if stopping:
                    failed = failed or process.exitcode != 0
                    continue
                now = time.monotonic()
                restarts = [t for t in restarts if now - t < _RESTART_WINDOW] + [now]
                if index not in ever_ready or len(restarts) > _MAX_RESTARTS:
                    log.error("worker %d exited with %s; stopping every worker", index, process.exitcode)
                    stopping = failed = True
                    signal_all()
                    continue
                log.warning("worker %d exited with %s; starting it again", index, process.exitcode)
                start(index)
    finally:
        signal_all()
        for process in workers.values():
            process.join()
        signal.set_wakeup_fd(previous_fd)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        wake_read.close()
        wake_write.close()
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
