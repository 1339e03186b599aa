"""The machinery under `SchedulerState`: placing a model from a snapshot of the state, and settling
after every mutation (statuses, the feed, the "Envoy" promotions, the version cleaner, the
operations for agents), then writing what changed to the store in one transaction.

Nothing leaves the process before its state is written: operations for agents and feed lines are
queued while settling and sent only after the store committed them. When the write fails
(StoreWriteFailed: the database is locked, the disk is full), the change stays in memory and stays
marked unwritten, its operations and feed lines stay queued, and the error propagates (a REST call
answers 500 with the store's message); the next mutation or retry pass writes it and sends them.
So an agent never acts on, and a gateway never routes by, a state a restart would forget. Seldon
keeps no store; its in-memory state is the only state.

Retired versions are pruned: once a version that is not the latest holds nothing on any replica
(Unloaded, LoadFailed, Unknown, or no entry), it is dropped, so a model that moves or is re-applied
many times keeps a bounded history (Seldon keeps every version until the model is deleted). Its
number is never reused (the store keeps each name's highest version, see `_marks`).

There is no Envoy: publishing a model's feed entry is the route update, so right after it, Loaded
replicas of the latest version become Available and UnloadEnvoyRequested ones UnloadRequested
(Seldon does this only for the latest version; here for every version, so that a replica scaled
down just before a new version was applied is not left waiting forever).
"""

from __future__ import annotations

import logging

from modelyard.placement import (
    INACTIVE,
    UNLOADING_OR_UNLOADED,
    ModelState,
    Placement,
    PlacementFailure,
    ReplicaState,
    ReplicaStatus,
    ReplicaView,
    ServerView,
    derive_status,
    plan,
    schedule_failed,
)
from modelyard.scheduler.feed import FeedLine, feed_entry
from modelyard.scheduler.operations import Operation, OperationKind, Publisher, Queued, Sender
from modelyard.scheduler.records import (
    Model,
    Server,
    ServerReplica,
    Version,
    model_to_stored,
    replica_to_stored,
)
from modelyard.scheduler.reservations import Reservations, recount
from modelyard.store import Store, StoreWrite

log = logging.getLogger("modelyard.scheduler")

_S = ReplicaState
_MAX_ROUNDS = 16  # each round only moves replicas forward; a handful always suffices
_PROMOTE = frozenset({_S.LOADED, _S.LOADED_UNAVAILABLE})
# Holds nothing and waits for nothing. Unlike placement's INACTIVE, not UnloadFailed: a replica
# whose unload failed may still hold the model, so its version is neither forgotten nor pruned.
_GONE = frozenset({_S.UNLOADED, _S.UNKNOWN, _S.LOAD_FAILED})


class Reconciler:
    def __init__(self, store: Store, send: Sender, publish: Publisher) -> None:
        self.models: dict[str, Model] = {}
        self.servers: dict[str, Server] = {}
        self.ready = True  # False while restored replicas have not re-subscribed: nothing is placed
        self._store = store
        self._send = send
        self._publish_line = publish
        self._published: dict[str, FeedLine] = {}
        self._touched: dict[str, set[int]] = {}  # model -> versions whose status to recompute
        self._dirty: set[str] = set()  # models to persist and publish
        self._forgotten: set[str] = set()
        self._dirty_replicas: set[tuple[str, int]] = set()
        self._forgotten_replicas: set[tuple[str, int]] = set()
        # name -> highest version it had, for names forgotten (a live model's is its latest)
        self._marks: dict[str, int] = {}
        self._outbox: dict[tuple[str, str, int, str, int], Queued] = {}  # sent after the write
        self._reservations = Reservations()
        self._lines: list[FeedLine] = []  # published after the write

    # --- small mutations ---------------------------------------------------------------------

    def _touch(self, model: Model, version: int) -> None:
        self._touched.setdefault(model.name, set()).add(version)
        self._dirty.add(model.name)
        self._reservations.mark(model.name)

    def _set_replica(self, model: Model, version: int, index: int, status: ReplicaStatus) -> None:
        target = model.version(version)
        if target is None:
            raise ValueError(f"{model.name} has no version {version}")
        before = target.replicas.get(index)
        target.replicas[index] = status
        self._touch(model, version)
        if before is None or before.state is not status.state:
            why = f" ({status.reason})" if status.reason else ""
            log.info(
                "%s v%d on %s-%d: %s -> %s%s",
                model.name,
                version,
                target.server,
                index,
                before.state.value if before is not None else "new",
                status.state.value,
                why,
            )

    def _replica_dirty(self, replica: ServerReplica) -> None:
        self._dirty_replicas.add(replica.key)
        self._forgotten_replicas.discard(replica.key)

    # --- placement -----------------------------------------------------------------------------

    def reservations_recomputed(self) -> dict[tuple[str, int], int]:
        """Every model's reservations summed from scratch (tests compare it with the running sum)."""
        return recount(self.models.values())

    def server_views(self) -> list[ServerView]:
        """Connected replicas with their reservations, summed from LoadRequested/Loading states."""
        reserved = self._reservations.refresh(self.models)
        return [
            ServerView(
                server.name,
                tuple(
                    ReplicaView(
                        r.index,
                        frozenset(r.capabilities),
                        r.available_memory,
                        reserved.get(r.key, 0),
                        r.memory or None,
                        r.draining,
                    )
                    for _, r in sorted(server.replicas.items())
                    if r.connected
                ),
                server.shared,
            )
            for server in self.servers.values()
        ]

    def _place(self, model: Model, now: float) -> None:
        """Plan the model's latest version and apply the plan (nothing while not ready)."""
        if not self.ready:
            return
        result = plan(self.server_views(), model.view())
        latest = model.latest
        if isinstance(result, PlacementFailure):
            latest.status = schedule_failed(latest.replicas, latest.spec, result.reason, now)
            self._touched.get(model.name, set()).discard(latest.version)  # keep it, don't derive it
            if result.unbind:
                # Entries that hold nothing go with the binding; anything still on its way keeps the
                # binding (Seldon unbinds anyway, and the entries then name another server's replicas).
                for index in [i for i, s in latest.replicas.items() if s.state in INACTIVE]:
                    del latest.replicas[index]
                if not latest.replicas:
                    latest.server = None
            self._dirty.add(model.name)
            self._reservations.mark(model.name)
            return
        self._apply(model, result, now)

    def _apply(self, model: Model, placement: Placement, now: float) -> None:
        latest = model.latest
        if placement.new_version:
            model.versions.append(Version(placement.version, latest.spec, server=placement.server))
            self._touch(model, latest.version)  # no longer the latest: its status changes meaning
        target = model.version(placement.version)
        assert target is not None
        rebound = placement.server is not None and target.server != placement.server
        if placement.server is not None:
            target.server = placement.server
        for change in placement.changes:
            self._set_replica(model, change.version, change.replica, ReplicaStatus(change.state, "", now))
        if (
            placement.changes
            or rebound
            or target.status.state in (ModelState.SCHEDULE_FAILED, ModelState.UNKNOWN)
        ):
            self._touch(model, target.version)

    # --- settling --------------------------------------------------------------------------------

    def _settle(self, now: float) -> None:
        for _ in range(_MAX_ROUNDS):
            touched, self._touched = self._touched, {}
            if not touched:
                break
            for name, versions in touched.items():
                model = self.models.get(name)
                if model is None:
                    continue
                for number in versions:
                    self._recompute(model, number)
            for name in touched:
                model = self.models.get(name)
                if model is None:
                    continue
                self._publish(model)
                self._promote(model, now)
                if model.deleted:
                    self._apply(model, _as_placement(plan((), model.view())), now)
                else:
                    self._clean_versions(model, now)
                self._sync(model, now)
                if model.deleted and _terminated(model):
                    self._forget(model)
                else:
                    self._prune(model)
        for name in self._dirty:
            if (model := self.models.get(name)) is not None:
                self._publish(model)

    def _recompute(self, model: Model, number: int) -> None:
        version = model.version(number)
        if version is None:
            return
        last_available = next(
            (v.version for v in reversed(model.versions) if v.status.state is ModelState.AVAILABLE), None
        )
        before = version.status.state
        version.status = derive_status(
            version.replicas,
            version.spec,
            deleted=model.deleted,
            latest=version is model.latest,
            other_version_available=last_available is not None and last_available != number,
        )
        if version.status.state is not before:
            why = f" ({version.status.reason})" if version.status.reason else ""
            log.info("%s v%d: %s -> %s%s", model.name, number, before.value, version.status.state.value, why)

    def _publish(self, model: Model) -> None:
        entry = feed_entry(model, self.servers)
        if self._published.get(model.name) != entry:
            self._published[model.name] = entry
            self._lines.append({"type": "model", **entry})

    def _promote(self, model: Model, now: float) -> None:
        for version in model.versions:
            for index, status in list(version.replicas.items()):
                if status.state is _S.UNLOAD_ENVOY_REQUESTED:
                    self._set_replica(
                        model, version.version, index, ReplicaStatus(_S.UNLOAD_REQUESTED, "", now)
                    )
                elif status.state in _PROMOTE and version is model.latest:
                    self._set_replica(model, version.version, index, ReplicaStatus(_S.AVAILABLE, "", now))

    def _clean_versions(self, model: Model, now: float) -> None:
        """Seldon's version cleaner (compat §6.2 step 5): once the latest version is available, every
        older one unloads. UnloadFailed replicas are left alone (Seldon retries them on every pass,
        which with a replica that keeps failing is a loop through the agent)."""
        if model.latest.status.state is not ModelState.AVAILABLE:
            return
        for version in model.versions[:-1]:
            for index, status in list(version.replicas.items()):
                if status.state not in UNLOADING_OR_UNLOADED and status.state is not _S.UNLOAD_FAILED:
                    self._set_replica(
                        model, version.version, index, ReplicaStatus(_S.UNLOAD_REQUESTED, "", now)
                    )

    def _sync(self, model: Model, now: float) -> None:
        """Queue LOAD for LoadRequested and UNLOAD for UnloadRequested replicas of every version (sent
        once written, `_flush`), each failure recorded on the version it was for (Seldon records an
        unload failure on the latest)."""
        for version in model.versions:
            server = self.servers.get(version.server) if version.server is not None else None
            for index, status in list(version.replicas.items()):
                if status.state is _S.LOAD_REQUESTED:
                    kind, sent, failed = OperationKind.LOAD, _S.LOADING, _S.LOAD_FAILED
                elif status.state is _S.UNLOAD_REQUESTED:
                    kind, sent, failed = OperationKind.UNLOAD, _S.UNLOADING, _S.UNLOAD_FAILED
                else:
                    continue
                replica = server.replicas.get(index) if server is not None else None
                if replica is None or not replica.connected:
                    if not self.ready:
                        continue  # its agent may still re-subscribe
                    new = ReplicaStatus(failed, "the server replica is not connected", now)
                else:
                    op = Operation(kind, replica.server, index, model.name, version.version, version.spec)
                    self._outbox[(kind.value, op.server, index, op.model, op.version)] = Queued(
                        op, sent, failed
                    )
                    new = ReplicaStatus(sent, "", now)
                self._set_replica(model, version.version, index, new)

    def _prune(self, model: Model) -> None:
        """Drop retired versions that hold nothing (see the module docstring)."""
        keep = [v for v in model.versions[:-1] if not all(s.state in _GONE for s in v.replicas.values())]
        if len(keep) < len(model.versions) - 1:
            model.versions[:-1] = keep
            self._dirty.add(model.name)
            self._reservations.mark(model.name)

    def _forget(self, model: Model) -> None:
        del self.models[model.name]
        self._reservations.mark(model.name)
        self._published.pop(model.name, None)
        self._dirty.discard(model.name)
        self._forgotten.add(model.name)
        self._marks[model.name] = max(self._marks.get(model.name, 0), model.latest.version)
        self._lines.append({"type": "removed", "name": model.name})

    def _next_version(self, name: str) -> int:
        """The number a new version of `name` gets: never one it had before, even if forgotten."""
        model = self.models.get(name)
        return max(self._marks.get(name, 0), model.latest.version if model is not None else 0) + 1

    # --- persisting ------------------------------------------------------------------------------

    def _commit(self, now: float) -> None:
        """Settle, write every model and server replica changed since the last successful write in
        one batch, then publish the feed lines and send the operations that write made durable. A
        send that fails changes a replica's state, so that is settled and written in turn.

        A failed write raises StoreWriteFailed and keeps everything unwritten, queued and unsent for
        the next commit (see the module docstring)."""
        for _ in range(_MAX_ROUNDS):
            self._settle(now)
            self._write()
            lines, self._lines = self._lines, []
            for line in lines:
                self._publish_line(line)
            if not self._flush(now):
                return

    def _write(self) -> None:
        batch = StoreWrite(
            models=[model_to_stored(self.models[n]) for n in sorted(self._dirty) if n in self.models],
            forget_models=sorted(self._forgotten - set(self.models)),
            server_replicas=[
                replica_to_stored(self.servers[s].replicas[i], self.servers[s].shared)
                for s, i in sorted(self._dirty_replicas)
                if s in self.servers and i in self.servers[s].replicas
            ],
            forget_server_replicas=sorted(self._forgotten_replicas),
        )
        self._store.write(batch)  # raises with the sets untouched: they are written next time
        self._dirty, self._forgotten = set(), set()
        self._dirty_replicas, self._forgotten_replicas = set(), set()

    def _flush(self, now: float) -> bool:
        """Send the queued operations whose replica is still in the state they were queued for (one
        queued before a failed write may have been overtaken since); True when a send failed."""
        queued, self._outbox = self._outbox, {}
        failed = False
        for item in queued.values():
            op = item.operation
            model = self.models.get(op.model)
            version = model.version(op.version) if model is not None else None
            if model is None or version is None or version.server != op.server:
                continue
            status = version.replicas.get(op.index)
            if status is None or status.state is not item.sent:
                continue
            if (error := self._send(op)) is not None:
                self._set_replica(model, op.version, op.index, ReplicaStatus(item.failed, error, now))
                failed = True
        return failed


def _as_placement(result: Placement | PlacementFailure) -> Placement:
    assert isinstance(result, Placement)  # a deleted model's plan never fails
    return result


def _terminated(model: Model) -> bool:
    return all(s.state in _GONE for v in model.versions for s in v.replicas.values())
