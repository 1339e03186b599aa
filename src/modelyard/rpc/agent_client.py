"""`AgentClient`: the agent's side of `modelyard.agent.v1.AgentService`.

grpc stays in this module: callers pass and receive `agent_pb2` messages and see modelyard's
error tree. Every grpc failure is translated by `_translate`, the one place that knows status
codes: a scheduler that cannot be reached (or went away mid-stream) is `SchedulerUnavailable`,
so the agent's reconnect loop needs to catch only that and the rest of the tree.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc
from grpc import aio

from modelyard.errors import (
    BadRequest,
    Conflict,
    ModelyardError,
    NotFound,
    SchedulerUnavailable,
)
from modelyard.rpc.agent_v1 import agent_pb2, agent_pb2_grpc

# Codes that mean "the scheduler is not there (now)": the caller backs off and tries again.
_UNAVAILABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNKNOWN,  # a servicer that raised: the scheduler's fault, maybe transient
        grpc.StatusCode.INTERNAL,
    }
)


def _translate(error: aio.AioRpcError, what: str) -> ModelyardError:
    """The one mapping from grpc status codes to modelyard's error tree."""
    code = error.code()
    detail = f"{what}: {code.name}: {error.details() or 'no details'}"
    if code in _UNAVAILABLE:
        return SchedulerUnavailable(detail)
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return Conflict(detail)
    if code == grpc.StatusCode.NOT_FOUND:
        return NotFound(detail)
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
        return BadRequest(detail)
    return ModelyardError(detail)


class AgentClient:
    """One channel to the scheduler's agent port (`host:port`, plaintext).

    The channel is created on first use, inside the running event loop (grpc.aio requires it),
    and reconnects by itself; `close()` ends it and any stream on it.
    `keepalive` (seconds; None = off) sends HTTP/2 pings on an idle stream so a vanished scheduler
    host is noticed; it is off by default because grpc servers refuse pings more frequent than
    their `min_recv_ping_interval_without_data` (5 min by default) with GOAWAY.
    """

    def __init__(self, target: str, *, connect_timeout: float = 5.0, keepalive: float | None = None) -> None:
        self.target = target
        self._connect_timeout = connect_timeout
        self._keepalive = keepalive
        self._channel: aio.Channel | None = None
        self._stub: agent_pb2_grpc.AgentServiceAsyncStub | None = None

    def _connect(self) -> agent_pb2_grpc.AgentServiceAsyncStub:
        if self._stub is None:
            options: list[tuple[str, int]] = []
            if self._keepalive:
                ms = int(self._keepalive * 1000)
                options += [("grpc.keepalive_time_ms", ms), ("grpc.keepalive_timeout_ms", ms)]
            self._channel = aio.insecure_channel(self.target, options=options)
            self._stub = agent_pb2_grpc.AgentServiceStub(self._channel)
        assert self._stub is not None
        return self._stub

    async def _ready(self, what: str) -> agent_pb2_grpc.AgentServiceAsyncStub:
        """The stub once the channel is connected; SchedulerUnavailable after connect_timeout."""
        stub = self._connect()
        assert self._channel is not None
        try:
            await asyncio.wait_for(self._channel.channel_ready(), self._connect_timeout)
        except TimeoutError:
            raise SchedulerUnavailable(
                f"{what}: scheduler {self.target} not reachable within {self._connect_timeout:g}s"
            ) from None
        return stub

    async def subscribe(
        self, request: agent_pb2.SubscribeRequest, on_open: Callable[[], None] | None = None
    ) -> AsyncIterator[agent_pb2.ModelOperation]:
        """Operations for this replica until the scheduler ends the stream (a normal return) or it
        breaks (`SchedulerUnavailable`). `on_open` is called once the channel is connected and the
        request sent. Closing the iterator cancels the call."""
        stub = await self._ready("subscribe")
        call = stub.Subscribe(request)
        if on_open is not None:
            on_open()
        try:
            async for operation in call:
                yield operation
        except aio.AioRpcError as error:
            raise _translate(error, f"subscribe to {self.target}") from None
        finally:
            call.cancel()  # no-op once the call has ended

    async def event(self, event: agent_pb2.ModelEvent, *, deadline: float = 10.0) -> None:
        stub = await self._ready("event")
        try:
            await stub.AgentEvent(event, timeout=deadline)
        except aio.AioRpcError as error:
            raise _translate(error, f"event to {self.target}") from None

    async def drain(self, request: agent_pb2.AgentDrainRequest, *, deadline: float | None = None) -> bool:
        """Blocks until the scheduler has moved this replica's models (or gave up); its answer."""
        stub = await self._ready("drain")
        try:
            response = await stub.AgentDrain(request, timeout=deadline)
        except aio.AioRpcError as error:
            raise _translate(error, f"drain via {self.target}") from None
        return response.success

    async def stats(self, request: agent_pb2.AgentStatsRequest, *, deadline: float = 5.0) -> None:
        stub = await self._ready("stats")
        try:
            await stub.AgentStats(request, timeout=deadline)
        except aio.AioRpcError as error:
            raise _translate(error, f"stats to {self.target}") from None

    async def close(self) -> None:
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            await channel.close(grace=None)
