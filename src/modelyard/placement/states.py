"""Seldon's replica and model states, by name, and the sets of replica states the policies test.

The enum values are Seldon's names, so a state converts to and from Seldon by name; the proto
numbers are kept beside them because Seldon's Go constants and its proto enum number the unload
states differently (compat §2.1, §13.1), and a number alone would be ambiguous.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType


class ReplicaState(enum.StrEnum):
    """The state of one model version on one server replica (compat §2.1, §3)."""

    UNKNOWN = "ModelReplicaStateUnknown"
    LOAD_REQUESTED = "LoadRequested"
    LOADING = "Loading"
    LOADED = "Loaded"
    LOAD_FAILED = "LoadFailed"
    UNLOAD_ENVOY_REQUESTED = "UnloadEnvoyRequested"
    UNLOAD_REQUESTED = "UnloadRequested"
    UNLOADING = "Unloading"
    UNLOADED = "Unloaded"
    UNLOAD_FAILED = "UnloadFailed"
    AVAILABLE = "Available"
    LOADED_UNAVAILABLE = "LoadedUnavailable"
    DRAINING = "Draining"


class ModelState(enum.StrEnum):
    """The state of one model version, derived from its replicas (compat §2.2, §4).

    CREATE and TERMINATE exist only as Seldon's model-gateway sub-state; `derive_status` never
    returns them, and SCHEDULE_FAILED comes only from `schedule_failed`."""

    UNKNOWN = "ModelStateUnknown"
    PROGRESSING = "ModelProgressing"
    AVAILABLE = "ModelAvailable"
    FAILED = "ModelFailed"
    TERMINATING = "ModelTerminating"
    TERMINATED = "ModelTerminated"
    TERMINATE_FAILED = "ModelTerminateFailed"
    SCHEDULE_FAILED = "ScheduleFailed"
    SCALED_DOWN = "ModelScaledDown"
    CREATE = "ModelCreate"
    TERMINATE = "ModelTerminate"


# Seldon's proto numbers (apis/mlops/scheduler/scheduler.proto). Go's numbers are not kept: they
# never leave Seldon's process, and they are the ones that differ.
REPLICA_STATE_PROTO: Mapping[ReplicaState, int] = MappingProxyType(
    {
        ReplicaState.UNKNOWN: 0,
        ReplicaState.LOAD_REQUESTED: 1,
        ReplicaState.LOADING: 2,
        ReplicaState.LOADED: 3,
        ReplicaState.LOAD_FAILED: 4,
        ReplicaState.UNLOAD_REQUESTED: 5,
        ReplicaState.UNLOADING: 6,
        ReplicaState.UNLOADED: 7,
        ReplicaState.UNLOAD_FAILED: 8,
        ReplicaState.AVAILABLE: 9,
        ReplicaState.LOADED_UNAVAILABLE: 10,
        ReplicaState.UNLOAD_ENVOY_REQUESTED: 11,
        ReplicaState.DRAINING: 12,
    }
)
MODEL_STATE_PROTO: Mapping[ModelState, int] = MappingProxyType(
    {state: number for number, state in enumerate(ModelState)}
)
_REPLICA_STATE_BY_PROTO = {number: state for state, number in REPLICA_STATE_PROTO.items()}
_MODEL_STATE_BY_PROTO = {number: state for state, number in MODEL_STATE_PROTO.items()}


def replica_state_from_proto(number: int) -> ReplicaState:
    """Seldon's proto number for a replica state; ValueError for a number it does not define."""
    try:
        return _REPLICA_STATE_BY_PROTO[number]
    except KeyError:
        raise ValueError(f"no replica state has proto number {number}") from None


def model_state_from_proto(number: int) -> ModelState:
    """Seldon's proto number for a model state; ValueError for a number it does not define."""
    try:
        return _MODEL_STATE_BY_PROTO[number]
    except KeyError:
        raise ValueError(f"no model state has proto number {number}") from None


_S = ReplicaState

# The exact sets of compat §2.1. Their names say what Seldon's predicates ask.
LIVE: frozenset[ReplicaState] = frozenset({_S.LOADED, _S.AVAILABLE, _S.LOADED_UNAVAILABLE, _S.DRAINING})
"""Can receive traffic: a version with one of these is still serving."""

ALREADY_LOADING_OR_LOADED: frozenset[ReplicaState] = frozenset(
    {_S.LOADING, _S.LOADED, _S.AVAILABLE, _S.LOADED_UNAVAILABLE}
)
"""Placement leaves these alone when it chooses the replica again (LoadRequested is not here)."""

UNLOADING_OR_UNLOADED: frozenset[ReplicaState] = frozenset(
    {_S.UNLOAD_ENVOY_REQUESTED, _S.UNLOAD_REQUESTED, _S.UNLOADING, _S.UNLOADED, _S.UNKNOWN}
)
"""Already on the way out (or never in): an unload request leaves these alone."""

INACTIVE: frozenset[ReplicaState] = frozenset({_S.UNLOADED, _S.UNLOAD_FAILED, _S.UNKNOWN, _S.LOAD_FAILED})
"""Holds nothing the scheduler still waits for: a deleted model whose replicas are all inactive
may be created again."""

HOSTING: frozenset[ReplicaState] = ALREADY_LOADING_OR_LOADED | {_S.LOAD_REQUESTED}
"""Loading or loaded, counting a request not yet sent: what the replica sorter prefers."""

ROUTABLE: frozenset[ReplicaState] = frozenset({_S.LOADED, _S.AVAILABLE, _S.LOADED_UNAVAILABLE})
"""Routed to first; Draining replicas are routed to only when a version has none of these."""


def routable_assignment(replicas: Mapping[int, ReplicaState]) -> tuple[int, ...]:
    """The replica indexes a version's traffic goes to (Seldon's `GetAssignment`), ascending:
    its Loaded, Available and LoadedUnavailable replicas, or if there are none its Draining
    ones, or none."""
    routable = _indexes(replicas.items(), ROUTABLE)
    return routable or _indexes(replicas.items(), {_S.DRAINING})


def _indexes(items: Iterable[tuple[int, ReplicaState]], states: Iterable[ReplicaState]) -> tuple[int, ...]:
    wanted = frozenset(states)
    return tuple(sorted(index for index, state in items if state in wanted))


@dataclass(slots=True, frozen=True)
class ReplicaStatus:
    """A version's state on one replica, why (an agent's error text, for the failure states) and
    when it was entered (seconds; the caller's clock)."""

    state: ReplicaState
    reason: str = ""
    timestamp: float = 0.0
