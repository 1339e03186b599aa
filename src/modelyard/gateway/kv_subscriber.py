"""The KV-event subscriptions of prefix_aware's precise mode: the I/O around balancing/kv_events.py.

For every endpoint whose config names `kv_events` (of a model with a tokenizer), one task holds a
ZMQ SUB socket on the server's event endpoint and feeds each message to the model's
`Balancer.kv`. A sequence gap is filled from the server's replay endpoint when there is one
(vLLM's ROUTER socket: ask from a sequence number, get every batch it still buffers, then an
end marker); what cannot be filled is given up (`KvIndex.lost`), and the endpoint is routed
approximately until its index is rebuilt. A malformed message, a batch that does not decode, a
block built on a parent never seen: logged once per endpoint and kind, counted, never raised.

Sharing: every worker, and every gateway on one Redis, subscribes to the same publisher (PUB
sockets fan out), so each builds the same index from the same events; nothing of it needs to go
through Redis. A process that joins late asks the replay endpoint for everything from sequence 0.

The set of subscriptions follows the gateway's clusters (configured, reloaded, placed): `_reconcile`
compares them every RECONCILE_SECONDS, so no path that changes clusters has to remember it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from modelyard.balancing.kv_events import END_OF_REPLAY, Applied, KvIndex

if TYPE_CHECKING:  # (pyzmq is imported when a subscription is made: most gateways make none)
    import zmq.asyncio

log = logging.getLogger(__name__)

RECONCILE_SECONDS = 1.0
# How long a replay may take to send its next batch, and in all, before the gap is given up.
REPLAY_WAIT_SECONDS = 1.0
REPLAY_SECONDS = 5.0
# The largest message taken from a publisher, and how many wait unread: a hostile or broken one
# cannot fill a worker's memory.
MAX_MESSAGE_BYTES = 16 << 20
RECEIVE_QUEUE = 10_000
# Messages a subscription takes in a row before it lets the event loop run requests.
BURST = 64

# (model, endpoint name, events URL, replay URL) and the index it feeds
Wanted = tuple[str, str, str, str]


class KvSubscriptions:
    def __init__(
        self,
        clusters: Callable[
            [], Iterable[tuple[str, KvIndex | None, Iterable[tuple[str, str | None, str | None]]]]
        ],
    ) -> None:
        """`clusters()` yields, per model, its name, its balancer's KvIndex (None without precise
        mode) and its endpoints' (name, kv_events, kv_replay)."""
        self._clusters = clusters
        self._context: zmq.asyncio.Context | None = None
        self._running: dict[tuple[Wanted, int], asyncio.Task[None]] = {}
        self._logged: set[tuple[str, str, str]] = set()
        self._sources: dict[tuple[int, str], str] = {}  # (the index's id, endpoint) -> events URL
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._reconcile()
        self._task = asyncio.create_task(self._follow(), name="kv-subscriptions")

    async def stop(self) -> None:
        tasks = list(self._running.values())
        if self._task is not None:
            tasks.append(self._task)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._running.clear()
        if self._context is not None:
            self._context.destroy(linger=0)  # (closes any socket left open: term() would wait)
            self._context = None

    async def _follow(self) -> None:
        while True:
            await asyncio.sleep(RECONCILE_SECONDS)
            try:
                self._reconcile()
            except Exception:  # (never the end of following the clusters)
                log.exception("KV events: the subscriptions could not be brought up to date")

    def _reconcile(self) -> None:
        wanted: dict[tuple[Wanted, int], KvIndex] = {}
        for model, kv, endpoints in self._clusters():
            if kv is None:
                continue
            names = []
            for name, events, replay in endpoints:
                if events:
                    wanted[((model, name, events, replay or ""), id(kv))] = kv
                    names.append(name)
            kv.keep_only(names)
        for key in [k for k in self._running if k not in wanted]:
            self._running.pop(key).cancel()
        for key, kv in wanted.items():
            if key not in self._running:
                if self._context is None:
                    import zmq.asyncio

                    self._context = zmq.asyncio.Context()
                model, name, url = key[0][:3]
                if self._sources.get((key[1], name), url) != url:
                    kv.endpoints.pop(name, None)  # another server now: nothing it held is known
                self._sources[key[1], name] = url
                kv.track(name)
                self._running[key] = asyncio.create_task(
                    self._subscribe(self._context, *key[0], kv), name=f"kv-events:{key[0][0]}:{key[0][1]}"
                )

    async def _subscribe(
        self, context: zmq.asyncio.Context, model: str, endpoint: str, url: str, replay: str, kv: KvIndex
    ) -> None:
        """Subscribe until cancelled; an error ends the socket, is logged once, and a new one is
        made a second later (the endpoint stays approximate meanwhile)."""
        while True:
            try:
                await self._subscribe_once(context, model, endpoint, url, replay, kv)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._fault(kv, model, endpoint, "error", f"the subscription to {url} failed: {exc!r}")
                await asyncio.sleep(RECONCILE_SECONDS)

    async def _subscribe_once(
        self, context: zmq.asyncio.Context, model: str, endpoint: str, url: str, replay: str, kv: KvIndex
    ) -> None:
        import zmq

        socket = _socket(context, zmq.SUB)
        try:
            socket.setsockopt(zmq.SUBSCRIBE, b"")  # every topic: vLLM's default topic is ""
            socket.connect(url)
            taken = 0
            while True:
                frames = await socket.recv_multipart(copy=True)
                now = time.monotonic()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self._fault(kv, model, endpoint, "malformed", f"a message of {len(frames)} frames")
                    blocks = kv.track(endpoint)
                    blocks.counts["malformed"] += 1
                    kv.lost(endpoint, blocks.last_seq + 1)
                    continue
                seq = int.from_bytes(frames[1], "big")
                result = kv.apply(endpoint, seq, frames[2], now)
                if result == Applied.GAP:
                    await self._fill(context, model, endpoint, replay, kv, seq)
                    result = kv.apply(endpoint, seq, frames[2], time.monotonic())
                if result == Applied.GARBAGE:
                    self._fault(kv, model, endpoint, "garbage", f"batch {seq} does not decode")
                elif result == Applied.RESTART:
                    log.info(
                        "%s/%s: KV events restarted at %d: the server's cache starts empty",
                        model,
                        endpoint,
                        seq,
                    )
                if kv.track(endpoint).counts["unknown_parent"]:
                    self._fault(
                        kv, model, endpoint, "unknown_parent", "blocks stored on a parent block never seen"
                    )
                taken += 1
                if taken >= BURST:  # a flood of events must not starve the requests
                    taken = 0
                    await asyncio.sleep(0)
        finally:
            socket.close(linger=0)

    async def _fill(
        self, context: zmq.asyncio.Context, model: str, endpoint: str, replay: str, kv: KvIndex, upto: int
    ) -> None:
        """Batches from the one after the last applied to `upto` (not included) were missed: ask
        the replay endpoint for them; what it cannot give is lost."""
        import zmq

        blocks = kv.track(endpoint)
        start = blocks.last_seq + 1
        if replay:
            socket = _socket(context, zmq.DEALER)
            deadline = time.monotonic() + REPLAY_SECONDS
            frames_left = upto - start + BURST  # (a replay that sends other frames forever ends)
            try:
                socket.connect(replay)
                await socket.send_multipart([b"", start.to_bytes(8, "big")])
                while blocks.last_seq < upto - 1 and frames_left > 0 and time.monotonic() < deadline:
                    frames_left -= 1
                    if not await socket.poll(REPLAY_WAIT_SECONDS * 1000):
                        break
                    frames = await socket.recv_multipart()
                    if len(frames) != 3 or len(frames[1]) != 8 or frames[1] == END_OF_REPLAY:
                        break
                    seq = int.from_bytes(frames[1], "big")
                    if seq <= blocks.last_seq or seq >= upto:
                        continue
                    if seq != blocks.last_seq + 1:
                        kv.lost(endpoint, seq)  # the replay no longer has the ones before it
                    kv.apply(endpoint, seq, frames[2], time.monotonic())
            except zmq.ZMQError as exc:
                kv.track(endpoint).counts["replay_failed"] += 1
                self._fault(kv, model, endpoint, "replay", f"replay from {replay} failed: {exc}")
            finally:
                socket.close(linger=0)
        if blocks.last_seq < upto - 1:
            self._fault(kv, model, endpoint, "gap", f"batches {blocks.last_seq + 1} to {upto - 1} were lost")
            kv.lost(endpoint, upto)

    def _fault(self, kv: KvIndex, model: str, endpoint: str, kind: str, what: str) -> None:
        """Logged once per endpoint and kind (the counts are in /metrics and /admin/overview)."""
        key = (model, endpoint, kind)
        if key in self._logged:
            return
        self._logged.add(key)
        log.warning(
            "%s/%s: KV events: %s; routing to it is approximate until its index is rebuilt (logged once)",
            model, endpoint, what,
        )  # fmt: skip


def _socket(context: zmq.asyncio.Context, kind: int) -> zmq.asyncio.Socket:
    import zmq

    socket = context.socket(kind)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.IPV6, 1)  # (tcp://[::1]:port, and hosts with only an IPv6 address)
    socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    socket.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE)
    return socket
