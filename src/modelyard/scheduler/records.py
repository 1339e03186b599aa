"""The scheduler's in-memory state: servers and their replicas, models, versions and replica states,
and their conversion to and from the store's records.

Mutable on purpose: only `SchedulerState` changes them, on the event loop, and it persists every
model it changed at the end of the mutation. `reserved memory` is not kept here: it is summed from
the replica states whenever placement needs it (compat §5.4's leak cannot happen).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from modelyard.placement import (
    ModelSpec,
    ModelState,
    ModelStatus,
    ModelView,
    ReplicaState,
    ReplicaStatus,
    VersionView,
)
from modelyard.store import StoredModel, StoredReplica, StoredServerReplica, StoredStatus, StoredVersion


@dataclass(slots=True)
class ServerReplica:
    """One replica of a server as its agent described it. `connected`: its agent's stream is open
    (a replica restored from the store is not, until its agent subscribes again)."""

    server: str
    index: int
    inference_url: str = ""
    memory: int = 0
    capabilities: tuple[str, ...] = ()
    over_commit_percentage: int = 0
    available_memory: int = 0
    draining: bool = False
    connected: bool = False

    @property
    def key(self) -> tuple[str, int]:
        return (self.server, self.index)

    @property
    def endpoint_name(self) -> str:
        return f"{self.server}-{self.index}"


@dataclass(slots=True)
class Server:
    name: str
    shared: bool = True
    replicas: dict[int, ServerReplica] = field(default_factory=dict)


@dataclass(slots=True)
class Version:
    version: int
    spec: ModelSpec
    status: ModelStatus = field(default_factory=lambda: ModelStatus(ModelState.UNKNOWN))
    server: str | None = None
    instance_count: int | None = None
    replicas: dict[int, ReplicaStatus] = field(default_factory=dict)

    def view(self) -> VersionView:
        return VersionView(self.version, self.spec, self.server, dict(self.replicas), self.instance_count)

    def states(self) -> dict[int, ReplicaState]:
        return {index: status.state for index, status in self.replicas.items()}


@dataclass(slots=True)
class Model:
    """A model: the spec last applied, whether it is deleted, its versions oldest first."""

    name: str
    spec: ModelSpec
    deleted: bool = False
    versions: list[Version] = field(default_factory=list)

    @property
    def latest(self) -> Version:
        return self.versions[-1]

    def version(self, number: int) -> Version | None:
        for version in self.versions:
            if version.version == number:
                return version
        return None

    def view(self) -> ModelView:
        return ModelView(tuple(v.view() for v in self.versions), self.deleted)


def model_to_stored(model: Model) -> StoredModel:
    return StoredModel(
        model.name,
        model.spec.model_dump(mode="json"),
        model.deleted,
        tuple(
            StoredVersion(
                v.version,
                v.spec.model_dump(mode="json"),
                StoredStatus(
                    v.status.state.value,
                    v.status.reason,
                    v.status.available,
                    v.status.unavailable,
                    v.status.draining,
                    v.status.timestamp,
                ),
                v.server,
                v.instance_count,
                tuple(
                    StoredReplica(index, s.state.value, s.reason, s.timestamp)
                    for index, s in sorted(v.replicas.items())
                ),
            )
            for v in model.versions
        ),
    )


def model_from_stored(stored: StoredModel) -> Model:
    versions = [
        Version(
            v.version,
            ModelSpec.model_validate(v.spec),
            ModelStatus(ModelState(v.status.state), *_status_tail(v.status)),
            v.server,
            v.instance_count,
            {r.index: ReplicaStatus(ReplicaState(r.state), r.reason, r.timestamp) for r in v.replicas},
        )
        for v in stored.versions
    ]
    return Model(stored.name, ModelSpec.model_validate(stored.spec), stored.deleted, versions)


def _status_tail(s: StoredStatus) -> tuple[str, int, int, int, float | None]:
    return (s.reason, s.available, s.unavailable, s.draining, s.timestamp)


def replica_to_stored(replica: ServerReplica, shared: bool) -> StoredServerReplica:
    return StoredServerReplica(
        replica.server,
        replica.index,
        replica.inference_url,
        replica.memory,
        replica.capabilities,
        replica.over_commit_percentage,
        shared,
    )


def replica_from_stored(stored: StoredServerReplica) -> ServerReplica:
    return ServerReplica(
        stored.server,
        stored.index,
        stored.inference_url,
        stored.memory,
        stored.capabilities,
        stored.over_commit_percentage,
    )
