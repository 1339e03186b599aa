"""Placement (compat §5.2): every filter, sorter and failure reason, both passes, moves, deletion."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from modelyard.placement import (
    NO_MATCHING_SERVERS,
    NOT_ENOUGH_REPLICAS,
    ModelSpec,
    ModelView,
    Placement,
    PlacementFailure,
    ReplicaChange,
    ReplicaState,
    ReplicaStatus,
    ReplicaView,
    ServerView,
    VersionView,
    plan,
    required_memory,
)

S = ReplicaState
LR, UER, UR = S.LOAD_REQUESTED, S.UNLOAD_ENVOY_REQUESTED, S.UNLOAD_REQUESTED


def replica(
    index: int,
    free: int = 100,
    *,
    caps: tuple[str, ...] = ("sklearn",),
    reserved: int = 0,
    total: int | None = None,
    draining: bool = False,
) -> ReplicaView:
    return ReplicaView(index, frozenset(caps), free + reserved, reserved, total, draining)


def server(name: str, *replicas: ReplicaView, shared: bool = True, expected: int | None = None) -> ServerView:
    return ServerView(name, replicas, shared, expected)


def uniform(name: str, count: int, free: int = 100, **kwargs: Any) -> ServerView:
    return server(name, *(replica(i, free) for i in range(count)), **kwargs)


def model(
    replicas: int = 1,
    *,
    min_replicas: int = 0,
    memory: int = 10,
    requirements: tuple[str, ...] = ("sklearn",),
    pin: str | None = None,
    bound: str | None = None,
    states: dict[int, ReplicaState] | None = None,
    instances: int | None = None,
    deleted: bool = False,
    older: tuple[VersionView, ...] = (),
) -> ModelView:
    spec = ModelSpec(
        name="iris",
        storage_uri="file:///iris",
        requirements=requirements,
        memory=memory,
        server=pin,
        replicas=replicas,
        min_replicas=min_replicas,
    )
    number = older[-1].version + 1 if older else 1
    statuses = {i: ReplicaStatus(state) for i, state in (states or {}).items()}
    return ModelView((*older, VersionView(number, spec, bound, statuses, instances)), deleted)


def placed(result: Placement | PlacementFailure) -> Placement:
    assert isinstance(result, Placement), result
    return result


def failed(result: Placement | PlacementFailure) -> PlacementFailure:
    assert isinstance(result, PlacementFailure), result
    return result


def where(result: Placement | PlacementFailure) -> tuple[str | None, tuple[int, ...]] | str:
    """The server and replicas chosen, or the failure reason."""
    if isinstance(result, PlacementFailure):
        return result.reason
    return result.server, result.replicas


# --- server filters -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("servers", "spec", "expected"),
    [
        # ServerReplicaFilter: a server with no connected replica is out
        ([server("a")], {}, NO_MATCHING_SERVERS),
        ([server("a"), uniform("b", 1)], {}, ("b", (0,))),
        # SharingServerFilter: unpinned models go to shared servers only
        ([uniform("a", 1, shared=False)], {}, NO_MATCHING_SERVERS),
        ([uniform("a", 1, shared=False), uniform("b", 1)], {}, ("b", (0,))),
        # ... a pinned model to its server only, shared or not
        ([uniform("a", 1, shared=False)], {"pin": "a"}, ("a", (0,))),
        ([uniform("a", 1), uniform("b", 1, free=10)], {"pin": "b"}, ("b", (0,))),
        ([uniform("a", 1)], {"pin": "b"}, NO_MATCHING_SERVERS),
        # DeletedServerFilter: expected replicas 0 means the server is going away; unknown passes
        ([uniform("a", 1, expected=0)], {}, NO_MATCHING_SERVERS),
        ([uniform("a", 1, expected=0), uniform("b", 1, free=20)], {}, ("b", (0,))),
        ([uniform("a", 1, expected=None)], {}, ("a", (0,))),
        ([uniform("a", 1, expected=3)], {}, ("a", (0,))),
        # ServerRequirementFilter: exact, case-sensitive, trimmed
        ([server("a", replica(0, caps=("xgboost",)))], {}, NO_MATCHING_SERVERS),
        ([server("a", replica(0, caps=("SKLearn",)))], {}, NO_MATCHING_SERVERS),
        ([server("a", replica(0, caps=(" sklearn ",)))], {}, ("a", (0,))),
        (
            [server("a", replica(0, caps=("sklearn",)))],
            {"requirements": ("sklearn", "gpu")},
            NO_MATCHING_SERVERS,
        ),
        (
            [server("a", replica(0, caps=("gpu", "sklearn", "x")))],
            {"requirements": ("sklearn", "gpu")},
            ("a", (0,)),
        ),
        ([server("a", replica(0, caps=()))], {"requirements": ()}, ("a", (0,))),
    ],
    ids=lambda value: None if isinstance(value, list | dict | tuple) else str(value),
)
def test_server_filters(servers: list[ServerView], spec: dict[str, Any], expected: object) -> None:
    assert where(plan(servers, model(**spec))) == expected


def test_requirements_are_checked_on_every_replica() -> None:
    # Seldon asks one arbitrary replica; here a replica lacking one is filtered out, so a server
    # qualifies with enough capable replicas and never places on an incapable one.
    mixed = server(
        "a",
        replica(0, 500, caps=("sklearn",)),
        replica(1, caps=("sklearn", "gpu")),
        replica(2, caps=("gpu",)),
    )
    gpu = ("sklearn", "gpu")
    assert where(plan([mixed], model(1, requirements=gpu))) == ("a", (1,))
    assert where(plan([mixed], model(2, requirements=gpu))) == NOT_ENOUGH_REPLICAS
    assert where(plan([mixed], model(2, requirements=("sklearn",)))) == ("a", (0, 1))


# --- replica filters ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("replicas", "spec", "expected"),
    [
        # AvailableMemoryReplicaFilter: free = available - reserved must cover the requirement
        ([replica(0, 9), replica(1, 50)], {"memory": 10}, (1,)),
        ([replica(0, 10)], {"memory": 10}, (0,)),  # an exact fit fits
        ([replica(0, 9)], {"memory": 10}, NOT_ENOUGH_REPLICAS),
        ([replica(0, 5, reserved=95)], {"memory": 10}, NOT_ENOUGH_REPLICAS),
        ([replica(0, 10, reserved=90)], {"memory": 10}, (0,)),
        ([ReplicaView(0, frozenset({"sklearn"}), 10, 40)], {"memory": 0}, (0,)),  # over-reserved: 0 free
        ([ReplicaView(0, frozenset({"sklearn"}), 10, 40)], {"memory": 1}, NOT_ENOUGH_REPLICAS),
        ([replica(0, 0)], {"memory": 0}, (0,)),  # no memory given: always fits
        # memory x instance count once the agent has reported it
        ([replica(0, 39)], {"memory": 10, "instances": 4}, NOT_ENOUGH_REPLICAS),
        ([replica(0, 40)], {"memory": 10, "instances": 4}, (0,)),
        ([replica(0, 10)], {"memory": 10, "instances": 0}, (0,)),  # 0 workers still run one
        ([replica(0, 9)], {"memory": 10, "instances": 0}, NOT_ENOUGH_REPLICAS),
        # a model bigger than the replica's memory cannot load there, whatever overcommit reports
        ([replica(0, 200, total=100)], {"memory": 150}, NOT_ENOUGH_REPLICAS),
        ([replica(0, 200, total=150)], {"memory": 150}, (0,)),
        ([replica(0, 200, total=None)], {"memory": 150}, (0,)),
        # ReplicaDrainingFilter
        ([replica(0, 500, draining=True), replica(1)], {}, (1,)),
        ([replica(0, draining=True)], {}, NOT_ENOUGH_REPLICAS),
    ],
)
def test_replica_filters(replicas: list[ReplicaView], spec: dict[str, Any], expected: object) -> None:
    result = plan([server("a", *replicas)], model(**spec))
    assert where(result) == (expected if isinstance(expected, str) else ("a", expected))


@pytest.mark.parametrize(
    "hosting", [S.LOADING, S.LOADED, S.AVAILABLE, S.LOADED_UNAVAILABLE, S.LOAD_REQUESTED]
)
def test_replicas_already_hosting_the_version_skip_the_memory_check(hosting: ReplicaState) -> None:
    full = server("a", replica(0, 0), replica(1, 0))
    result = placed(plan([full], model(1, memory=10, bound="a", states={1: hosting})))
    assert (result.replicas, result.changes) == ((1,), ())


@pytest.mark.parametrize("other", [S.LOAD_FAILED, S.UNLOAD_FAILED, S.UNLOADED, S.UNLOADING, S.DRAINING])
def test_other_states_do_not_skip_the_memory_check(other: ReplicaState) -> None:
    full = server("a", replica(0, 0))
    assert where(plan([full], model(1, memory=10, bound="a", states={0: other}))) == NOT_ENOUGH_REPLICAS


def test_the_memory_exemption_needs_the_version_bound_to_that_server() -> None:
    # The version's replica states are on the server it is bound to ("b", now gone): replica 0 of
    # "a" hosts nothing of it.
    full = server("a", replica(0, 0))
    assert where(plan([full], model(1, bound="b", states={0: S.AVAILABLE}))) == NOT_ENOUGH_REPLICAS


def test_a_hosting_replica_that_drains_is_replaced() -> None:
    a = server("a", replica(0, draining=True), replica(1, 20))
    result = placed(plan([a], model(1, bound="a", states={0: S.DRAINING})))
    assert result.replicas == (1,)
    assert result.changes == (ReplicaChange(1, 1, LR),)  # the draining replica keeps serving meanwhile


# --- replica order ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("replicas", "states", "desired", "expected"),
    [
        # more free memory first
        ([replica(0, 10), replica(1, 50), replica(2, 30)], {}, 2, (1, 2)),
        ([replica(0, 10), replica(1, 50), replica(2, 30)], {}, 1, (1,)),
        # equal free memory: lower index first
        ([replica(2, 50), replica(0, 50), replica(1, 50)], {}, 2, (0, 1)),
        # free memory is clamped at 0: an over-reserved replica is not "most free" (Seldon's underflow)
        ([ReplicaView(0, frozenset({"sklearn"}), 10, 20), replica(1, 5)], {}, 1, (1,)),
        # hosting the version first, whatever the memory
        ([replica(0, 500), replica(1, 10), replica(2, 300)], {1: S.AVAILABLE}, 1, (1,)),
        ([replica(0, 500), replica(1, 10), replica(2, 300)], {1: S.LOADING}, 2, (0, 1)),
        ([replica(0, 500), replica(1, 10), replica(2, 300)], {1: S.LOAD_REQUESTED, 2: S.LOADED}, 2, (1, 2)),
        # ... but a replica where it failed is not hosting it
        ([replica(0, 500), replica(1, 10), replica(2, 300)], {1: S.LOAD_FAILED}, 1, (0,)),
        # among hosting replicas, more free memory, then lower index
        ([replica(0, 20), replica(1, 40), replica(2, 40)], {i: S.AVAILABLE for i in range(3)}, 2, (1, 2)),
        ([replica(0, 40), replica(1, 40), replica(2, 40)], {i: S.AVAILABLE for i in range(3)}, 1, (0,)),
    ],
)
def test_replica_order(
    replicas: list[ReplicaView], states: dict[int, ReplicaState], desired: int, expected: tuple[int, ...]
) -> None:
    result = plan([server("a", *replicas)], model(desired, memory=5, bound="a", states=states))
    assert where(result) == ("a", expected)


# --- server order -------------------------------------------------------------------------------


def test_the_bound_server_comes_first() -> None:
    servers = [uniform("a", 2, free=1000), uniform("b", 2, free=50), uniform("c", 2, free=500)]
    assert where(plan(servers, model(1, bound="b", states={0: S.AVAILABLE}))) == ("b", (0,))
    assert where(plan(servers, model(1, bound="b"))) == ("b", (0,))


def test_then_the_most_free_memory_on_suitable_replicas() -> None:
    # "b" has the most memory on paper, but its big replica is draining; "d" has a big replica
    # without the capability the model needs.
    servers = [
        uniform("a", 2, free=200),
        server("b", replica(0, 5000, draining=True), replica(1, 100)),
        uniform("c", 2, free=300),
        server("d", replica(0, 5000, caps=("triton",)), replica(1, 100)),
    ]
    assert where(plan(servers, model(1))) == ("c", (0,))


@pytest.mark.parametrize("order", list(itertools.permutations(["c", "a", "b"])))
def test_then_by_name_whatever_the_snapshot_order(order: tuple[str, ...]) -> None:
    assert where(plan([uniform(name, 1) for name in order], model(1))) == ("a", (0,))


def test_a_server_too_small_is_skipped_for_the_next() -> None:
    servers = [uniform("a", 2, free=1000), uniform("b", 3, free=10)]
    assert where(plan(servers, model(3))) == ("b", (0, 1, 2))


# --- pass 1, pass 2 and the failure reasons -----------------------------------------------------


@pytest.mark.parametrize(
    ("servers", "desired", "min_", "expected", "partial"),
    [
        # pass 1: every replica on one server
        ([uniform("a", 3)], 3, 0, ("a", (0, 1, 2)), False),
        ([uniform("a", 2), uniform("b", 3)], 3, 0, ("b", (0, 1, 2)), False),
        # never split across servers, even when together they would do
        ([uniform("a", 2), uniform("b", 2)], 3, 0, NOT_ENOUGH_REPLICAS, None),
        ([uniform("a", 1)], 2, 0, NOT_ENOUGH_REPLICAS, None),
        # pass 2: at least min_replicas, as many as there are up to replicas
        ([uniform("a", 2)], 3, 2, ("a", (0, 1)), True),
        ([uniform("a", 3)], 4, 1, ("a", (0, 1, 2)), True),
        # ... on the first server in order that has min_replicas, not the one that has the most
        ([uniform("a", 1), uniform("b", 3, free=10)], 4, 1, ("a", (0,)), True),
        ([uniform("a", 2), uniform("b", 2)], 3, 3, NOT_ENOUGH_REPLICAS, None),
        ([uniform("a", 2)], 4, 3, NOT_ENOUGH_REPLICAS, None),
        # pass 1 wins over a partial placement on a server that comes earlier
        ([uniform("a", 2, free=900), uniform("b", 3)], 3, 1, ("b", (0, 1, 2)), False),
    ],
)
def test_passes(
    servers: list[ServerView], desired: int, min_: int, expected: object, partial: bool | None
) -> None:
    result = plan(servers, model(desired, min_replicas=min_))
    assert where(result) == expected
    if partial is not None:
        assert placed(result).partial is partial


@pytest.mark.parametrize(
    ("servers", "bound", "states", "reason", "unbind"),
    [
        # no matching server: unbind only when nothing is live
        ([], "a", {0: S.AVAILABLE}, NO_MATCHING_SERVERS, False),
        ([], "a", {0: S.DRAINING}, NO_MATCHING_SERVERS, False),
        ([], "a", {0: S.LOADING, 1: S.LOAD_FAILED}, NO_MATCHING_SERVERS, True),
        ([], None, {}, NO_MATCHING_SERVERS, False),  # nothing to unbind
        # not enough replicas: unbind only when nothing is live or loading
        ([uniform("a", 1)], "a", {0: S.LOADING}, NOT_ENOUGH_REPLICAS, False),
        ([uniform("a", 1)], "a", {0: S.LOADED_UNAVAILABLE}, NOT_ENOUGH_REPLICAS, False),
        ([uniform("a", 1)], "a", {0: S.LOAD_REQUESTED}, NOT_ENOUGH_REPLICAS, True),
        ([uniform("a", 1)], "a", {0: S.LOAD_FAILED, 1: S.UNLOADED}, NOT_ENOUGH_REPLICAS, True),
        ([uniform("a", 1)], None, {}, NOT_ENOUGH_REPLICAS, False),
    ],
)
def test_failures_say_whether_to_unbind(
    servers: list[ServerView], bound: str | None, states: dict[int, ReplicaState], reason: str, unbind: bool
) -> None:
    result = failed(plan(servers, model(2, bound=bound, states=states)))
    assert (result.reason, result.unbind) == (reason, unbind)


def test_the_reasons_are_seldons() -> None:
    assert NO_MATCHING_SERVERS == "Failed to schedule model as no matching servers are available"
    assert (
        NOT_ENOUGH_REPLICAS == "Failed to schedule model as no matching server had enough suitable replicas"
    )


@pytest.mark.parametrize(
    ("servers", "min_", "bound", "scale_up"),
    [
        ([uniform("a", 3)], 0, "a", None),  # pass 1 placed it: no hint
        ([uniform("a", 2)], 0, "a", "a"),  # scale-up failed: ask the bound server for replicas
        ([uniform("a", 2)], 2, "a", "a"),  # ... even when pass 2 placed it partly
        ([uniform("a", 2)], 0, None, None),  # a first placement has no server to ask
        ([uniform("a", 2)], 2, None, None),
        ([], 0, "a", None),  # no matching server at all: no hint
    ],
)
def test_scale_up_hint(servers: list[ServerView], min_: int, bound: str | None, scale_up: str | None) -> None:
    assert plan(servers, model(3, min_replicas=min_, bound=bound)).scale_up == scale_up


# --- the changes --------------------------------------------------------------------------------


def test_a_first_placement_requests_every_load_and_reserves_memory() -> None:
    result = placed(plan([uniform("a", 3)], model(2, memory=30)))
    assert result == Placement(
        server="a",
        version=1,
        replicas=(0, 1),
        changes=(ReplicaChange(1, 0, LR), ReplicaChange(1, 1, LR)),
        new_version=False,
        partial=False,
        memory=30,
        scale_up=None,
    )


def test_an_unchanged_placement_changes_nothing() -> None:
    states = {0: S.AVAILABLE, 1: S.AVAILABLE}
    result = placed(plan([uniform("a", 2, free=0)], model(2, bound="a", states=states)))
    assert (result.server, result.version, result.replicas, result.changes) == ("a", 1, (0, 1), ())


@pytest.mark.parametrize(
    ("state", "change"),
    [
        (S.LOAD_FAILED, LR),  # a failed replica chosen again is retried
        (S.UNLOAD_FAILED, LR),
        (S.UNLOADED, LR),
        (S.UNLOADING, LR),
        (S.UNLOAD_REQUESTED, LR),
        (S.UNLOAD_ENVOY_REQUESTED, LR),
        (S.UNKNOWN, LR),
        (S.LOAD_REQUESTED, None),  # already requested: not requested (and reserved) twice
        (S.LOADING, None),
        (S.LOADED, None),
        (S.AVAILABLE, None),
        (S.LOADED_UNAVAILABLE, None),
    ],
)
def test_a_chosen_replica(state: ReplicaState, change: ReplicaState | None) -> None:
    result = placed(plan([uniform("a", 1)], model(1, bound="a", states={0: state})))
    assert result.replicas == (0,)
    assert result.changes == ((ReplicaChange(1, 0, change),) if change else ())


@pytest.mark.parametrize(
    ("state", "change"),
    [
        (S.LOAD_REQUESTED, UER),
        (S.LOADING, UER),
        (S.LOADED, UER),
        (S.AVAILABLE, UER),
        (S.LOADED_UNAVAILABLE, UER),
        (S.LOAD_FAILED, UER),
        (S.UNLOAD_FAILED, UER),
        (S.DRAINING, None),  # keeps serving until its server replica goes
        (S.UNLOAD_ENVOY_REQUESTED, None),
        (S.UNLOAD_REQUESTED, None),
        (S.UNLOADING, None),
        (S.UNLOADED, None),
        (S.UNKNOWN, None),
    ],
)
def test_a_replica_not_chosen(state: ReplicaState, change: ReplicaState | None) -> None:
    # Replica 0 (hosting, most memory) is chosen; replica 1 is in `state`.
    a = server("a", replica(0, 1000), replica(1, 10, draining=state is S.DRAINING))
    result = placed(plan([a], model(1, bound="a", states={0: S.AVAILABLE, 1: state})))
    assert result.replicas == (0,)
    assert result.changes == ((ReplicaChange(1, 1, change),) if change else ())


def test_scale_down_keeps_the_replicas_with_most_room() -> None:
    a = server("a", replica(0, 10), replica(1, 90), replica(2, 50))
    states = {i: S.AVAILABLE for i in range(3)}
    result = placed(plan([a], model(1, bound="a", states=states)))
    assert result.replicas == (1,)
    assert result.changes == (ReplicaChange(1, 0, UER), ReplicaChange(1, 2, UER))


def test_scale_up_keeps_what_is_loaded_and_adds_to_it() -> None:
    a = server("a", replica(0, 10), replica(1, 90), replica(2, 50))
    result = placed(plan([a], model(2, bound="a", states={0: S.AVAILABLE})))
    assert (result.replicas, result.changes) == ((0, 1), (ReplicaChange(1, 1, LR),))


def test_moving_to_another_server_makes_a_new_version() -> None:
    # "a" is being deleted; the version moves to "b" as version 2, and version 1 keeps serving
    # on "a" until the rollout retires it.
    servers = [uniform("a", 2, expected=0), uniform("b", 2)]
    result = placed(plan(servers, model(2, bound="a", states={0: S.AVAILABLE, 1: S.AVAILABLE})))
    assert result == Placement(
        server="b",
        version=2,
        replicas=(0, 1),
        changes=(ReplicaChange(2, 0, LR), ReplicaChange(2, 1, LR)),
        new_version=True,
        partial=False,
        memory=10,
        scale_up=None,
    )


def test_moving_when_the_bound_server_is_too_small() -> None:
    servers = [uniform("a", 1), uniform("b", 3)]
    result = placed(plan(servers, model(3, bound="a", states={0: S.AVAILABLE})))
    # pass 1 placed it (elsewhere), so no scale-up hint for "a"
    assert (result.server, result.version, result.new_version, result.scale_up) == ("b", 2, True, None)


def test_a_partial_move() -> None:
    servers = [uniform("a", 1, expected=0), uniform("b", 2)]
    result = placed(plan(servers, model(3, min_replicas=1, bound="a", states={0: S.AVAILABLE})))
    assert (result.server, result.version, result.replicas, result.partial) == ("b", 2, (0, 1), True)
    assert result.new_version


def test_an_unbound_version_is_placed_without_a_new_version() -> None:
    # After a failure cleared the binding, placing it anywhere keeps its number.
    result = placed(plan([uniform("b", 1)], model(1, bound=None, states={0: S.LOAD_FAILED})))
    assert (result.server, result.version, result.new_version) == ("b", 1, False)


def test_required_memory() -> None:
    assert required_memory(model(memory=100).latest) == 100
    assert required_memory(model(memory=100, instances=3).latest) == 300
    assert required_memory(model(memory=100, instances=0).latest) == 100
    assert required_memory(model(memory=0, instances=8).latest) == 0


# --- scale to zero and deletion -----------------------------------------------------------------


@pytest.mark.parametrize(
    "servers",
    [[uniform("a", 3)], [], [uniform("a", 3, expected=0), uniform("b", 3)]],
    ids=["bound-server-up", "no-servers", "bound-server-deleted"],
)
def test_scale_to_zero_unloads_in_place_and_never_fails(servers: list[ServerView]) -> None:
    states = {0: S.AVAILABLE, 1: S.DRAINING, 2: S.LOAD_FAILED, 3: S.UNLOADED}
    result = placed(plan(servers, model(0, bound="a", states=states)))
    assert (result.server, result.version, result.replicas, result.new_version) == ("a", 1, (), False)
    assert result.changes == (ReplicaChange(1, 0, UER), ReplicaChange(1, 2, UER))


def test_scale_to_zero_of_a_model_never_placed() -> None:
    result = placed(plan([], model(0)))
    assert (result.server, result.replicas, result.changes) == (None, (), ())


def test_deleting_unloads_every_version_that_still_serves() -> None:
    v1 = VersionView(
        1,
        model().latest.spec,
        "a",
        {
            0: ReplicaStatus(S.AVAILABLE),
            1: ReplicaStatus(S.DRAINING),
            2: ReplicaStatus(S.LOAD_FAILED),
            3: ReplicaStatus(S.UNLOADING),
        },
    )
    v2 = VersionView(2, model().latest.spec, "b", {0: ReplicaStatus(S.UNLOADED)})  # nothing live
    v3 = VersionView(3, model().latest.spec, "b")  # not placed anywhere yet
    gone = ModelView((v1, v2, v3), deleted=True)
    result = placed(plan([uniform("a", 4)], gone))
    assert (result.server, result.version, result.replicas) == ("b", 3, ())
    assert result.changes == (ReplicaChange(1, 0, UR), ReplicaChange(1, 1, UR), ReplicaChange(1, 2, UR))


@pytest.mark.parametrize(
    ("states", "changes"),
    [
        # the latest version still serves: everything not already leaving is unloaded directly
        (
            {0: S.AVAILABLE, 1: S.DRAINING, 2: S.LOAD_FAILED, 3: S.UNLOADED, 4: S.LOADING},
            [(0, UR), (1, UR), (2, UR), (4, UR)],
        ),
        # it serves nowhere yet: its loads are withdrawn through the routes, as for a scale-down
        (
            {0: S.LOAD_REQUESTED, 1: S.LOADING, 2: S.LOAD_FAILED, 3: S.UNLOADING},
            [(0, UER), (1, UER), (2, UER)],
        ),
        # a failed unload is left alone (difference 8): the caller retries it on its own schedule
        ({0: S.AVAILABLE, 1: S.UNLOAD_FAILED}, [(0, UR)]),
        ({0: S.UNLOAD_FAILED, 1: S.UNLOADED}, []),
        ({}, []),
    ],
)
def test_deleting_the_latest_version(states: dict[int, ReplicaState], changes: list[tuple[int, S]]) -> None:
    result = placed(plan([], model(2, bound="a", states=states, deleted=True)))
    assert (result.server, result.version, result.replicas) == ("a", 1, ())
    assert result.changes == tuple(ReplicaChange(1, index, state) for index, state in changes)


def test_versions_must_be_ascending() -> None:
    spec = model().latest.spec
    with pytest.raises(ValueError, match="ascending"):
        ModelView((VersionView(2, spec), VersionView(1, spec)))
    with pytest.raises(ValueError, match="ascending"):
        ModelView(())
