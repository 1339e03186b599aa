"""One server as N processes on one port: the parent reserves the port (SO_REUSEPORT), spawns the
workers, which each bind it too and run their own event loop, and supervises them: a worker that
dies is started again, and so is one whose heartbeat stops (killed first: stopped, or its event loop
blocked), SIGINT/SIGTERM is passed on to every worker (each drains as a single process does) and
the parent exits when they all have. The workers share plain counters through `SharedInts`, a file
mapped into every process where each slot has one writer."""

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
from ctypes import c_longlong
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from modelyard.errors import ModelyardError

log = logging.getLogger("modelyard.serving")

WorkerTarget = Callable[..., None]
"""`target(index, parent, *args)` runs worker `index`; it calls `parent.serving(url)` once it
serves, and `parent.start_heartbeat()` on its event loop (a ParentLink)."""

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


class ParentLink:
    """What a worker has of its supervising process: the pipe it sends its URL on once it serves,
    and its heartbeat: a counter in memory it shares with the parent (one slot per worker, this
    worker its one writer), which its event loop bumps every `interval` seconds."""

    def __init__(self, ready: Connection, beats: Any, index: int, interval: float) -> None:
        self._ready = ready
        self._beats = beats  # a RawArray of c_longlong; None when the parent does not watch
        self._index = index
        self.interval = interval

    def serving(self, url: str) -> None:
        """Tell the parent this worker serves at `url` (its heartbeat is watched from now on)."""
        self._ready.send(url)
        self._ready.close()

    def start_heartbeat(self) -> None:
        """Bump this worker's counter now and every `interval` seconds, from a timer of the running
        loop: off the request path (no system call, no I/O), and it stops when the loop does: a
        stopped process, or a callback that never returns, is a heartbeat that stops."""
        beats, index, interval = self._beats, self._index, self.interval
        if beats is None or interval <= 0:
            return
        loop = asyncio.get_running_loop()

        def beat() -> None:
            beats[index] += 1
            loop.call_later(interval, beat)

        beat()


# How long a (re)started worker may take to serve: an interpreter's imports and a gateway's build
# take seconds; a worker still not serving after this hangs, and would never be watched otherwise.
STARTUP_TIMEOUT = 60.0


class HeartbeatWatch:
    """The parent's judgement of its workers' heartbeats, with time an argument (no clock of its
    own, DESIGN.md habit 1): a worker that serves and whose counter has not moved for `timeout`
    seconds of the parent's looking is stalled, and so is one started `startup_timeout` ago that
    has not begun serving. Time the parent itself did not look (it was stopped or starved for more
    than half the timeout) counts against nobody."""

    def __init__(self, timeout: float, startup_timeout: float = STARTUP_TIMEOUT) -> None:
        self.timeout = timeout
        self.startup_timeout = startup_timeout
        self._seen: dict[int, tuple[int, float]] = {}  # worker index -> (its counter, since when)
        self._starting: dict[int, float] = {}  # worker index -> when it was started, until it serves
        self._looked: float | None = None

    def started(self, index: int, now: float) -> None:
        """Worker `index` was started at `now`: it must begin serving within `startup_timeout`."""
        self._starting[index] = now

    def serving(self, index: int, beat: int, now: float) -> None:
        """Worker `index` began serving (again) with its counter at `beat`: watched from `now`."""
        self._starting.pop(index, None)
        self._seen[index] = (beat, now)

    def gone(self, index: int) -> None:
        self._seen.pop(index, None)
        self._starting.pop(index, None)

    def stalled(self, beats: Sequence[int], now: float) -> list[int]:
        """The workers whose counter in `beats` has not moved for `timeout` seconds at `now`."""
        late = self._looked is not None and now - self._looked > self.timeout / 2
        self._looked = now
        found = []
        for index, since in list(self._starting.items()):
            if late:
                self._starting[index] = now
            elif now - since >= self.startup_timeout:
                found.append(index)
        for index, (seen, since) in list(self._seen.items()):
            beat = beats[index]
            if beat != seen or late:
                self._seen[index] = (beat, now)
            elif now - since >= self.timeout:
                found.append(index)
        return found


def supervise(
    target: WorkerTarget,
    args: Sequence[Any],
    count: int,
    on_ready: Callable[[list[str]], None],
    *,
    stop_timeout: float = 30.0,
    on_exit: Callable[[int], None] = lambda index: None,
    heartbeat_timeout: float = 0.0,
) -> int:
    """Run `count` workers until SIGINT/SIGTERM and they have all exited; returns the exit status
    (0 when every worker drained and exited 0). `on_ready` gets the workers' URLs once all serve;
    `on_exit(index)` runs when a worker has exited, before it is started again. Stopping is bounded:
    workers still running `stop_timeout` seconds after the first signal (or at a third signal) are
    killed. With a `heartbeat_timeout`, a worker that serves and whose heartbeat stops for that long
    is killed (SIGKILL: a stopped process cannot handle SIGTERM) and started again as one that
    exited is; 0: not watched. Raises WorkerFailed when a worker exits before it first served."""
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
    # Heartbeats: each worker's loop bumps its slot every tenth of the timeout; the parent looks as
    # often, so a stalled worker is killed between `heartbeat_timeout` and a tenth more after its
    # last beat.
    watch = HeartbeatWatch(heartbeat_timeout) if heartbeat_timeout > 0 else None
    beats = context.RawArray(c_longlong, count) if watch is not None else None
    beat_interval = heartbeat_timeout / 10
    next_look = 0.0
    killed: set[int] = set()  # workers killed for a stopped heartbeat, not reaped yet

    def start(index: int) -> None:
        receive, send = context.Pipe(duplex=False)
        process = context.Process(
            target=_child,
            args=(target, index, send, beats, beat_interval, *args),
            name=f"modelyard-worker-{index}",
        )
        process.start()
        send.close()
        if watch is not None:
            watch.started(index, time.monotonic())
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
                if watch is not None and beats is not None:
                    watch.serving(index, beats[index], time.monotonic())
        except (EOFError, OSError):
            pass  # it exited without serving: its sentinel says so
        pipe.close()

    def look_at_heartbeats() -> None:
        nonlocal next_look
        now = time.monotonic()
        if watch is None or beats is None or stopping or now < next_look:
            return
        next_look = now + beat_interval
        for index in watch.stalled(beats[:], now):
            process = workers.get(index)
            if index in killed or process is None or process.pid is None:
                continue
            if index in pipes.values():  # it never said it serves
                log.error(
                    "worker %d (pid %d) did not begin serving within %.0f s: killing it",
                    index, process.pid, watch.startup_timeout,
                )  # fmt: skip
            else:
                log.error(
                    "worker %d (pid %d) sent no heartbeat for %.1f s (stopped, or its event loop blocked): "
                    "killing it and starting it again", index, process.pid, heartbeat_timeout,
                )  # fmt: skip
            killed.add(index)
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)  # its sentinel follows: restarted as if it exited

    try:
        for index in range(count):
            start(index)
        while workers:
            waiting: list[Any] = [wake_read, *sentinels, *pipes]
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            if watch is not None and not stopping:
                until_look = max(0.0, next_look - time.monotonic())
                timeout = until_look if timeout is None else min(timeout, until_look)
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
                was_killed = index in killed
                killed.discard(index)
                if watch is not None:
                    watch.gone(index)
                if stopping:
                    failed = failed or process.exitcode != 0
                    continue
                now = time.monotonic()
                # Killed for its heartbeat: it was replaced as promised, not crashing; a worker that
                # keeps stalling is replaced each time rather than taking the whole group down.
                restarts = [t for t in restarts if now - t < _RESTART_WINDOW] + ([] if was_killed else [now])
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
                if not was_killed:  # a killed one was logged with the reason
                    log.warning("worker %d exited with %s; starting it again", index, process.exitcode)
                start(index)
            # After what this wake-up brought: a worker whose URL came with it serves, however close
            # to the startup timeout it came.
            look_at_heartbeats()
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


def _child(
    target: WorkerTarget, index: int, ready: Connection, beats: Any, interval: float, *args: Any
) -> None:
    # Its own process group: Ctrl-C in a terminal reaches the parent only, which passes it on once.
    os.setpgid(0, 0)
    target(index, ParentLink(ready, beats, index, interval), *args)


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
