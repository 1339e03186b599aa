"""What the store keeps: plain, frozen records with no behaviour.

States are kept by name (Seldon's names, `modelyard.placement.ReplicaState`/`ModelState` values)
and specs as the JSON mapping the user's spec validates into, so that the store does not depend on
how placement models them and an old database stays readable when those classes grow a field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True, frozen=True)
class StoredReplica:
    """A version's state on one replica of the server it is bound to."""

    index: int
    state: str
    reason: str = ""
    timestamp: float = 0.0


@dataclass(slots=True, frozen=True)
class StoredStatus:
    """A version's status as last computed (derive_status or schedule_failed)."""

    state: str
    reason: str = ""
    available: int = 0
    unavailable: int = 0
    draining: int = 0
    timestamp: float | None = None


@dataclass(slots=True, frozen=True)
class StoredVersion:
    version: int
    spec: dict[str, Any]
    status: StoredStatus
    server: str | None = None
    instance_count: int | None = None
    replicas: tuple[StoredReplica, ...] = ()


@dataclass(slots=True, frozen=True)
class StoredModel:
    """A model: its latest applied spec, whether it is deleted, its versions oldest first."""

    name: str
    spec: dict[str, Any]
    deleted: bool = False
    versions: tuple[StoredVersion, ...] = ()


@dataclass(slots=True, frozen=True)
class StoredServerReplica:
    """A server replica the scheduler knew (its agent's SubscribeRequest config)."""

    server: str
    index: int
    inference_url: str = ""
    memory: int = 0
    capabilities: tuple[str, ...] = ()
    over_commit_percentage: int = 0
    shared: bool = True


@dataclass(slots=True, frozen=True)
class StoredState:
    """Everything `Store.load()` returns for a start-up: models by name order, replicas by key, and
    (name, version) marks: the highest version each name has had, forgotten models' included."""

    models: tuple[StoredModel, ...] = ()
    server_replicas: tuple[StoredServerReplica, ...] = ()
    version_marks: tuple[tuple[str, int], ...] = ()


@dataclass(slots=True)
class StoreWrite:
    """One batch for `Store.write`: models written whole (replacing what was stored under the
    name), names forgotten, server replicas written and forgotten by (server, index)."""

    models: list[StoredModel] = field(default_factory=list)
    forget_models: list[str] = field(default_factory=list)
    server_replicas: list[StoredServerReplica] = field(default_factory=list)
    forget_server_replicas: list[tuple[str, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.models or self.forget_models or self.server_replicas or self.forget_server_replicas)
