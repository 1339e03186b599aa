"""`SiblingState`: the routing state of the workers of one gateway (`listen.workers` > 1) without
Redis. Each worker keeps its own MemoryState, reads from it alone, and tells the other workers what
it sets and publishes; they apply it to theirs. kv_aware's affinities and prefix_aware's index
(gateway/prefix_sharing.py, over the channel) are thereby learnt by all from the answers of any.

The messages go through `Rings`: a shared file (tmpfs) with one ring of bytes per worker, written by
that worker alone and read by the others every `POLL_SECONDS`:
- a ring is two int64 counters (bytes reserved, bytes committed, both counted since the ring began)
  and `RING_BYTES` of data; a message is a 4-byte length and its bytes, written where the committed
  count points (wrapping at the end), after the reserved count has moved past it;
- a reader keeps its own count of bytes read. It copies all that is new at once, then checks the
  reserved count: a writer that has lapped it (written over what it was copying) makes it skip to
  the committed count and drop what it missed, as Redis pub/sub drops what a slow subscriber missed.
  Nothing locks, and a writer never waits for a reader;
- a restarted worker writes on from the committed count its predecessor left, and reads from where
  the others' rings stand now (what it missed expires, or is learnt again).

Delivery is at most once and about `POLL_SECONDS` late; a message larger than a quarter of a ring is
dropped (a prefix-index batch is at most 1 MiB: gateway/prefix_sharing.py).

Two workers may set one key at about the same time (each missed it, and chose). A set carries
when it expires on the machine's monotonic clock, which every process shares; each worker keeps
exactly that instant, and the later one wins everywhere (then the larger value): so the workers
agree once both sets have arrived, instead of each keeping the other's.

The rings take `count` x (RING_BYTES or LOG_RING_BYTES) of the file's folder, allocated when the
file is made (`create_rings`): a tmpfs that cannot hold them fails there, with ENOSPC, instead of
killing a worker with SIGBUS when its ring first wraps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
import struct
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import orjson

from modelyard.state.memory import MemoryState

log = logging.getLogger("modelyard.state")

RINGS_FILE = "rings.bin"
RING_BYTES = 4 << 20  # data per worker: a prefix-index batch is at most 1 MiB
LOG_RING_BYTES = 1 << 20  # the routing log's: about 10,000 records per worker
POLL_SECONDS = 0.01
_HEADER = 16  # reserved, committed
_COUNT = struct.Struct("<q")
_LENGTH = struct.Struct("<I")
_CHANNEL = struct.Struct("<H")
MAX_MESSAGE = RING_BYTES // 4  # a ring takes messages up to a quarter of its size
_SET, _PUBLISH = b"S", b"P"


def rings_size(count: int, ring_bytes: int = RING_BYTES) -> int:
    return count * (_HEADER + ring_bytes)


def create_rings(path: Path, count: int, ring_bytes: int = RING_BYTES) -> None:
    """The shared file for `count` workers, all zero and allocated: made once, by their parent.
    OSError (ENOSPC) when its folder cannot hold it."""
    with path.open("wb") as file:
        os.posix_fallocate(file.fileno(), 0, rings_size(count, ring_bytes))


class Rings:
    """Worker `index`'s ring to write, and the others' to read, in the file at `path` (made by
    `create_rings` with the same `ring_bytes`)."""

    def __init__(self, path: Path, index: int, count: int, ring_bytes: int = RING_BYTES) -> None:
        self.index, self.count = index, count
        self._ring_bytes = ring_bytes
        self.max_message = ring_bytes // 4 - _LENGTH.size  # the longest message `send` takes
        with path.open("r+b") as file:
            self._map = mmap.mmap(file.fileno(), rings_size(count, ring_bytes))
        self._view = memoryview(self._map)
        self._mine = self._start(index)
        self._written = self._counter(self._mine + 8)  # a predecessor's messages stay readable
        self._read = {i: self._counter(self._start(i) + 8) for i in range(count) if i != index}
        self.dropped = 0  # messages lost: too large to send, or overwritten before they were read

    def send(self, message: bytes) -> bool:
        """Put `message` in this worker's ring; False (and counted) when it is too large."""
        if len(message) > self.max_message:
            self.dropped += 1
            return False
        start, end = self._written, self._written + _LENGTH.size + len(message)
        _COUNT.pack_into(self._view, self._mine, end)  # readers: what lies before end - ring_bytes is going
        self._copy_in(self._mine, start, _LENGTH.pack(len(message)) + message)
        _COUNT.pack_into(self._view, self._mine + 8, end)
        self._written = end
        return True

    def receive(self) -> list[bytes]:
        """The messages the other workers sent since the last call, oldest first per worker."""
        found: list[bytes] = []
        for index, read in self._read.items():
            ring = self._start(index)
            committed = self._counter(ring + 8)
            if committed - read > self._ring_bytes:  # lapped while away: what it held is gone
                self.dropped += 1
                self._read[index] = committed
                continue
            if read == committed:
                continue
            # One copy of everything new, then the messages cut from it: a round reads hundreds.
            span = self._copy_out(ring, read, committed - read)
            if self._counter(ring) - self._ring_bytes > read:  # the writer went over it meanwhile
                self._read[index] = self._counter(ring + 8)
                self.dropped += 1
                continue
            at, end = 0, len(span)
            while at < end:
                (length,) = _LENGTH.unpack_from(span, at)
                if length > self.max_message or at + _LENGTH.size + length > end:
                    self.dropped += 1  # not a message: a torn length; start again from the end
                    break
                found.append(span[at + _LENGTH.size : at + _LENGTH.size + length])
                at += _LENGTH.size + length
            self._read[index] = committed
        return found

    def close(self) -> None:
        with contextlib.suppress(BufferError):
            self._view.release()
            self._map.close()

    def _start(self, index: int) -> int:
        return index * (_HEADER + self._ring_bytes)

    def _counter(self, at: int) -> int:
        return int(_COUNT.unpack_from(self._view, at)[0])

    def _copy_in(self, ring: int, total: int, data: bytes) -> None:
        at = total % self._ring_bytes
        first = min(len(data), self._ring_bytes - at)
        base = ring + _HEADER
        self._view[base + at : base + at + first] = data[:first]
        if first < len(data):
            self._view[base : base + len(data) - first] = data[first:]

    def _copy_out(self, ring: int, total: int, length: int) -> bytes:
        at = total % self._ring_bytes
        first = min(length, self._ring_bytes - at)
        base = ring + _HEADER
        data = bytes(self._view[base + at : base + at + first])
        if first < length:
            data += bytes(self._view[base : base + length - first])
        return data


class SiblingState:
    """A SharedState for the workers of one gateway: a MemoryState here, kept in step with the
    others' through `rings`. `start()` begins applying what they send; `observe(event, count)` is
    told of messages "sent", "applied" and "dropped"."""

    def __init__(
        self,
        local: MemoryState,
        rings: Rings,
        observe: Callable[[str, int], None] = lambda event, count: None,
    ) -> None:
        self._local = local
        self._rings = rings
        self._observe = observe
        self._dropped = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._follow(), name="sibling-state")

    async def get(self, key: str) -> str | None:
        return await self._local.get(key)

    async def set(self, key: str, value: str, ttl: float) -> None:
        expires = time.monotonic() + ttl  # the same instant here and in every other worker
        self._local.set_until(key, value, expires)
        self._send(_SET + orjson.dumps([key, value, expires]))

    async def publish(self, channel: str, payload: bytes) -> bool:
        """True when the other workers will get `payload` (the ring took it)."""
        name = channel.encode()
        sent = self._send(_PUBLISH + _CHANNEL.pack(len(name)) + name + payload)
        await self._local.publish(channel, payload)
        return sent

    def subscribe(self, channel: str) -> AsyncIterator[bytes]:
        return self._local.subscribe(channel)

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await self._local.close()
        self._rings.close()

    async def apply(self) -> None:
        """Apply what the other workers sent since the last call (the follower's round)."""
        applied = 0
        for message in self._rings.receive():
            kind, body = message[:1], message[1:]
            try:
                if kind == _SET:
                    key, value, expires = orjson.loads(body)
                    self._take(str(key), str(value), float(expires))
                elif kind == _PUBLISH:
                    (size,) = _CHANNEL.unpack_from(body)
                    end = _CHANNEL.size + size
                    await self._local.publish(body[_CHANNEL.size : end].decode(), body[end:])
                else:
                    raise ValueError(f"unknown kind {kind!r}")
            except (ValueError, TypeError, struct.error):  # orjson.JSONDecodeError is a ValueError
                log.warning("a message from another worker could not be read; skipped")
                continue
            applied += 1
        if applied:
            self._observe("applied", applied)
        self._count_dropped()

    def _take(self, key: str, value: str, expires: float) -> None:
        """Another worker's set, unless what is held here expires later (a later set), or at the
        same instant with a value that sorts after (so that both workers keep the same)."""
        if expires <= time.monotonic():
            return
        held = self._local.held(key)
        if held is not None and (held[1], held[0]) >= (expires, value):
            return
        self._local.set_until(key, value, expires)

    def _send(self, message: bytes) -> bool:
        sent = self._rings.send(message)
        if sent:
            self._observe("sent", 1)
        self._count_dropped()
        return sent

    def _count_dropped(self) -> None:
        dropped = self._rings.dropped
        if dropped != self._dropped:
            self._observe("dropped", dropped - self._dropped)
            self._dropped = dropped

    async def _follow(self) -> None:
        while True:
            try:
                await self.apply()
            except Exception:  # one bad round must not stop the following ones
                log.exception("applying the other workers' state failed; trying again")
            await asyncio.sleep(POLL_SECONDS)
