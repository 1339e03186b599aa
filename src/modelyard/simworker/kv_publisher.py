"""`KvPublisher`: the sim's KV-cache events on ZMQ, as vLLM's `ZmqEventPublisher` sends them.

Each batch is one PUB message of three frames: the topic, its sequence number (8 bytes big-endian,
0, 1, 2, ... from the start) and the msgpack `KVEventBatch`. The last `buffer_steps` batches are
kept for a ROUTER socket that replays them: a request `[b"", start 8 bytes]` (a DEALER's; a REQ's
envelope reads the same) gets `[b"", seq, payload]` for every kept batch from `start`, then
`[b"", END_OF_REPLAY, b""]`. A subscriber that sees a gap in the numbering asks the replay for it.

`publish` runs on the request path, so it never waits: the PUB send is non-blocking on a plain
socket (no future to track) and a send refused counts as dropped. Chaos controls (`control`) make
the faults a subscriber must survive: a pause (a dead publisher: batches are not numbered), drops
(numbered and kept, not sent: replay fills the gap), losses (numbered, neither sent nor kept),
garbage (a payload that is not msgpack).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

import zmq
import zmq.asyncio

from modelyard.balancing.kv_events import END_OF_REPLAY, KVEventBatch, encode_batch
from modelyard.simworker.engine import KvEvent

log = logging.getLogger("modelyard.simworker")

# A PUB queue per subscriber as deep as vLLM's (past it libzmq drops that subscriber's messages).
_SEND_HWM = 100_000
# What `garbage` sends: 0xc1 is the one byte msgpack never uses.
GARBAGE = b"\xc1 not msgpack"
# What `/sim/stats` says of a worker without events (`KvPublisher.stats` otherwise).
STATS_OFF: Mapping[str, object] = {
    "kv_events": None,
    "kv_replay": None,
    "kv_batches_published": 0,
    "kv_batches_dropped": 0,
}


class KvPublisher:
    """Binds on `start()` (port 0 picks a free one; `events_url`, `replay_url` then say where);
    `close()` unbinds and ends the replay task."""

    def __init__(
        self, host: str, events_port: int, replay_port: int | None, buffer_steps: int, topic: str
    ) -> None:
        self.host = host
        self.events_port = events_port
        self.replay_port = replay_port
        self.topic = topic.encode()
        self.events_url: str | None = None
        self.replay_url: str | None = None
        self.batches_published = 0  # sent on PUB
        self.batches_dropped = 0  # numbered but not sent: a refused send, or `drop` and `lose`
        self.next_seq = 0
        self.paused = False
        self.drop = self.lose = self.garbage = 0  # batches still to spoil so
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._context: zmq.asyncio.Context | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._replay: asyncio.Task[None] | None = None

    async def start(self) -> None:
        context = zmq.asyncio.Context()
        try:
            # A plain socket: its non-blocking send queues or refuses at once (an asyncio one hands
            # back a future, to be awaited or its failure is reported as never retrieved).
            self._pub = pub = zmq.Socket(context, zmq.PUB)
            pub.setsockopt(zmq.LINGER, 0)
            pub.setsockopt(zmq.SNDHWM, _SEND_HWM)
            self.events_url = _bind(pub, self.host, self.events_port)
            if self.replay_port is not None:
                self._router = context.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, 0)
                # a whole replay (the buffer and its end marker) queues without a drop
                self._router.setsockopt(zmq.SNDHWM, self._buffer.maxlen + 16 if self._buffer.maxlen else 0)
                self.replay_url = _bind(self._router, self.host, self.replay_port)
        except BaseException:
            self._close_sockets()
            context.term()
            raise
        self._context = context
        if self._router is not None:
            self._replay = asyncio.create_task(self._serve_replay(self._router))

    async def close(self) -> None:
        replay, self._replay = self._replay, None
        if replay is not None:
            replay.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await replay
        self._close_sockets()
        context, self._context = self._context, None
        if context is not None:
            context.term()  # (at once: its sockets are closed, none lingers)

    def _close_sockets(self) -> None:
        pub, router, self._pub, self._router = self._pub, self._router, None, None
        for socket in (pub, router):
            if socket is not None:
                socket.close(linger=0)

    def publish(self, events: list[KvEvent]) -> None:
        """Number, keep and send one batch (subject to the chaos controls); never waits."""
        pub = self._pub
        if pub is None or self.paused:
            return
        seq = self.next_seq
        self.next_seq += 1
        if self.garbage:
            self.garbage -= 1
            payload = GARBAGE
        else:
            payload = encode_batch(KVEventBatch(ts=time.time(), events=events))
        if self.lose:
            self.lose -= 1
            self.batches_dropped += 1
            return
        self._buffer.append((seq, payload))
        if self.drop:
            self.drop -= 1
            self.batches_dropped += 1
            return
        try:
            pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # (zmq.Again: the queue is full)
            self.batches_dropped += 1
        else:
            self.batches_published += 1

    def control(
        self,
        *,
        pause: bool | None = None,
        drop: int | None = None,
        lose: int | None = None,
        garbage: int | None = None,
    ) -> None:
        """The chaos controls (`POST /sim/kv-events`); counts replace those still pending."""
        if pause is not None:
            self.paused = pause
        if drop is not None:
            self.drop = drop
        if lose is not None:
            self.lose = lose
        if garbage is not None:
            self.garbage = garbage

    def stats(self) -> dict[str, object]:
        """For `GET /sim/stats`: where the sockets are bound, and the counters."""
        return {
            "kv_events": self.events_url,
            "kv_replay": self.replay_url,
            "kv_batches_published": self.batches_published,
            "kv_batches_dropped": self.batches_dropped,
        }

    def state(self) -> dict[str, object]:
        """The stats, the next sequence number and the chaos still pending."""
        return {
            **self.stats(),
            "next_seq": self.next_seq,
            "paused": self.paused,
            "drop": self.drop,
            "lose": self.lose,
            "garbage": self.garbage,
        }

    async def _serve_replay(self, router: zmq.asyncio.Socket) -> None:
        while True:  # until close() cancels it
            frames = await router.recv_multipart()
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                log.warning("KV events replay: ignored a request of %d frames not [b'', seq]", len(frames))
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big")
            # A copy: publish appends to the buffer while the sends wait.
            kept = [(seq, payload) for seq, payload in self._buffer if seq >= start]
            try:
                for seq, payload in kept:
                    await router.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
                await router.send_multipart([client, b"", END_OF_REPLAY, b""])
            except zmq.ZMQError as exc:  # a client gone is its own loss; the replay goes on
                log.warning("KV events replay: %s", exc)


def _bind(socket: zmq.Socket[Any], host: str, port: int) -> str:
    """Bind tcp on host:port (0: a free port); the endpoint bound. A failure is an OSError naming
    the address, as a listener's is."""
    address = host or "*"
    if ":" in address:
        socket.setsockopt(zmq.IPV6, 1)
        address = f"[{address}]"
    endpoint = f"tcp://{address}:{port or '*'}"
    try:
        socket.bind(endpoint)
    except zmq.ZMQError as exc:
        raise OSError(exc.errno, f"{endpoint}: {exc.strerror}") from None
    bound = socket.getsockopt(zmq.LAST_ENDPOINT)
    return bound.decode() if isinstance(bound, bytes) else str(bound)
