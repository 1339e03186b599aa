"""`AgentServer`: hosts `modelyard.agent.v1.AgentService` on a grpc.aio server and hands each call to
an `AgentHandler`, a plain Protocol that never sees grpc.

The handler raises modelyard's errors; they become gRPC status codes here, in one place:
NotFound -> NOT_FOUND, BadRequest -> INVALID_ARGUMENT, Conflict -> FAILED_PRECONDITION (Seldon
answers a state mismatch with INTERNAL, which an agent cannot tell from a scheduler bug; the agent
only logs either), anything else -> INTERNAL.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Protocol

import grpc
from grpc import aio

from modelyard.errors import BadRequest, Conflict, ModelyardError, NotFound
from modelyard.rpc._server import grpc_address, start_server
from modelyard.rpc.agent_v1 import agent_pb2, agent_pb2_grpc

log = logging.getLogger("modelyard.rpc")


class AgentHandler(Protocol):
    """What the scheduler does with each AgentService call."""

    def subscribe(self, request: agent_pb2.SubscribeRequest) -> AsyncIterator[agent_pb2.ModelOperation]:
        """The operations for this replica, until the iterator ends (the scheduler replaced or
        stopped the stream) or is closed (the agent went away)."""
        ...

    async def event(self, event: agent_pb2.ModelEvent) -> None: ...

    async def drain(self, request: agent_pb2.AgentDrainRequest) -> bool: ...

    async def stats(self, request: agent_pb2.AgentStatsRequest) -> None: ...


def status_code(error: ModelyardError) -> grpc.StatusCode:
    """The gRPC status for a modelyard error raised by the handler."""
    if isinstance(error, NotFound):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(error, BadRequest):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(error, Conflict):
        return grpc.StatusCode.FAILED_PRECONDITION
    return grpc.StatusCode.INTERNAL


class _Servicer(agent_pb2_grpc.AgentServiceServicer):
    def __init__(self, handler: AgentHandler) -> None:
        self._handler = handler

    async def Subscribe(
        self, request: agent_pb2.SubscribeRequest, context: aio.ServicerContext[object, object]
    ) -> AsyncIterator[agent_pb2.ModelOperation]:
        operations = self._handler.subscribe(request)
        try:
            async for operation in operations:
                yield operation
        except ModelyardError as error:
            await context.abort(status_code(error), error.message)
        finally:
            # Run the handler's disconnect processing now, not whenever the generator is collected.
            aclose = getattr(operations, "aclose", None)
            if aclose is not None:
                await aclose()

    async def AgentEvent(
        self, request: agent_pb2.ModelEvent, context: aio.ServicerContext[object, object]
    ) -> agent_pb2.ModelEventResponse:
        try:
            await self._handler.event(request)
        except ModelyardError as error:
            await context.abort(status_code(error), error.message)
        return agent_pb2.ModelEventResponse()

    async def AgentDrain(
        self, request: agent_pb2.AgentDrainRequest, context: aio.ServicerContext[object, object]
    ) -> agent_pb2.AgentDrainResponse:
        try:
            success = await self._handler.drain(request)
        except ModelyardError as error:
            await context.abort(status_code(error), error.message)
        return agent_pb2.AgentDrainResponse(success=success)

    async def AgentStats(
        self, request: agent_pb2.AgentStatsRequest, context: aio.ServicerContext[object, object]
    ) -> agent_pb2.AgentStatsResponse:
        try:
            await self._handler.stats(request)
        except ModelyardError as error:
            await context.abort(status_code(error), error.message)
        return agent_pb2.AgentStatsResponse()


class AgentServer:
    """AgentService on `host:port` (port 0: any free port; `port` holds the bound one after start)."""

    def __init__(self, handler: AgentHandler, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port
        self._handler = handler
        self._server: aio.Server | None = None

    @property
    def address(self) -> str:
        return grpc_address(self.host, self.port)

    async def start(self) -> None:
        if self._server is not None:
            raise RuntimeError("AgentServer already started")
        servicer = _Servicer(self._handler)
        self._server, self.port = await start_server(
            self.host,
            self.port,
            lambda server: agent_pb2_grpc.add_AgentServiceServicer_to_server(servicer, server),
            what="agents",
        )

    async def stop(self, grace: float = 1.0) -> None:
        """Stop accepting calls; calls in flight get `grace` seconds, then are cancelled. Safe twice."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace)
