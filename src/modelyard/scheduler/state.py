"""`SchedulerState`: Seldon's MemoryStore, SimpleScheduler and agent-server logic as synchronous
methods. Nothing here awaits or reads a clock (`now` comes in), so unit tests drive it directly.

Every public method is one mutation: it changes the state, places what needs placing, settles
(statuses, feed, promotions, cleaner, operations to agents) and writes what changed to the store
in one transaction, before anything is sent (reconcile.py). Agents connecting, disconnecting and
the restart resync are in connections.py. Where it differs from Seldon, and why:
- State survives a restart (`restore`): the feed serves the restored endpoints at once, and nothing
  is placed until the restored replicas have re-subscribed (connections.py).
- A model's version numbers are never reused: a deleted model whose latest version is inactive but
  whose older versions still unload is re-created as a new version after them, and a model created
  again after it was forgotten continues after the highest version it had (kept by the store).
  Seldon starts again at version 1, so an old version's late events, or an agent still holding the
  old version 1, would match the new record's.
"""

from __future__ import annotations

import enum

from pydantic import ValidationError

from modelyard.errors import ConfigError, Conflict, ModelBeingDeleted, ModelNotFound, NotFound
from modelyard.placement import (
    INACTIVE,
    ROUTABLE,
    ModelSpec,
    ModelState,
    ReplicaState,
    ReplicaStatus,
    SpecChange,
    spec_change,
)
from modelyard.scheduler.connections import REMOVED_WITH_REPLICA, Connections, LoadedVersion, ReplicaConfig
from modelyard.scheduler.feed import feed_entry
from modelyard.scheduler.operations import Publisher, Sender
from modelyard.scheduler.records import (
    Model,
    Server,
    ServerReplica,
    Version,
    model_from_stored,
    replica_from_stored,
)
from modelyard.store import Store

__all__ = [
    "REMOVED_WITH_REPLICA",
    "AgentEventKind",
    "LoadedVersion",
    "ReplicaConfig",
    "SchedulerState",
]

_S = ReplicaState
_PROMOTED = frozenset({_S.AVAILABLE, _S.LOADED_UNAVAILABLE})
# On a draining replica: already Draining (a repeated drain), or a load on its way (placed elsewhere).
_DRAIN_WAITS_FOR = frozenset({_S.DRAINING, _S.LOAD_REQUESTED, _S.LOADING})


class AgentEventKind(enum.StrEnum):
    LOADED = "LOADED"
    LOAD_FAILED = "LOAD_FAILED"
    UNLOADED = "UNLOADED"
    UNLOAD_FAILED = "UNLOAD_FAILED"


# event -> (the state the replica must be in, the state it moves to)  (compat §3 rules 4, 5, 13, 14)
_EVENT_TRANSITIONS = {
    AgentEventKind.LOADED: (_S.LOADING, _S.LOADED),
    AgentEventKind.LOAD_FAILED: (_S.LOADING, _S.LOAD_FAILED),
    AgentEventKind.UNLOADED: (_S.UNLOADING, _S.UNLOADED),
    AgentEventKind.UNLOAD_FAILED: (_S.UNLOADING, _S.UNLOAD_FAILED),
}


class SchedulerState(Connections):
    """The scheduler's models, versions, replica states and servers, and every operation on them."""

    @classmethod
    def restore(
        cls, store: Store, send: Sender, publish: Publisher, *, retry_interval: float = 10.0
    ) -> SchedulerState:
        """The state the store holds; not ready until its replicas re-subscribe (`awaiting`). A stored
        record this code cannot read raises ConfigError naming the database and the model."""
        state = cls(store, send, publish, retry_interval=retry_interval)
        stored = store.load()
        for record in stored.models:
            try:
                state.models[record.name] = model_from_stored(record)
            except ValueError as exc:  # pydantic's ValidationError is one too
                raise ConfigError(
                    f"--db {store.path}", [f"cannot read stored model {record.name!r}: {_one_line(exc)}"]
                ) from None
        state._marks = dict(stored.version_marks)
        for name in state.models:
            state._reservations.mark(name)
        for replica in stored.server_replicas:
            server = state.servers.setdefault(replica.server, Server(replica.server, replica.shared))
            server.replicas[replica.index] = replica_from_stored(replica)
            state._awaiting.add((replica.server, replica.index))
        state.ready = not state._awaiting
        for model in state.models.values():
            state._published[model.name] = {}  # so that the first settle publishes it
        return state

    def feed_snapshot(self) -> list[dict[str, object]]:
        """Every model's current feed entry (as last published), by name."""
        return [feed_entry(model, self.servers) for _, model in sorted(self.models.items())]

    def model(self, name: str) -> Model:
        model = self.models.get(name)
        if model is None:
            raise ModelNotFound(name, self.models)
        return model

    # --- the user's API --------------------------------------------------------------------------

    def apply(self, spec: ModelSpec, now: float) -> tuple[Model, str]:
        """Create, re-version, scale or leave the model; returns it and `created`, `new_version`,
        `scaling` or `unchanged`. A deleted model still unloading its latest version: 409."""
        model = self.models.get(spec.name)
        self._backoff.pop(spec.name, None)  # applied again: a failed load is retried at once
        if model is None:
            model = Model(spec.name, spec, versions=[Version(self._next_version(spec.name), spec)])
            self.models[spec.name] = model
            self._touch(model, 1)
            change = "created"
        elif model.deleted:
            if not all(s.state in INACTIVE for s in model.latest.replicas.values()):
                raise ModelBeingDeleted(spec.name)
            model.deleted = False
            model.spec = spec
            self._touch(model, model.latest.version)  # its status is now that of a superseded version
            model.versions.append(Version(self._next_version(spec.name), spec))
            self._touch(model, model.latest.version)
            change = "created"
        else:
            change = spec_change(model.latest.spec, spec).value
            if change == SpecChange.NEW_VERSION:
                self._touch(model, model.latest.version)
                model.versions.append(Version(self._next_version(spec.name), spec))
            elif change == SpecChange.SCALING:
                model.latest.spec = spec
            model.spec = spec
            self._touch(model, model.latest.version)
        self._place(model, now)  # an unchanged spec places again: Seldon's manual retry
        self._commit(now)
        return model, change

    def scale(self, name: str, replicas: int, now: float) -> Model:
        """Autoscaling: the model's replicas changed in place (no new version), as if applied."""
        model = self.model(name)
        spec = ModelSpec.model_validate({**model.spec.model_dump(), "replicas": replicas})
        model, _ = self.apply(spec, now)
        return model

    def delete(self, name: str, now: float) -> Model:
        """Mark the model deleted and unload it; returns it (it may be forgotten already)."""
        model = self.model(name)
        model.deleted = True
        self._touch(model, model.latest.version)  # settling a deleted model runs its unload plan
        self._commit(now)
        return model

    # --- agents ---------------------------------------------------------------------------------

    def event(
        self,
        server: str,
        index: int,
        model_name: str,
        version_number: int,
        kind: AgentEventKind,
        *,
        message: str = "",
        available_memory: int | None = None,
        instance_count: int | None = None,
        now: float,
    ) -> None:
        """An agent's report: a compare-and-set transition; a mismatch raises Conflict, nothing changes."""
        replica = self._connected(server, index)
        if available_memory is not None:
            replica.available_memory = available_memory
        model = self.models.get(model_name)
        version = model.version(version_number) if model is not None else None
        status = version.replicas.get(index) if version is not None and version.server == server else None
        if model is None or version is None or status is None:
            raise Conflict(f"{model_name} version {version_number} is not placed on {replica.endpoint_name}")
        expected, desired = _EVENT_TRANSITIONS[kind]
        if status.state is desired or (kind is AgentEventKind.LOADED and status.state in _PROMOTED):
            return  # a repeated event (Seldon rejects a LOADED for a replica already promoted)
        if kind is AgentEventKind.UNLOADED and status.state in ROUTABLE:
            # The agent lost a version it served without being asked: a new version replaced it
            # there and failed, on a server that dropped the old model too. Believe the agent: the
            # feed stops routing there, and the failed latest version is placed again on retry.
            self._set_replica(
                model,
                version_number,
                index,
                ReplicaStatus(_S.UNLOADED, message or "unloaded by the agent", now),
            )
            self._commit(now)
            return
        if status.state is not expected:
            raise Conflict(
                f"state mismatch for {model_name} version {version_number} on {replica.endpoint_name}: "
                f"{kind.value} expects {expected.value} but it is {status.state.value}"
            )
        failed = desired in (_S.LOAD_FAILED, _S.UNLOAD_FAILED)
        self._set_replica(
            model, version_number, index, ReplicaStatus(desired, message if failed else "", now)
        )
        if kind is AgentEventKind.LOADED and instance_count and version.instance_count is None:
            version.instance_count = instance_count
        self._commit(now)

    def drain(self, server: str, index: int, now: float) -> set[str]:
        """Mark the replica draining (placement no longer chooses it), place the models it holds or
        is loading elsewhere; returns the names of the models to wait for (`drained`).

        Its Loaded, Available and LoadedUnavailable replicas become Draining (compat §8 step 2.2):
        they keep serving while their model has no other routable replica (the feed's routable
        assignment) and leave with the agent (rules 16, 17) or with their version. Unlike Seldon,
        a load still on its way there (LoadRequested, Loading) is not made Draining: it serves
        nothing, and a Draining entry is routed to when it is the model's only one, so placement
        unloads it instead. Draining again (the agent retries) waits for the same models."""
        replica = self._connected(server, index)
        replica.draining = True  # not stored: a re-subscribing agent registers the replica afresh
        names: set[str] = set()
        for model in list(self.models.values()):
            for version in model.versions:
                status = version.replicas.get(index) if version.server == server else None
                if status is None:
                    continue
                if status.state in ROUTABLE:
                    self._set_replica(model, version.version, index, ReplicaStatus(_S.DRAINING, "", now))
                    names.add(model.name)
                elif status.state in _DRAIN_WAITS_FOR:
                    names.add(model.name)
        for name in sorted(names):
            model = self.models[name]
            if not model.deleted:
                self._place(model, now)
        self._commit(now)
        return names

    def drained(self, names: set[str]) -> bool:
        """Whether each model has an Available replica of its latest version on a replica that is
        not draining, cannot be placed (ScheduleFailed: it keeps serving where it is until its
        replica goes), or is deleted or gone. Available is set right after the feed entry that
        routes to it is published, so once this holds every gateway has been sent the new routes."""
        return all(self._drained(name) for name in names)

    def _drained(self, name: str) -> bool:
        model = self.models.get(name)
        if model is None or model.deleted:
            return True
        latest = model.latest
        if latest.status.state is ModelState.SCHEDULE_FAILED:
            return True
        server = self.servers.get(latest.server) if latest.server is not None else None
        if server is None:
            return False
        for index, status in latest.replicas.items():
            replica = server.replicas.get(index)
            if status.state is _S.AVAILABLE and replica is not None and not replica.draining:
                return True
        return False

    def _connected(self, server: str, index: int) -> ServerReplica:
        found = self.servers.get(server)
        replica = found.replicas.get(index) if found is not None else None
        if replica is None or not replica.connected:
            raise NotFound(f"server replica {server}-{index} is not subscribed")
        return replica


def _one_line(exc: ValueError) -> str:
    if isinstance(exc, ValidationError):
        problem = exc.errors()[0]
        where = ".".join(str(part) for part in problem["loc"])
        return f"{where}: {problem['msg']}" if where else problem["msg"]
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
