"""`SchedulerState`: Seldon's MemoryStore, SimpleScheduler and agent-server logic as synchronous
methods. Nothing here awaits or reads a clock (`now` comes in), so unit tests drive it directly.

Every public method is one mutation: it changes the state, places what needs placing, settles
(statuses, feed, promotions, cleaner, operations to agents) and writes what changed to the store
in one transaction. Where it differs from Seldon, and why:
- State survives a restart (`restore`): the feed serves the restored endpoints at once, and nothing
  is placed until every restored replica has re-subscribed or `finish_resync` is called (after
  --resync-timeout); replicas still missing then are removed as disconnected.
- A re-subscribing agent's report is reconciled with what is recorded on its replica: a version it
  holds that is recorded Loaded/Available stays so (nothing is reloaded); one it does not hold is
  removed (or re-sent, when its load was in flight). A version the scheduler does not know, or that
  is bound elsewhere, is unloaded: with a persistent store, an unknown model is stale, where Seldon
  (which forgets everything on restart) adopts it.
- A deleted model whose latest version is inactive but whose older versions still unload is
  re-created as a new version after them (Seldon starts again at version 1, and the old versions'
  late events would then match the new record's).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from modelyard.errors import Conflict, ModelBeingDeleted, ModelNotFound, NotFound
from modelyard.placement import (
    HOSTING,
    INACTIVE,
    LIVE,
    ModelSpec,
    ModelState,
    ReplicaState,
    ReplicaStatus,
    SpecChange,
    should_retry,
    spec_change,
)
from modelyard.scheduler.feed import feed_entry
from modelyard.scheduler.reconcile import Operation, OperationKind, Publisher, Reconciler, Sender
from modelyard.scheduler.records import (
    Model,
    Server,
    ServerReplica,
    Version,
    model_from_stored,
    replica_from_stored,
)
from modelyard.store import Store

_S = ReplicaState
_PROMOTED = frozenset({_S.AVAILABLE, _S.LOADED_UNAVAILABLE})
REMOVED_WITH_REPLICA = "model is removed when server replica was removed"


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


@dataclass(slots=True, frozen=True)
class ReplicaConfig:
    """A replica as its agent describes it when it subscribes."""

    server: str
    index: int
    inference_url: str = ""
    memory: int = 0
    capabilities: tuple[str, ...] = ()
    over_commit_percentage: int = 0
    shared: bool = True


@dataclass(slots=True, frozen=True)
class LoadedVersion:
    """A model version an agent reports it holds."""

    model: str
    version: int
    instance_count: int | None = None


class SchedulerState(Reconciler):
    """The scheduler's models, versions, replica states and servers, and every operation on them."""

    def __init__(self, store: Store, send: Sender, publish: Publisher) -> None:
        super().__init__(store, send, publish)
        self._awaiting: set[tuple[str, int]] = set()

    @classmethod
    def restore(cls, store: Store, send: Sender, publish: Publisher) -> SchedulerState:
        """The state the store holds; not ready until its replicas re-subscribe (`awaiting`)."""
        state = cls(store, send, publish)
        stored = store.load()
        for record in stored.models:
            state.models[record.name] = model_from_stored(record)
        for replica in stored.server_replicas:
            server = state.servers.setdefault(replica.server, Server(replica.server, replica.shared))
            server.replicas[replica.index] = replica_from_stored(replica)
            state._awaiting.add((replica.server, replica.index))
        state.ready = not state._awaiting
        for model in state.models.values():
            state._published[model.name] = {}  # so that the first settle publishes it
        return state

    @property
    def awaiting(self) -> frozenset[tuple[str, int]]:
        return frozenset(self._awaiting)

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
        if model is None:
            model = Model(spec.name, spec, versions=[Version(1, spec)])
            self.models[spec.name] = model
            self._touch(model, 1)
            change = "created"
        elif model.deleted:
            if not all(s.state in INACTIVE for s in model.latest.replicas.values()):
                raise ModelBeingDeleted(spec.name)
            model.deleted = False
            model.spec = spec
            self._touch(model, model.latest.version)  # its status is now that of a superseded version
            model.versions.append(Version(model.latest.version + 1, spec))
            self._touch(model, model.latest.version)
            change = "created"
        else:
            change = spec_change(model.latest.spec, spec).value
            if change == SpecChange.NEW_VERSION:
                self._touch(model, model.latest.version)
                model.versions.append(Version(model.latest.version + 1, spec))
            elif change == SpecChange.SCALING:
                model.latest.spec = spec
            model.spec = spec
            self._touch(model, model.latest.version)
        self._place(model, now)  # an unchanged spec places again: Seldon's manual retry
        self._commit(now)
        return model, change

    def delete(self, name: str, now: float) -> Model:
        """Mark the model deleted and unload it; returns it (it may be forgotten already)."""
        model = self.model(name)
        model.deleted = True
        self._touch(model, model.latest.version)  # settling a deleted model runs its unload plan
        self._commit(now)
        return model

    # --- agents ----------------------------------------------------------------------------------

    def connect(
        self, config: ReplicaConfig, loaded: Sequence[LoadedVersion], available_memory: int, now: float
    ) -> None:
        """An agent subscribed: (re)register its replica and reconcile what it reports holding."""
        server = self.servers.setdefault(config.server, Server(config.server, config.shared))
        server.shared = config.shared
        replica = ServerReplica(
            config.server,
            config.index,
            config.inference_url,
            config.memory,
            tuple(c.strip() for c in config.capabilities),
            config.over_commit_percentage,
            available_memory,
            connected=True,
        )
        server.replicas[config.index] = replica
        self._replica_dirty(replica)
        reported = {(v.model, v.version): v for v in loaded}
        lost: list[Model] = []
        for model in list(self.models.values()):
            for version in model.versions:
                if version.server == config.server and config.index in version.replicas:
                    held = reported.pop((model.name, version.version), None)
                    if self._reconcile_replica(model, version, config.index, held, now):
                        lost.append(model)
        for held in reported.values():
            self._adopt_or_unload(config, held, now)
        self._awaiting.discard(replica.key)
        if not self.ready and not self._awaiting:
            self.ready = True
            self._place_all(now)
        else:
            for model in lost:
                self._place(model, now)
            self._retry(now)
        self._commit(now)

    def _reconcile_replica(
        self, model: Model, version: Version, index: int, held: LoadedVersion | None, now: float
    ) -> bool:
        """Make the recorded state agree with the agent's report; True when the model must move."""
        state = version.replicas[index].state
        if held is not None:
            if held.instance_count and version.instance_count is None:
                version.instance_count = held.instance_count
            if state in (_S.LOAD_REQUESTED, _S.LOADING, _S.LOAD_FAILED, _S.UNKNOWN, _S.DRAINING):
                new = _S.LOADED  # Seldon's rule 18: what the agent holds is loaded
            elif state in (_S.UNLOADING, _S.UNLOADED, _S.UNLOAD_FAILED):
                new = _S.UNLOAD_REQUESTED  # still there: unload it again
            else:
                return False  # loaded or available stays; an unload on its way goes on
        elif state is _S.LOADING:
            new = _S.LOAD_REQUESTED  # the load may have been lost with the old stream: send it again
        elif state in (_S.UNLOAD_ENVOY_REQUESTED, _S.UNLOAD_REQUESTED, _S.UNLOADING):
            new = _S.UNLOADED
        elif state in LIVE:
            return self._lose_replica(model, version, index, now)
        else:
            return False
        self._set_replica(model, version.version, index, ReplicaStatus(new, "", now))
        return False

    def _adopt_or_unload(self, config: ReplicaConfig, held: LoadedVersion, now: float) -> None:
        model = self.models.get(held.model)
        version = model.version(held.version) if model is not None else None
        if (
            model is not None
            and version is not None
            and not model.deleted
            and version.server in (None, config.server)
        ):
            version.server = config.server
            if held.instance_count and version.instance_count is None:
                version.instance_count = held.instance_count
            self._set_replica(model, version.version, config.index, ReplicaStatus(_S.LOADED, "", now))
            return
        spec = version.spec if version is not None else ModelSpec(name=held.model, storage_uri="unknown:")
        self._send(
            Operation(OperationKind.UNLOAD, config.server, config.index, held.model, held.version, spec)
        )

    def disconnect(self, server_name: str, index: int, now: float) -> None:
        """An agent's stream ended: its replica's versions go (rules 16, 17), its models move."""
        server = self.servers.get(server_name)
        replica = server.replicas.pop(index, None) if server is not None else None
        if server is None or replica is None:
            return
        self._forget_replica(server, replica)
        moved: list[Model] = []
        for model in list(self.models.values()):
            for version in model.versions:
                on_replica = version.server == server_name and index in version.replicas
                if on_replica and self._lose_replica(model, version, index, now):
                    moved.append(model)
        for model in moved:
            self._place(model, now)
        self._retry(now)
        self._commit(now)

    def _forget_replica(self, server: Server, replica: ServerReplica) -> None:
        self._dirty_replicas.discard(replica.key)
        self._forgotten_replicas.add(replica.key)
        self._awaiting.discard(replica.key)
        if not server.replicas:
            del self.servers[server.name]  # as Seldon: the last replica takes the server with it

    def _lose_replica(self, model: Model, version: Version, index: int, now: float) -> bool:
        """The replica no longer holds `version`; True when the model must be placed again."""
        if model.deleted or version is not model.latest:
            self._set_replica(
                model, version.version, index, ReplicaStatus(_S.UNLOADED, REMOVED_WITH_REPLICA, now)
            )
            return False
        del version.replicas[index]
        self._touch(model, version.version)
        return True

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
        """Mark the replica draining, its versions Draining, place their models elsewhere; returns the
        names of the models to wait for (`drained`)."""
        replica = self._connected(server, index)
        replica.draining = True
        names: set[str] = set()
        for model in list(self.models.values()):
            for version in model.versions:
                status = version.replicas.get(index) if version.server == server else None
                if status is not None and status.state in HOSTING:
                    self._set_replica(model, version.version, index, ReplicaStatus(_S.DRAINING, "", now))
                    names.add(model.name)
        for name in sorted(names):
            self._place(self.models[name], now)
        self._commit(now)
        return names

    def drained(self, names: set[str]) -> bool:
        """Whether each model serves on an Available replica, cannot be placed, or is gone."""
        for name in names:
            model = self.models.get(name)
            if model is None or model.deleted:
                continue
            latest = model.latest
            if latest.status.state is ModelState.SCHEDULE_FAILED:
                continue
            if not any(s.state is _S.AVAILABLE for s in latest.replicas.values()):
                return False
        return True

    def _connected(self, server: str, index: int) -> ServerReplica:
        found = self.servers.get(server)
        replica = found.replicas.get(index) if found is not None else None
        if replica is None or not replica.connected:
            raise NotFound(f"server replica {server}-{index} is not subscribed")
        return replica

    # --- retries and the start-up resync ---------------------------------------------------------

    def retry(self, now: float) -> None:
        """Place again every model Seldon's retry pass would (should_retry)."""
        self._retry(now)
        self._commit(now)

    def _retry(self, now: float) -> None:
        for model in list(self.models.values()):
            if not model.deleted and should_retry(model.latest.status, model.latest.spec):
                self._place(model, now)

    def finish_resync(self, now: float) -> None:
        """The resync is over: replicas that did not re-subscribe are removed as disconnected, and
        every model is placed."""
        if self.ready:
            return
        self.ready = True
        for server, index in sorted(self._awaiting):
            self.disconnect(server, index, now)
        self._awaiting.clear()
        self._place_all(now)
        self._commit(now)

    def _place_all(self, now: float) -> None:
        for model in list(self.models.values()):
            if model.deleted:
                self._touch(model, model.latest.version)
            else:
                self._place(model, now)
