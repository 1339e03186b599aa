"""A model version's state, derived from its replicas' states (Seldon's rules, compat §4).

`derive_status` is recomputed by the caller whenever a replica of the version changes, the version
is placed, unloaded or deleted. `schedule_failed` is the other way a status is made: the caller
records it when `plan` returns a PlacementFailure, and stores it as the version's status like any
other. It is "sticky" only in that sense: it stays until the caller next computes the version's
status, which (as in Seldon) happens on the next replica change or successful placement, and then
`derive_status` replaces it. Neither function reads a clock: replica timestamps come in with the
replicas and `schedule_failed` takes `now`.

Timestamps: a derived status carries the newest replica timestamp, or for Failed and
TerminateFailed the failing replica's; None when the version has no replicas (Seldon leaves Go's
zero time there). Among replicas with the same timestamp the lowest index wins, where Seldon takes
whichever its map yields first. TerminateFailed takes its reason and time from the newest
UnloadFailed replica whether the model is deleted or the version is only superseded; Seldon does so
only for a deleted model (for a superseded one it reports the newest LoadFailed replica's, or
nothing), which reads as an accident of sharing one "last failure" field between the branches.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from modelyard.placement.spec import ModelSpec
from modelyard.placement.states import ModelState, ReplicaState, ReplicaStatus, routable_assignment

_S = ReplicaState

# Which counter each replica state adds to (Unknown adds to none). Loaded is "loading": it is not
# available until the routes include it. LoadedUnavailable counts as a failure: it is loaded but
# the routes could not be updated.
_AVAILABLE = frozenset({_S.AVAILABLE})
_LOADING = frozenset({_S.LOAD_REQUESTED, _S.LOADING, _S.LOADED})
_LOAD_FAILED = frozenset({_S.LOAD_FAILED, _S.LOADED_UNAVAILABLE})
_UNLOADING = frozenset({_S.UNLOAD_ENVOY_REQUESTED, _S.UNLOAD_REQUESTED, _S.UNLOADING})
_UNLOAD_FAILED = frozenset({_S.UNLOAD_FAILED})


@dataclass(slots=True, frozen=True)
class ModelStatus:
    """A version's state, why (for the failure states), its replica counts and when it last changed.

    `unavailable` counts replicas loading or failed; `draining` those draining (neither counts
    in `available`)."""

    state: ModelState
    reason: str = ""
    available: int = 0
    unavailable: int = 0
    draining: int = 0
    timestamp: float | None = None


def derive_status(
    replicas: Mapping[int, ReplicaStatus],
    spec: ModelSpec,
    *,
    deleted: bool,
    latest: bool,
    other_version_available: bool,
) -> ModelStatus:
    """The status of one version from its replicas (index -> status).

    `deleted`: the model is deleted; `latest`: this is its latest version;
    `other_version_available`: the model's last version whose stored state is ModelAvailable is a
    different version (Seldon's rollout shortcut, rule 4.3(c))."""
    items = sorted(replicas.items())
    available = _count(items, _AVAILABLE)
    loading = _count(items, _LOADING)
    load_failed = _count(items, _LOAD_FAILED)
    state, failed = _state(items, spec, available, loading, deleted, latest, other_version_available)
    return ModelStatus(
        state,
        failed.reason if failed else "",
        available=available,
        unavailable=loading + load_failed,
        draining=_count(items, {_S.DRAINING}),
        timestamp=failed.timestamp if failed else max((s.timestamp for _, s in items), default=None),
    )


def _state(
    items: list[tuple[int, ReplicaStatus]],
    spec: ModelSpec,
    available: int,
    loading: int,
    deleted: bool,
    latest: bool,
    other_version_available: bool,
) -> tuple[ModelState, ReplicaStatus | None]:
    """The state, and the failed replica that gives a failure state its reason and time."""
    if deleted or not latest:
        failed = _most_recent(items, _UNLOAD_FAILED)
        if failed is not None:
            return ModelState.TERMINATE_FAILED, failed
        if _count(items, _UNLOADING) or available or loading:
            # LoadFailed replicas hold nothing, and Draining ones leave with their server replica,
            # so neither holds a termination up.
            return ModelState.TERMINATING, None
        return ModelState.TERMINATED, None
    failed = _most_recent(items, _LOAD_FAILED)
    if failed is not None:
        # One failed replica fails the version even while others serve (compat §13.8).
        return ModelState.FAILED, failed
    if available == 0 and spec.replicas == 0 and spec.min_replicas == 0:
        return ModelState.SCALED_DOWN, None
    if (
        available == spec.replicas
        or (spec.min_replicas > 0 and available >= spec.min_replicas)
        or (available > 0 and other_version_available)
    ):
        return ModelState.AVAILABLE, None
    return ModelState.PROGRESSING, None


def schedule_failed(
    replicas: Mapping[int, ReplicaStatus], spec: ModelSpec, reason: str, now: float
) -> ModelStatus:
    """The status to record when placement fails with `reason` (Seldon's FailedScheduling).

    Replica states are not touched: a version still serving on old replicas keeps serving.
    `available` is the number of replicas traffic can still go to (§2.1's routable assignment),
    `unavailable` the rest of the desired replicas (never below 0: Seldon's unsigned subtraction
    wraps when more replicas serve than are now desired)."""
    states = {index: status.state for index, status in replicas.items()}
    available = len(routable_assignment(states))
    return ModelStatus(
        ModelState.SCHEDULE_FAILED,
        reason,
        available=available,
        unavailable=max(0, spec.replicas - available),
        draining=sum(1 for state in states.values() if state is _S.DRAINING),
        timestamp=now,
    )


def should_retry(status: ModelStatus, spec: ModelSpec) -> bool:
    """Whether the latest version is one Seldon's retry pass places again (compat §5.5): it failed
    to load or to be placed, or it is Available or Progressing with fewer replicas than desired."""
    if status.state in (ModelState.FAILED, ModelState.SCHEDULE_FAILED):
        return True
    return status.state in (ModelState.AVAILABLE, ModelState.PROGRESSING) and status.available < spec.replicas


def _count(items: Iterable[tuple[int, ReplicaStatus]], states: Iterable[ReplicaState]) -> int:
    wanted = frozenset(states)
    return sum(1 for _, status in items if status.state in wanted)


def _most_recent(
    items: Iterable[tuple[int, ReplicaStatus]], states: frozenset[ReplicaState]
) -> ReplicaStatus | None:
    best: ReplicaStatus | None = None
    for _, status in items:  # ascending index, so a tie keeps the lowest index
        if status.state in states and (best is None or status.timestamp > best.timestamp):
            best = status
    return best
