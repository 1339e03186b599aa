"""Where the latest version of one model goes: Seldon's placement (compat §5.2), as a pure function.

`plan(servers, model)` reads a snapshot and returns a Placement (the server, the replicas, the
replica-state changes to make) or a PlacementFailure with Seldon's reason. It changes nothing:
the caller applies the changes, reserves `Placement.memory` on each replica a change sets to
LoadRequested, and records the version's status (`derive_status`, or `schedule_failed` on a
failure). A caller placing many models updates the snapshot's reservations between calls.

What Seldon does, and so does this (in order):
- A deleted model: every version with a live replica has its replicas that are not already on
  the way out set to UnloadRequested; then the latest version's remaining active replicas (not
  unloading, not Draining) to UnloadEnvoyRequested. This never fails. (Except UnloadFailed
  replicas: see difference 8.)
- Server filters, all must pass: the server has a replica; the model's `server` pin names it, or
  with no pin the server is shared; the server is not being deleted (expected_replicas 0;
  unknown passes); it offers the model's requirements. None left: NO_MATCHING_SERVERS.
- Replica filters: free memory (agent-reported available minus reservations, clamped at 0) of at
  least the requirement, unless the replica already hosts this version; not draining.
- Replica order: already hosting this version first, then more free memory, then lower index
  (see difference 9).
- Pass 1: the first server (in server order) with at least `replicas` candidates takes the first
  `replicas` of them. Pass 2, only when pass 1 found none and min_replicas > 0: the first server
  with at least `min_replicas` candidates takes as many as it has, up to `replicas`. Neither:
  NOT_ENOUGH_REPLICAS. A version is never split across servers.
- Chosen replicas not already hosting go to LoadRequested; the version's other replicas that are
  not already unloading or Draining go to UnloadEnvoyRequested. Choosing a server other than the
  one the version is bound to is a server move: the changes are for a new version (latest + 1,
  same spec), and the old version is left for the rollout to retire.
- On a failed pass 1, `scale_up` names the server the version was bound to (Seldon's
  SERVER_SCALE_UP hint), whether or not pass 2 placed it.
- On a failure, `unbind` says to clear the version's server binding: for NO_MATCHING_SERVERS when
  no replica is live, for NOT_ENOUGH_REPLICAS when none is live or loading.

Where this differs from Seldon, and why:
1. Requirements are checked on every replica (compat §13.6): Seldon checks one arbitrary replica
   and assumes the rest alike. Here a server passes the server filter when at least one replica
   offers every requirement, and a replica lacking one is filtered out like a full one, so a
   server qualifies with enough capable replicas. Seldon's explainer filter (`alibi-explain` per
   replica) is this same check: a spec with an explainer lists `alibi-explain` in requirements.
2. Servers are ordered deterministically (compat §13.3; Seldon uses Go map order): the server the
   version is bound to first, then the server whose candidate replicas have the most free memory
   in total, then by name.
3. Free memory is max(0, available - reserved) in the filter and the sorter alike; Seldon's sorter
   subtracts unsigned and sorts an over-reserved replica first (compat §13.13).
4. A replica where the version is LoadRequested counts as hosting it for the memory filter, and
   choosing it again changes nothing. Seldon exempts only Loading and later states and sets
   LoadRequested again, so the replica's own reservation could filter it out, or be made twice
   (the reservation leak of compat §5.4).
5. The memory requirement is memory x instance count (MLServer parallel workers, Triton instance
   count) when the agent has reported it, else memory; a count below 1 counts as 1 (Seldon would
   require 0 bytes for MLServer's parallel_workers=0, which still runs one instance).
6. A replica whose total memory is known and smaller than the requirement is filtered out, even
   when overcommit makes its reported available memory large enough: its agent cannot load a
   model bigger than its memory, and Seldon would send the load and watch it fail five times.
7. replicas = 0 unloads the version where it is, never fails and never moves: Seldon still runs the
   server filters, so it reports ScheduleFailed when no server matches, and if the bound server no
   longer passes it "moves" an empty new version elsewhere and leaves the old replicas loaded.
8. A deleted model's UnloadFailed replicas are left alone: Seldon requests their unload again on
   every pass, which with a replica that keeps failing loops UNLOAD through the agent forever and
   hides its reason (the version never shows ModelTerminateFailed). The caller retries them on its
   own schedule (the scheduler: the retry timer, an agent's connect or disconnect).
9. A new version goes first to replicas not serving an older version of the model (then by free
   memory): the server sees the model under one name, so a version placed where an older one
   serves replaces it there (a replace that fails leaves the old one serving where the server
   kept it, as MLServer does; see agent/operations.py). Elsewhere, the old
   version keeps serving beside the new one until the new is Available, and a new version that
   fails to load costs nothing. Seldon places the new version as a fresh model (compat §6.2).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from modelyard.placement.spec import ModelSpec
from modelyard.placement.states import (
    ALREADY_LOADING_OR_LOADED,
    HOSTING,
    LIVE,
    UNLOADING_OR_UNLOADED,
    ReplicaState,
    ReplicaStatus,
)

NO_MATCHING_SERVERS = "Failed to schedule model as no matching servers are available"
NOT_ENOUGH_REPLICAS = "Failed to schedule model as no matching server had enough suitable replicas"


@dataclass(slots=True, frozen=True)
class ReplicaView:
    """One connected replica of a server, as placement sees it.

    `available_memory` is what its agent last reported (overcommit included); `reserved_memory`
    is for the loads placed on it that have not reported yet: the sum of `required_memory` over
    the versions in LoadRequested or Loading on it. A scheduler that sums it from its stored
    replica states, rather than keeping a counter, cannot leak it (compat §5.4). `total_memory` is
    the replica's memory (None: unknown); `capabilities` are compared trimmed."""

    index: int
    capabilities: frozenset[str] = frozenset()
    available_memory: int = 0
    reserved_memory: int = 0
    total_memory: int | None = None
    draining: bool = False

    @property
    def free_memory(self) -> int:
        return max(0, self.available_memory - self.reserved_memory)


@dataclass(slots=True, frozen=True)
class ServerView:
    """A server and its connected replicas. `expected_replicas` is what its operator last said it
    should have: None when unknown, 0 when it is being deleted."""

    name: str
    replicas: tuple[ReplicaView, ...] = ()
    shared: bool = True
    expected_replicas: int | None = None


@dataclass(slots=True, frozen=True)
class VersionView:
    """One version of a model: its spec, the server it is bound to (None: not placed) and its
    state on each replica of that server (replica index -> status). `instance_count` is the
    runtime info an agent reports with the first load; None until then."""

    version: int
    spec: ModelSpec
    server: str | None = None
    replicas: Mapping[int, ReplicaStatus] = field(default_factory=dict)
    instance_count: int | None = None


@dataclass(slots=True, frozen=True)
class ModelView:
    """A model's versions, oldest first, and whether it is deleted."""

    versions: tuple[VersionView, ...]
    deleted: bool = False

    def __post_init__(self) -> None:
        numbers = [v.version for v in self.versions]
        if not numbers or numbers != sorted(set(numbers)):
            raise ValueError(f"a model needs versions in ascending order, got {numbers}")

    @property
    def latest(self) -> VersionView:
        return self.versions[-1]


@dataclass(slots=True, frozen=True)
class ReplicaChange:
    """Set `version`'s state on replica `replica` (of the placement's server) to `state`."""

    version: int
    replica: int
    state: ReplicaState


@dataclass(slots=True, frozen=True)
class Placement:
    """A plan that succeeded.

    `version` is the version the placement is for: the latest, or latest + 1 when `new_version`
    (a server move: the caller appends it with the latest spec, bound to `server`). `replicas` are
    the chosen replica indexes, ascending; `server` is None only when nothing is placed and the
    version was never bound. `partial`: pass 2 placed fewer than the desired replicas (the model
    stays in the retry set). `memory` is what each change to LoadRequested reserves."""

    server: str | None
    version: int
    replicas: tuple[int, ...]
    changes: tuple[ReplicaChange, ...]
    new_version: bool = False
    partial: bool = False
    memory: int = 0
    scale_up: str | None = None


@dataclass(slots=True, frozen=True)
class PlacementFailure:
    """A plan that failed: record `schedule_failed(..., reason, now)` as the latest version's status
    and, when `unbind`, clear its server binding. `scale_up` as in Placement."""

    reason: str
    unbind: bool = False
    scale_up: str | None = None


def required_memory(version: VersionView) -> int:
    """Bytes one replica of `version` needs: memory per instance times the instance count."""
    instances = version.instance_count if version.instance_count is not None else 1
    return version.spec.memory * max(1, instances)


def plan(servers: Iterable[ServerView], model: ModelView) -> Placement | PlacementFailure:
    """Place the latest version of `model` on `servers` (see the module docstring)."""
    latest = model.latest
    if model.deleted:
        return _delete(model)
    spec = latest.spec
    memory = required_memory(latest)
    if spec.replicas == 0:
        return Placement(latest.server, latest.version, (), _unload_others(latest, ()), memory=memory)

    requirements = frozenset(spec.requirements)
    eligible = [s for s in servers if _server_passes(s, spec, requirements)]
    if not eligible:
        return PlacementFailure(NO_MATCHING_SERVERS, unbind=_bound(latest) and not _any(latest, LIVE))

    ranked = sorted(
        ((server, _candidates(server, model, memory, requirements)) for server in eligible),
        key=lambda pair: (pair[0].name != latest.server, -sum(r.free_memory for r in pair[1]), pair[0].name),
    )
    for server, candidates in ranked:
        if len(candidates) >= spec.replicas:
            return _place(latest, server, candidates[: spec.replicas], memory, scale_up=None)
    scale_up = latest.server
    if spec.min_replicas > 0:
        for server, candidates in ranked:
            if len(candidates) >= spec.min_replicas:
                return _place(latest, server, candidates[: spec.replicas], memory, scale_up=scale_up)
    unbind = _bound(latest) and not _any(latest, LIVE | ALREADY_LOADING_OR_LOADED)
    return PlacementFailure(NOT_ENOUGH_REPLICAS, unbind=unbind, scale_up=scale_up)


def _server_passes(server: ServerView, spec: ModelSpec, requirements: frozenset[str]) -> bool:
    if not server.replicas:
        return False
    if spec.server is not None:
        if server.name != spec.server:  # a pinned model goes to its server, shared or not
            return False
    elif not server.shared:
        return False
    if server.expected_replicas == 0:
        return False
    return any(requirements <= _capabilities(replica) for replica in server.replicas)


def _candidates(
    server: ServerView, model: ModelView, memory: int, requirements: frozenset[str]
) -> list[ReplicaView]:
    """The replicas that may host the version, best first (difference 9: a replica serving an
    older version of the model comes after the others)."""
    latest = model.latest
    bound_here = latest.server == server.name
    serving_older = {
        index
        for version in model.versions
        if version is not latest and version.server == server.name
        for index, status in version.replicas.items()
        if status.state in LIVE
    }
    keyed: list[tuple[bool, bool, int, int, ReplicaView]] = []
    for replica in server.replicas:
        if replica.draining or not requirements <= _capabilities(replica):
            continue
        status = latest.replicas.get(replica.index) if bound_here else None
        hosting = status is not None and status.state in HOSTING
        if not hosting and (
            memory > replica.free_memory
            or (replica.total_memory is not None and memory > replica.total_memory)
        ):
            continue
        older = not hosting and replica.index in serving_older
        keyed.append((not hosting, older, -replica.free_memory, replica.index, replica))
    keyed.sort(key=lambda entry: entry[:4])
    return [entry[4] for entry in keyed]


def _place(
    latest: VersionView, server: ServerView, chosen: list[ReplicaView], memory: int, scale_up: str | None
) -> Placement:
    indexes = tuple(sorted(replica.index for replica in chosen))
    partial = len(indexes) < latest.spec.replicas
    if latest.server is not None and latest.server != server.name:
        # A version lives on one server: moving makes a new version with no replicas yet, and the
        # old one keeps serving until the new one is available.
        version = latest.version + 1
        loads = tuple(ReplicaChange(version, index, ReplicaState.LOAD_REQUESTED) for index in indexes)
        return Placement(server.name, version, indexes, loads, True, partial, memory, scale_up)
    loads = tuple(
        ReplicaChange(latest.version, index, ReplicaState.LOAD_REQUESTED)
        for index in indexes
        if (status := latest.replicas.get(index)) is None or status.state not in HOSTING
    )
    changes = tuple(sorted(loads + _unload_others(latest, indexes), key=lambda c: c.replica))
    return Placement(server.name, latest.version, indexes, changes, False, partial, memory, scale_up)


def _unload_others(version: VersionView, chosen: tuple[int, ...]) -> tuple[ReplicaChange, ...]:
    # Draining replicas keep serving until their replacement is available; they leave with their
    # server replica, or with their version once another is available.
    return tuple(
        ReplicaChange(version.version, index, ReplicaState.UNLOAD_ENVOY_REQUESTED)
        for index, status in sorted(version.replicas.items())
        if index not in chosen
        and status.state not in UNLOADING_OR_UNLOADED
        and status.state is not ReplicaState.DRAINING
    )


def _delete(model: ModelView) -> Placement:
    latest = model.latest
    changes: list[ReplicaChange] = []
    after = dict(latest.replicas)
    for version in model.versions:
        if not _any(version, LIVE):
            continue
        for index, status in sorted(version.replicas.items()):
            if status.state not in UNLOADING_OR_UNLOADED and status.state is not ReplicaState.UNLOAD_FAILED:
                changes.append(ReplicaChange(version.version, index, ReplicaState.UNLOAD_REQUESTED))
                if version is latest:
                    after[index] = ReplicaStatus(ReplicaState.UNLOAD_REQUESTED)
    # What is left of the latest version (no replica of it was live, so nothing went to
    # UnloadRequested above) is unloaded through the routes, as for a scale-down.
    kept = {i: s for i, s in after.items() if s.state is not ReplicaState.UNLOAD_FAILED}
    remaining = VersionView(latest.version, latest.spec, latest.server, kept)
    changes.extend(_unload_others(remaining, ()))
    return Placement(latest.server, latest.version, (), tuple(changes), memory=required_memory(latest))


def _bound(version: VersionView) -> bool:
    return version.server is not None


def _any(version: VersionView, states: frozenset[ReplicaState]) -> bool:
    return any(status.state in states for status in version.replicas.values())


def _capabilities(replica: ReplicaView) -> frozenset[str]:
    return frozenset(capability.strip() for capability in replica.capabilities)
