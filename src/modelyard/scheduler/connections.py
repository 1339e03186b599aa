"""What agents connecting and disconnecting do to the scheduler's state: reconciling a subscribing
agent's report, losing a replica, the start-up resync, and the retry pass (`Connections`, the base
of `SchedulerState`).

Where it differs from Seldon (compat §7.2, §7.3, §5.5), and why:
- After a restart nothing is placed until every restored replica has re-subscribed or
  `finish_resync` is called (after --resync-timeout); replicas still missing then are removed as
  disconnected. Then every model is settled again, so that an operation decided while its agent was
  away (an old version's unload during a rollout) is sent.
- A re-subscribing agent's report is reconciled with what is recorded on its replica: a version it
  holds that is recorded Loaded/Available stays so (nothing is reloaded); one it does not hold is
  removed (or re-sent, when its load was in flight). A version the scheduler does not know (never
  had, or pruned: version numbers are never reused, see reconcile.py), that belongs to a deleted
  model, or that is bound to another server, is unloaded: with a persistent store an unknown model
  is stale, where Seldon (which forgets everything on restart) adopts it. A known version is adopted
  as Loaded, and, as Seldon's step 5, every reported model is then placed, so that a copy made
  elsewhere while the agent was away is reconciled by placement (the extra replica unloads).
- UnloadFailed replicas of a deleted model or a retired version are not sent UNLOAD again by every
  settle (Seldon's loop through a replica that keeps failing): they keep the agent's reason (the
  version shows ModelTerminateFailed) and are retried by the retry pass (the timer, an agent's
  connect or disconnect); a replica that disconnects, or reconnects without the model, is Unloaded.
- The retry pass backs off a model whose load failed: the n-th retry in a row waits
  retry_interval x 2^n (at most `MAX_BACKOFF`), since each retry makes the agent download it again;
  applying the model again or any agent connecting starts the count again. Seldon retries every
  failed model on every pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from modelyard.placement import LIVE, ModelSpec, ModelState, ReplicaState, ReplicaStatus, should_retry
from modelyard.scheduler.operations import Operation, OperationKind, Publisher, Sender
from modelyard.scheduler.reconcile import Reconciler
from modelyard.scheduler.records import Model, Server, ServerReplica, Version
from modelyard.store import Store

_S = ReplicaState
_IN_FLIGHT = frozenset({_S.LOAD_REQUESTED, _S.LOADING})
REMOVED_WITH_REPLICA = "model is removed when server replica was removed"
MAX_BACKOFF = 600.0  # seconds between retries of a model whose load keeps failing


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


class Connections(Reconciler):
    def __init__(
        self, store: Store, send: Sender, publish: Publisher, *, retry_interval: float = 10.0
    ) -> None:
        super().__init__(store, send, publish)
        self._awaiting: set[tuple[str, int]] = set()
        self._retry_interval = retry_interval
        self._backoff: dict[str, tuple[int, float]] = {}  # model -> (retries in a row, not before)

    @property
    def awaiting(self) -> frozenset[tuple[str, int]]:
        return frozenset(self._awaiting)

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
        to_place = {v.model for v in loaded}  # Seldon's step 5: every reported model
        for model in list(self.models.values()):
            for version in model.versions:
                if version.server == config.server and config.index in version.replicas:
                    held = reported.pop((model.name, version.version), None)
                    if self._reconcile_replica(model, version, config.index, held, now):
                        to_place.add(model.name)
        for held in reported.values():
            self._adopt_or_unload(config, held, now)
        self._awaiting.discard(replica.key)
        self._backoff.clear()  # a new topology: retry every failed model now, as Seldon does
        if not self.ready and not self._awaiting:
            self.ready = True
            self._place_all(now)
        else:
            for name in sorted(to_place):
                placing = self.models.get(name)
                if placing is not None and not placing.deleted:
                    self._place(placing, now)
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
                # Loaded or available stays; an unload on its way goes on, and is sent now if it was
                # decided while this agent was away (settling the model sends it).
                self._touch(model, version.version)
                return False
        elif state is _S.LOADING:
            new = _S.LOAD_REQUESTED  # the load may have been lost with the old stream: send it again
        elif state in (_S.UNLOAD_ENVOY_REQUESTED, _S.UNLOAD_REQUESTED, _S.UNLOADING, _S.UNLOAD_FAILED):
            new = _S.UNLOADED  # not held: whatever unload was pending or failed is done
        elif state in LIVE:
            return self._lose_replica(model, version, index, now)
        else:
            return False
        self._set_replica(model, version.version, index, ReplicaStatus(new, "", now))
        return False

    def _adopt_or_unload(self, config: ReplicaConfig, held: LoadedVersion, now: float) -> None:
        """A reported version not recorded on this replica: adopt it as Loaded when it is a version
        of a live model bound here or nowhere (placement then keeps or unloads it), else unload it."""
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
        # Not queued in the outbox: no recorded state waits for it, so there is nothing to write first.
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

    # --- retries and the start-up resync ---------------------------------------------------------

    def retry(self, now: float) -> None:
        """Place again every model Seldon's retry pass would (should_retry, with the backoff), and
        send UNLOAD again to UnloadFailed replicas of deleted models and retired versions."""
        self._retry(now)
        self._commit(now)

    def _retry(self, now: float) -> None:
        for model in list(self.models.values()):
            for version in model.versions if model.deleted else model.versions[:-1]:
                for index, status in list(version.replicas.items()):
                    if status.state is _S.UNLOAD_FAILED:
                        self._set_replica(
                            model, version.version, index, ReplicaStatus(_S.UNLOAD_REQUESTED, "", now)
                        )
            if model.deleted or not should_retry(model.latest.status, model.latest.spec):
                self._backoff.pop(model.name, None)
                continue
            if any(status.state in _IN_FLIGHT for status in model.latest.replicas.values()):
                # Its loads are on their way: placing it again changes nothing (they count as
                # hosting it) and, over thousands of models loading at once, a pass would hold
                # the event loop for seconds while their agents' answers wait (Seldon retries these
                # only on connect and disconnect, so it never meets this).
                continue
            if model.latest.status.state is ModelState.FAILED:
                retries, not_before = self._backoff.get(model.name, (0, 0.0))
                if now < not_before:
                    continue
                delay = min(self._retry_interval * 2**retries, MAX_BACKOFF)
                self._backoff[model.name] = (retries + 1, now + delay)
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
        # Every model is settled, not only placed: placing changes nothing for a model whose latest
        # version is where it should be, but an older version's unload may be waiting to be sent.
        for model in list(self.models.values()):
            self._touch(model, model.latest.version)
            if not model.deleted:
                self._place(model, now)
