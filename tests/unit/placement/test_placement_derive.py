"""A version's state from its replicas (compat §4), ScheduleFailed (§5.4) and the retry set (§5.5)."""

from __future__ import annotations

import pytest

from modelyard.placement import (
    ModelSpec,
    ModelState,
    ModelStatus,
    ReplicaState,
    ReplicaStatus,
    derive_status,
    schedule_failed,
    should_retry,
)

S = ReplicaState
M = ModelState


def spec(replicas: int = 1, min_replicas: int = 0) -> ModelSpec:
    return ModelSpec(name="iris", storage_uri="x", replicas=replicas, min_replicas=min_replicas)


def replicas(*states: ReplicaState) -> dict[int, ReplicaStatus]:
    """Replica i in states[i], entered at time i + 1."""
    return {i: ReplicaStatus(state, timestamp=float(i + 1)) for i, state in enumerate(states)}


def latest_state(
    states: tuple[ReplicaState, ...], replicas_: int = 1, min_: int = 0, other: bool = False
) -> ModelState:
    return derive_status(
        replicas(*states), spec(replicas_, min_), deleted=False, latest=True, other_version_available=other
    ).state


@pytest.mark.parametrize(
    ("states", "desired", "min_", "other", "expected"),
    [
        # 4.3(a): exactly the desired number Available
        ((S.AVAILABLE,), 1, 0, False, M.AVAILABLE),
        ((S.AVAILABLE, S.AVAILABLE, S.AVAILABLE), 3, 0, False, M.AVAILABLE),
        ((S.AVAILABLE, S.AVAILABLE), 3, 0, False, M.PROGRESSING),
        ((S.AVAILABLE, S.AVAILABLE, S.AVAILABLE), 2, 0, False, M.PROGRESSING),  # equality, not >=
        ((), 1, 0, False, M.PROGRESSING),
        ((S.LOADED,), 1, 0, False, M.PROGRESSING),  # Loaded is not Available until routed
        ((S.LOAD_REQUESTED, S.LOADING), 2, 0, False, M.PROGRESSING),
        ((S.DRAINING,), 1, 0, False, M.PROGRESSING),
        ((S.AVAILABLE, S.DRAINING), 1, 0, False, M.AVAILABLE),
        ((S.AVAILABLE, S.UNLOAD_ENVOY_REQUESTED), 1, 0, False, M.AVAILABLE),
        ((S.AVAILABLE, S.UNKNOWN), 1, 0, False, M.AVAILABLE),
        # 4.1: any failed replica fails the version, even beside Available ones
        ((S.AVAILABLE, S.LOAD_FAILED), 2, 0, False, M.FAILED),
        ((S.AVAILABLE, S.LOAD_FAILED), 1, 0, True, M.FAILED),
        ((S.LOADED_UNAVAILABLE,), 1, 0, False, M.FAILED),
        ((S.UNLOAD_FAILED,), 1, 0, False, M.PROGRESSING),  # not a load failure for the latest
        # 4.2: scaled down to nothing
        ((), 0, 0, False, M.SCALED_DOWN),
        ((S.UNLOAD_ENVOY_REQUESTED, S.UNLOADED), 0, 0, False, M.SCALED_DOWN),
        ((S.AVAILABLE,), 0, 0, False, M.PROGRESSING),  # still being scaled down
        ((S.LOAD_FAILED,), 0, 0, False, M.FAILED),
        # 4.3(b): min_replicas satisfied (partial placement)
        ((S.AVAILABLE, S.AVAILABLE, S.LOADING), 3, 2, False, M.AVAILABLE),
        ((S.AVAILABLE, S.AVAILABLE), 4, 2, False, M.AVAILABLE),
        ((S.AVAILABLE, S.LOADING, S.LOADING), 3, 2, False, M.PROGRESSING),
        # 4.3(c): the rollout shortcut, while another version is the last Available one
        ((S.AVAILABLE, S.LOADING), 3, 0, True, M.AVAILABLE),
        ((S.AVAILABLE, S.LOADING), 3, 0, False, M.PROGRESSING),
        ((S.LOADED, S.LOADING), 3, 0, True, M.PROGRESSING),
        ((), 1, 0, True, M.PROGRESSING),
    ],
)
def test_latest_version_of_a_live_model(
    states: tuple[ReplicaState, ...], desired: int, min_: int, other: bool, expected: ModelState
) -> None:
    assert latest_state(states, desired, min_, other) is expected


@pytest.mark.parametrize(
    ("states", "expected"),
    [
        ((), M.TERMINATED),
        ((S.UNLOADED, S.UNLOADED), M.TERMINATED),
        ((S.LOAD_FAILED, S.DRAINING, S.UNLOADED), M.TERMINATED),  # neither holds a termination up
        ((S.UNKNOWN,), M.TERMINATED),
        ((S.UNLOADING, S.UNLOADED), M.TERMINATING),
        ((S.UNLOAD_REQUESTED,), M.TERMINATING),
        ((S.UNLOAD_ENVOY_REQUESTED,), M.TERMINATING),
        ((S.AVAILABLE, S.UNLOADED), M.TERMINATING),
        ((S.LOAD_REQUESTED,), M.TERMINATING),
        ((S.LOADED,), M.TERMINATING),
        ((S.LOADED_UNAVAILABLE,), M.TERMINATED),  # counts as a load failure
        ((S.UNLOAD_FAILED, S.UNLOADING), M.TERMINATE_FAILED),
        ((S.AVAILABLE, S.UNLOAD_FAILED), M.TERMINATE_FAILED),
    ],
)
@pytest.mark.parametrize(("deleted", "latest"), [(True, True), (True, False), (False, False)])
def test_deleted_model_or_older_version(
    states: tuple[ReplicaState, ...], expected: ModelState, deleted: bool, latest: bool
) -> None:
    # The same rules whether the model is deleted or the version superseded; nothing here
    # depends on the desired replicas or on other versions.
    status = derive_status(
        replicas(*states), spec(replicas=3), deleted=deleted, latest=latest, other_version_available=True
    )
    assert status.state is expected


def test_counts() -> None:
    status = derive_status(
        replicas(
            S.AVAILABLE,
            S.AVAILABLE,
            S.LOAD_REQUESTED,
            S.LOADING,
            S.LOADED,
            S.DRAINING,
            S.UNLOADING,
            S.UNLOADED,
            S.UNKNOWN,
        ),
        spec(replicas=5),
        deleted=False,
        latest=True,
        other_version_available=False,
    )
    assert (status.available, status.unavailable, status.draining) == (2, 3, 1)
    failed = derive_status(
        replicas(S.AVAILABLE, S.LOAD_FAILED, S.LOADED_UNAVAILABLE, S.LOADING),
        spec(replicas=4),
        deleted=False,
        latest=True,
        other_version_available=False,
    )
    assert (failed.available, failed.unavailable, failed.draining) == (1, 3, 0)


def test_timestamp_is_the_newest_replica_change() -> None:
    status = derive_status(
        {0: ReplicaStatus(S.AVAILABLE, timestamp=30.0), 1: ReplicaStatus(S.LOADING, timestamp=45.5)},
        spec(replicas=2),
        deleted=False,
        latest=True,
        other_version_available=False,
    )
    assert status == ModelStatus(M.PROGRESSING, "", available=1, unavailable=1, draining=0, timestamp=45.5)


def test_no_replicas_no_timestamp() -> None:
    status = derive_status({}, spec(), deleted=True, latest=True, other_version_available=False)
    assert status == ModelStatus(M.TERMINATED, timestamp=None)


@pytest.mark.parametrize("failure", [S.LOAD_FAILED, S.LOADED_UNAVAILABLE])
def test_failed_takes_reason_and_time_from_the_most_recent_failure(failure: ReplicaState) -> None:
    status = derive_status(
        {
            0: ReplicaStatus(S.LOAD_FAILED, "disk full", 10.0),
            1: ReplicaStatus(failure, "newest failure", 20.0),
            2: ReplicaStatus(S.AVAILABLE, "", 99.0),
        },
        spec(replicas=3),
        deleted=False,
        latest=True,
        other_version_available=False,
    )
    assert (status.state, status.reason, status.timestamp) == (M.FAILED, "newest failure", 20.0)


def test_failures_at_the_same_time_take_the_lowest_replica() -> None:
    status = derive_status(
        {3: ReplicaStatus(S.LOAD_FAILED, "three", 5.0), 1: ReplicaStatus(S.LOAD_FAILED, "one", 5.0)},
        spec(replicas=2),
        deleted=False,
        latest=True,
        other_version_available=False,
    )
    assert status.reason == "one"


@pytest.mark.parametrize(("deleted", "latest"), [(True, True), (False, False)])
def test_terminate_failed_takes_reason_and_time_from_the_most_recent_unload_failure(
    deleted: bool, latest: bool
) -> None:
    status = derive_status(
        {
            0: ReplicaStatus(S.UNLOAD_FAILED, "busy", 10.0),
            1: ReplicaStatus(S.UNLOAD_FAILED, "server gone", 12.0),
            2: ReplicaStatus(S.LOAD_FAILED, "a load failure", 50.0),
        },
        spec(),
        deleted=deleted,
        latest=latest,
        other_version_available=False,
    )
    assert (status.state, status.reason, status.timestamp) == (M.TERMINATE_FAILED, "server gone", 12.0)


def test_a_deleted_model_does_not_report_its_load_failures() -> None:
    status = derive_status(
        {0: ReplicaStatus(S.LOAD_FAILED, "oom", 3.0), 1: ReplicaStatus(S.UNLOADING, "", 4.0)},
        spec(),
        deleted=True,
        latest=True,
        other_version_available=False,
    )
    assert (status.state, status.reason, status.timestamp) == (M.TERMINATING, "", 4.0)


@pytest.mark.parametrize(
    ("states", "desired", "available", "unavailable", "draining"),
    [
        ((), 2, 0, 2, 0),
        ((S.AVAILABLE, S.LOADED, S.LOADING), 5, 2, 3, 0),  # a failed scale-up keeps serving
        ((S.DRAINING, S.DRAINING, S.LOADING), 3, 2, 1, 2),  # draining replicas still take traffic
        ((S.AVAILABLE, S.DRAINING), 3, 1, 2, 1),
        ((S.AVAILABLE, S.AVAILABLE, S.AVAILABLE), 1, 3, 0, 0),  # no underflow
    ],
)
def test_schedule_failed(
    states: tuple[ReplicaState, ...], desired: int, available: int, unavailable: int, draining: int
) -> None:
    status = schedule_failed(replicas(*states), spec(replicas=desired), "no room", now=123.0)
    assert status == ModelStatus(M.SCHEDULE_FAILED, "no room", available, unavailable, draining, 123.0)


def test_schedule_failed_lasts_until_the_next_derivation() -> None:
    # The caller stores whichever status it computed last: a later replica change replaces it.
    current = replicas(S.AVAILABLE)
    failed = schedule_failed(current, spec(replicas=2), "no room", now=5.0)
    assert failed.state is M.SCHEDULE_FAILED
    after = derive_status(
        {**current, 1: ReplicaStatus(S.AVAILABLE, timestamp=6.0)},
        spec(replicas=2),
        deleted=False,
        latest=True,
        other_version_available=False,
    )
    assert after.state is M.AVAILABLE


@pytest.mark.parametrize(
    ("state", "available", "desired", "expected"),
    [
        (M.FAILED, 3, 3, True),
        (M.SCHEDULE_FAILED, 0, 1, True),
        (M.AVAILABLE, 1, 3, True),  # partially placed
        (M.PROGRESSING, 0, 1, True),
        (M.AVAILABLE, 3, 3, False),
        (M.PROGRESSING, 2, 2, False),
        (M.SCALED_DOWN, 0, 0, False),
        (M.TERMINATING, 0, 1, False),
        (M.TERMINATED, 0, 1, False),
    ],
)
def test_should_retry(state: ModelState, available: int, desired: int, expected: bool) -> None:
    assert should_retry(ModelStatus(state, available=available), spec(replicas=desired)) is expected
