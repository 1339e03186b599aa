"""Seldon's replica and model states: names, proto numbers and the predicate sets of compat §2.1."""

from __future__ import annotations

import pytest

from modelyard.placement import (
    ALREADY_LOADING_OR_LOADED,
    HOSTING,
    INACTIVE,
    LIVE,
    MODEL_STATE_PROTO,
    REPLICA_STATE_PROTO,
    ROUTABLE,
    UNLOADING_OR_UNLOADED,
    ModelState,
    ReplicaState,
    model_state_from_proto,
    replica_state_from_proto,
    routable_assignment,
)

S = ReplicaState

# Seldon's proto table, by name (compat §2.1): the unload states are numbered apart from Go's.
REPLICA_PROTO = [
    ("ModelReplicaStateUnknown", 0),
    ("LoadRequested", 1),
    ("Loading", 2),
    ("Loaded", 3),
    ("LoadFailed", 4),
    ("UnloadEnvoyRequested", 11),
    ("UnloadRequested", 5),
    ("Unloading", 6),
    ("Unloaded", 7),
    ("UnloadFailed", 8),
    ("Available", 9),
    ("LoadedUnavailable", 10),
    ("Draining", 12),
]
MODEL_PROTO = [
    ("ModelStateUnknown", 0),
    ("ModelProgressing", 1),
    ("ModelAvailable", 2),
    ("ModelFailed", 3),
    ("ModelTerminating", 4),
    ("ModelTerminated", 5),
    ("ModelTerminateFailed", 6),
    ("ScheduleFailed", 7),
    ("ModelScaledDown", 8),
    ("ModelCreate", 9),
    ("ModelTerminate", 10),
]


@pytest.mark.parametrize(("name", "number"), REPLICA_PROTO)
def test_replica_state_converts_by_name_to_seldons_proto_number(name: str, number: int) -> None:
    state = ReplicaState(name)
    assert REPLICA_STATE_PROTO[state] == number
    assert replica_state_from_proto(number) is state


@pytest.mark.parametrize(("name", "number"), MODEL_PROTO)
def test_model_state_converts_by_name_to_seldons_proto_number(name: str, number: int) -> None:
    state = ModelState(name)
    assert MODEL_STATE_PROTO[state] == number
    assert model_state_from_proto(number) is state


def test_every_state_has_a_proto_number() -> None:
    assert {s.value for s in ReplicaState} == {name for name, _ in REPLICA_PROTO}
    assert {s.value for s in ModelState} == {name for name, _ in MODEL_PROTO}


@pytest.mark.parametrize("number", [-1, 13, 99])
def test_an_unknown_replica_proto_number_is_an_error(number: int) -> None:
    with pytest.raises(ValueError, match=str(number)):
        replica_state_from_proto(number)


@pytest.mark.parametrize("number", [-1, 11])
def test_an_unknown_model_proto_number_is_an_error(number: int) -> None:
    with pytest.raises(ValueError, match=str(number)):
        model_state_from_proto(number)


@pytest.mark.parametrize(
    ("predicate", "members"),
    [
        (LIVE, {S.LOADED, S.AVAILABLE, S.LOADED_UNAVAILABLE, S.DRAINING}),
        (ALREADY_LOADING_OR_LOADED, {S.LOADING, S.LOADED, S.AVAILABLE, S.LOADED_UNAVAILABLE}),
        (
            UNLOADING_OR_UNLOADED,
            {S.UNLOAD_ENVOY_REQUESTED, S.UNLOAD_REQUESTED, S.UNLOADING, S.UNLOADED, S.UNKNOWN},
        ),
        (INACTIVE, {S.UNLOADED, S.UNLOAD_FAILED, S.UNKNOWN, S.LOAD_FAILED}),
        (HOSTING, {S.LOADED, S.LOAD_REQUESTED, S.LOADING, S.AVAILABLE, S.LOADED_UNAVAILABLE}),
        (ROUTABLE, {S.LOADED, S.AVAILABLE, S.LOADED_UNAVAILABLE}),
    ],
    ids=["live", "already_loading_or_loaded", "unloading_or_unloaded", "inactive", "hosting", "routable"],
)
def test_predicate_sets_are_seldons_exactly(
    predicate: frozenset[ReplicaState], members: set[ReplicaState]
) -> None:
    assert predicate == members


@pytest.mark.parametrize(
    ("replicas", "expected"),
    [
        ({}, ()),
        ({2: S.AVAILABLE, 0: S.LOADED, 1: S.LOADED_UNAVAILABLE}, (0, 1, 2)),
        ({0: S.DRAINING, 1: S.AVAILABLE, 2: S.LOADING}, (1,)),  # draining only when nothing else serves
        ({0: S.DRAINING, 3: S.DRAINING, 1: S.LOADING, 2: S.LOAD_FAILED}, (0, 3)),
        ({0: S.LOAD_REQUESTED, 1: S.LOADING, 2: S.UNLOADING, 3: S.LOAD_FAILED}, ()),
    ],
)
def test_routable_assignment(replicas: dict[int, ReplicaState], expected: tuple[int, ...]) -> None:
    assert routable_assignment(replicas) == expected
