"""The scheduler's side of AgentService (`rpc.AgentHandler`): one stream per (server, replica),
operations through a bounded per-agent queue, events and drains handed to `SchedulerState`.

A replica's slot belongs to the agent connected in it: a Subscribe for it over another connection
is refused (`ReplicaTaken`, ALREADY_EXISTS), and the connected agent keeps it (Seldon lets the
newcomer take it, which let anyone who reached the port take a replica's traffic). A Subscribe over
the same connection (the agent starting its stream again) ends the first and waits until the
first's disconnect processing has finished before it registers (Seldon's per-key mutex), so the two
never interleave. An agent that vanished without closing its connection is noticed by the agent
port's keepalive (`SchedulerConfig.agent_keepalive`), which ends its stream and frees the slot.
A replica claiming more memory than `max_replica_memory` is refused (INVALID_ARGUMENT). The
connection that holds a slot is the only one whose events, drains and usage reports for that replica
the agent port takes (`holder`; see rpc/agent_server.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from modelyard.errors import BadRequest, NotFound
from modelyard.rpc.agent_server import ReplicaTaken
from modelyard.rpc.agent_v1 import agent_pb2
from modelyard.scheduler.autoscaler import Autoscaler, ModelUsage
from modelyard.scheduler.changes import Changes
from modelyard.scheduler.metrics import SchedulerMetrics
from modelyard.scheduler.operations import Operation, OperationKind
from modelyard.scheduler.state import AgentEventKind, LoadedVersion, ReplicaConfig, SchedulerState
from modelyard.telemetry import Attributes, Span, Tracer

log = logging.getLogger("modelyard.scheduler")

_OPERATIONS = {
    OperationKind.LOAD: agent_pb2.ModelOperation.LOAD_MODEL,
    OperationKind.UNLOAD: agent_pb2.ModelOperation.UNLOAD_MODEL,
}
_REFUSALS_REMEMBERED = 1024
_EVENTS = {
    agent_pb2.ModelEvent.LOADED: AgentEventKind.LOADED,
    agent_pb2.ModelEvent.LOAD_FAILED: AgentEventKind.LOAD_FAILED,
    agent_pb2.ModelEvent.UNLOADED: AgentEventKind.UNLOADED,
    agent_pb2.ModelEvent.UNLOAD_FAILED: AgentEventKind.UNLOAD_FAILED,
}


class _Stream:
    def __init__(self, size: int) -> None:
        self.queue: asyncio.Queue[agent_pb2.ModelOperation | None] = asyncio.Queue(size)

    def close(self) -> None:
        while not self.queue.empty():  # what it had not sent yet goes with it
            self.queue.get_nowait()
        self.queue.put_nowait(None)


class Agents:
    """Agent streams, and the AgentHandler the gRPC server calls. `state` is set once the
    scheduler's state is restored; `changes` pulses after every mutation an agent makes."""

    def __init__(
        self,
        changes: Changes,
        clock: Callable[[], float],
        *,
        queue_size: int,
        drain_timeout: float,
        tracer: Tracer | None = None,
        max_replica_memory: int = 0,
    ) -> None:
        self.state: SchedulerState | None = None
        self._tracer = tracer  # None: tracing off
        # The span of the API request being applied (`traced`), the parent of the operations it
        # sends: state changes and their sends are synchronous, so no context needs to travel.
        self.cause: Span | None = None
        self.autoscaler: Autoscaler | None = None  # set with the state
        self.metrics: SchedulerMetrics | None = None
        self._changes = changes
        self._clock = clock
        self._queue_size = queue_size
        self._drain_timeout = drain_timeout
        self._max_memory = max_replica_memory
        self._streams: dict[tuple[str, int], _Stream] = {}
        # The connection (gRPC peer) of the Subscribe that holds each replica's slot, or is waiting
        # for its predecessor's disconnect processing to take it; with the claim's own marker.
        self._holders: dict[tuple[str, int], tuple[str, object]] = {}
        self._refused: dict[tuple[tuple[str, int], str], None] = {}  # logged refusals, oldest first
        self._locks: dict[tuple[str, int], asyncio.Lock] = {}
        self._stopping = False

    def _state(self) -> SchedulerState:
        assert self.state is not None, "agents are served only once the state is restored"
        return self.state

    def send(self, operation: Operation) -> str | None:
        """SchedulerState's Sender: queue the operation on the replica's stream."""
        stream = self._streams.get((operation.server, operation.index))
        if stream is None:
            return "no agent stream for this server replica"
        spec = operation.spec
        message = agent_pb2.ModelOperation(
            operation=_OPERATIONS[operation.kind],
            model_version=agent_pb2.ModelVersion(
                name=operation.model,
                version=operation.version,
                storage_uri=spec.storage_uri,
                memory_bytes=spec.memory,
                requirements=list(spec.requirements),
                parameters=spec.parameters,
            ),
        )
        span = None
        if self._tracer is not None:  # the agent's span for the operation will be this one's child
            span = self._operation_span(self._tracer, operation)
            message.traceparent = span.traceparent()
        try:
            stream.queue.put_nowait(message)
        except asyncio.QueueFull:
            if span is not None:
                span.fail("the agent's operation queue is full")
                span.end()
            return f"the agent's operation queue is full ({self._queue_size})"
        if span is not None:
            span.end()  # sent: the agent's span covers the work
        return None

    def _operation_span(self, tracer: Tracer, operation: Operation) -> Span:
        name = f"{operation.kind} {operation.model}"
        attributes: Attributes = {
            "modelyard.model": operation.model,
            "modelyard.model_version": operation.version,
            "modelyard.server": operation.server,
            "modelyard.replica": operation.index,
        }
        if self.cause is not None:
            return self.cause.child(name, "client", attributes)
        return tracer.start(name, (), "client", attributes)  # the autoscaler's, a retry's: a trace of its own

    def close_all(self) -> None:
        """The scheduler is stopping: end every stream without processing it as a disconnect, so the
        store keeps the replicas for the resync after the restart."""
        self._stopping = True
        for stream in list(self._streams.values()):
            stream.close()

    async def subscribe(
        self, request: agent_pb2.SubscribeRequest, peer: str = ""
    ) -> AsyncIterator[agent_pb2.ModelOperation]:
        if not request.server_name:
            raise BadRequest("SubscribeRequest.server_name is empty")
        key = (request.server_name, request.replica_idx)
        memory = request.replica_config.memory_bytes
        if self._max_memory and memory > self._max_memory:
            raise BadRequest(
                f"replica {key[0]}-{key[1]} claims {memory} bytes of memory, more than the scheduler's "
                f"--max-replica-memory ({self._max_memory})"
            )
        holder = self._holders.get(key)
        if holder is not None and holder[0] != peer:
            if self._first_refusal(key, peer):
                log.warning(
                    "agent %s-%d: refused a Subscribe from %s: the replica's agent is connected from %s",
                    *key, peer or "?", holder[0] or "?",
                )  # fmt: skip
            raise ReplicaTaken(
                f"server replica {key[0]}-{key[1]} is held by a connected agent; this Subscribe is refused "
                "until that agent's stream ends"
            )
        claim = (peer, object())
        self._holders[key] = claim
        try:
            old = self._streams.get(key)
            if old is not None:
                old.close()
            lock = self._locks.setdefault(key, asyncio.Lock())
            async with lock:
                stream = _Stream(self._queue_size)
                self._streams[key] = stream
                try:
                    self._connect(request)
                    while (operation := await stream.queue.get()) is not None:
                        yield operation
                finally:
                    if self._streams.get(key) is stream:
                        del self._streams[key]
                        if self.autoscaler is not None:  # a newer stream's fresh report stays
                            self.autoscaler.forget(*key)
                    if not self._stopping:
                        self._state().disconnect(*key, self._clock())
                        self._changes.pulse()
                        log.info("agent %s-%d disconnected", *key)
        finally:
            if self._holders.get(key) is claim:
                del self._holders[key]

    def holder(self, server: str, replica: int) -> str | None:
        """The peer whose Subscribe holds (or is about to take) the replica's slot; None when none:
        the agent server takes its events, drains and reports only over that connection."""
        held = self._holders.get((server, replica))
        return held[0] if held is not None else None

    def _first_refusal(self, key: tuple[str, int], peer: str) -> bool:
        """Whether a refused claim from this peer's host on this replica is the first (logged once)."""
        seen = (key, peer.rpartition(":")[0])
        if seen in self._refused:
            return False
        if len(self._refused) >= _REFUSALS_REMEMBERED:
            self._refused.pop(next(iter(self._refused)))
        self._refused[seen] = None
        return True

    def _connect(self, request: agent_pb2.SubscribeRequest) -> None:
        config = request.replica_config
        replica = ReplicaConfig(
            request.server_name,
            request.replica_idx,
            config.inference_url,
            config.memory_bytes,
            tuple(config.capabilities),
            config.over_commit_percentage,
            request.shared,
        )
        loaded = [
            LoadedVersion(m.name, m.version, m.runtime_info.instance_count or None)
            for m in request.loaded_models
        ]
        self._state().connect(replica, loaded, request.available_memory_bytes, self._clock())
        self._changes.pulse()
        log.info(
            "agent %s-%d subscribed (%d loaded models)", request.server_name, request.replica_idx, len(loaded)
        )

    async def event(self, event: agent_pb2.ModelEvent) -> None:
        kind = _EVENTS.get(event.event)
        if kind is None:
            raise BadRequest(f"unknown agent event {event.event}")
        self._state().event(
            event.server_name,
            event.replica_idx,
            event.model_name,
            event.model_version,
            kind,
            message=event.message,
            available_memory=event.available_memory_bytes,
            instance_count=event.runtime_info.instance_count or None,
            now=self._clock(),
        )
        self._changes.pulse()
        if self.metrics is not None:
            if kind in (AgentEventKind.LOADED, AgentEventKind.LOAD_FAILED):
                self.metrics.loads.labels("loaded" if kind is AgentEventKind.LOADED else "failed").inc()
            else:
                self.metrics.unloads.labels("unloaded" if kind is AgentEventKind.UNLOADED else "failed").inc()

    async def stats(self, request: agent_pb2.AgentStatsRequest) -> None:
        """An agent's usage report, for autoscaling. NOT_FOUND when the replica is not subscribed."""
        key = (request.server_name, request.replica_idx)
        if key not in self._streams:
            raise NotFound(f"server replica {key[0]}-{key[1]} is not subscribed")
        if self.autoscaler is None:
            return
        models = {
            m.name: ModelUsage(m.version, m.in_flight, m.queued, max(0.0, m.idle_seconds))
            for m in request.models
            if m.name
        }
        self.autoscaler.record(*key, models, self._clock())

    async def drain(self, request: agent_pb2.AgentDrainRequest) -> bool:
        """Compat §8: mark the replica draining and re-place its models, then answer once each has
        an Available replica elsewhere or cannot be placed (`SchedulerState.drained`), or False
        after `drain_timeout`. No settle sleep as Seldon's 3.25 s: a model is Available only once
        the feed that routes to its new replica has been published."""
        state = self._state()
        key = (request.server_name, request.replica_idx)
        started = self._clock()
        names = state.drain(*key, started)
        self._changes.pulse()
        log.info("agent %s-%d draining: waiting for %d model(s) to serve elsewhere", *key, len(names))

        def settled() -> bool:
            server = state.servers.get(key[0])
            replica = server.replicas.get(key[1]) if server is not None else None
            if replica is not None and replica.connected and not replica.draining:
                # It re-subscribed while this call is open, which registers the replica afresh:
                # the agent is still draining (it waits on this call), so mark it again.
                log.info("agent %s-%d re-subscribed while draining: draining it again", *key)
                names.update(state.drain(*key, self._clock()))
            return state.drained(names)

        done = await self._changes.wait_for(settled, self._drain_timeout)
        took = self._clock() - started
        if done:
            log.info("agent %s-%d drained in %.2fs", *key, took)
        else:
            waiting = ", ".join(sorted(n for n in names if not state.drained({n})))
            log.warning("agent %s-%d drain timed out after %.2fs; still waiting for %s", *key, took, waiting)
        return done
