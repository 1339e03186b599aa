"""`LocalState`: what one agent holds on its inference server, and the memory it accounts for.

Pure (DESIGN.md habit 1): no I/O, no clock reads; times are arguments. The agent's operation
handlers change it under the model's lock.

This is Seldon's `LocalStateManager` (compat §7.5, §7.7): the replica's total memory, the overcommit
percent, the memory of every *registered* model (what the scheduler placed here, reported to it as
loaded) and of every *resident* one (in the server's memory now). With overcommit the registered
models may take more than the memory; the excess is kept evicted: registered, its files in the
repository, not in the server. `victims` picks what to evict to make room (least recently used
first, never a model with requests in flight or queued, never one whose lock is held); `reserve`
counts a load's memory once there is room. Requests are counted per model name (`pin`, `queue`),
since a LOAD of another version replaces the record while the server's model of that name serves.

Where it differs from Seldon: a model is held under its own name (the inference server sees
`iris`, not `iris_1`), so at most one version of a model is held; loading another version
replaces the record.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass


class ModelStatus(enum.Enum):
    WAITING = "waiting"  # the scheduler's load waits for room in the server's memory
    LOADING = "loading"  # memory is reserved; the scheduler's load is under way
    LOADED = "loaded"  # in the server's memory and serving
    EVICTING = "evicting"  # being unloaded from the server to make room; stays registered
    EVICTED = "evicted"  # registered (the scheduler counts it loaded), not in the server's memory
    RELOADING = "reloading"  # an evicted model being loaded again for a request
    UNLOADING = "unloading"  # the scheduler's unload is under way; memory is still counted


# Registered: reported to the scheduler as loaded (a request for it is served, reloading if needed).
REGISTERED = frozenset({ModelStatus.LOADED, ModelStatus.EVICTING, ModelStatus.EVICTED, ModelStatus.RELOADING})
# Resident: taking (or about to take) the server's memory.
RESIDENT = frozenset(ModelStatus) - {ModelStatus.EVICTED, ModelStatus.WAITING}


@dataclass
class HeldModel:
    name: str
    version: int
    memory_bytes: int  # per instance x instances, as the scheduler counts it
    status: ModelStatus
    last_used: float  # for the LRU order: when it was loaded, or last served (lazy reload)
    instance_count: int = 0  # runtime info from the server's settings; 0 = not known
    stamp: int = 0  # receive stamp of the last command applied to it
    fetched: bool = False  # the agent put its files in the repository (so it deletes them)
    # While a new version WAITs for room in place of an old one, the server still holds the old
    # one under this name: its bytes stay counted as resident until the new one reserves its own.
    replaced_bytes: int = 0


class LocalState:
    """Per-model records plus the replica's memory: `memory_bytes` of main memory, which the
    scheduler may fill up to `overcommit_percent` beyond (Seldon's `overCommitPercentage`)."""

    def __init__(self, memory_bytes: int, overcommit_percent: int = 0) -> None:
        if memory_bytes < 0 or overcommit_percent < 0:
            raise ValueError("memory_bytes and overcommit_percent must be >= 0")
        self.memory_bytes = memory_bytes
        self.overcommit_percent = overcommit_percent
        self._models: dict[str, HeldModel] = {}
        # Requests per model *name* (a LOAD of another version replaces the record while requests
        # to the server's model of that name go on): sent and not answered, waiting for a reload.
        self._in_flight: dict[str, int] = {}
        self._queued: dict[str, int] = {}

    # Queries ---------------------------------------------------------------------------------

    def get(self, name: str) -> HeldModel | None:
        return self._models.get(name)

    def holds(self, name: str, version: int) -> bool:
        """Whether this exact version is held (in any status)."""
        held = self._models.get(name)
        return held is not None and held.version == version

    def __iter__(self) -> Iterator[HeldModel]:
        return iter(list(self._models.values()))

    def loaded(self) -> list[HeldModel]:
        """Models this replica serves, evicted ones included (a request reloads them), by name:
        what a (re)subscribe reports to the scheduler."""
        return sorted((m for m in self._models.values() if m.status in REGISTERED), key=lambda m: m.name)

    @property
    def registered_bytes(self) -> int:
        """Memory of every registered model (Seldon's `totalMemoryForAllModels`)."""
        return sum(m.memory_bytes for m in self._models.values())

    @property
    def resident_bytes(self) -> int:
        """Memory of models in the server's memory, or reserved for a load under way."""
        return sum(
            m.memory_bytes if m.status in RESIDENT else m.replaced_bytes for m in self._models.values()
        )

    @property
    def main_available_bytes(self) -> int:
        """Main memory not taken by resident models; negative when overcommitted."""
        return self.memory_bytes - self.resident_bytes

    @property
    def overcommit_bytes(self) -> int:
        return self.memory_bytes * self.overcommit_percent // 100

    @property
    def available_bytes(self) -> int:
        """What the agent reports: memory x (1 + P/100) minus every registered model, never < 0.

        Seldon's `GetAvailableMemoryBytesWithOverCommit` (compat §7.5), in integers rather than
        float32, so the table there holds exactly.
        """
        return max(0, self.memory_bytes + self.overcommit_bytes - self.registered_bytes)

    def too_large(self, memory_bytes: int) -> str:
        """Why a model of this size can never load here ("" if it can). With eviction, anything up
        to the main memory fits once others are evicted; beyond it nothing can make room."""
        if memory_bytes > self.memory_bytes:
            return (
                f"model needs {memory_bytes} bytes, more than this replica's memory "
                f"({self.memory_bytes} bytes)"
            )
        return ""

    def lru_order(self) -> list[str]:
        """Loaded models, least recently used first: the eviction order."""
        loaded = [m for m in self._models.values() if m.status is ModelStatus.LOADED]
        return [m.name for m in sorted(loaded, key=lambda m: (m.last_used, m.name))]

    def in_flight(self, name: str) -> int:
        return self._in_flight.get(name, 0)

    def queued(self, name: str) -> int:
        return self._queued.get(name, 0)

    def busy(self, name: str) -> bool:
        """Requests use the model or wait for it: it must not be evicted."""
        return name in self._in_flight or name in self._queued

    def victims(self, needed: int = 0, locked: frozenset[str] | set[str] = frozenset()) -> list[str] | None:
        """The models to evict so that the resident models and `needed` more bytes fit in main
        memory: idle loaded ones (no request in flight or queued, not in `locked`), least
        recently used first, as few as it takes. [] when they fit already; None when evicting
        every idle model would not be enough (then nothing should be evicted: wait for requests
        to finish or loads to end)."""
        short = needed - self.main_available_bytes
        if short <= 0:
            return []
        chosen: list[str] = []
        for name in self.lru_order():
            held = self._models[name]
            if self.busy(name) or name in locked or held.memory_bytes == 0:
                continue
            chosen.append(name)
            short -= held.memory_bytes
            if short <= 0:
                return chosen
        return None

    # Changes ---------------------------------------------------------------------------------

    def begin_load(
        self, name: str, version: int, memory_bytes: int, now: float, stamp: int, *, fetched: bool = False
    ) -> HeldModel | None:
        """Register `version` as WAITING for room (`reserve` makes it LOADING once there is).
        Returns the record it replaced (another version of the same model), which no longer counts."""
        replaced = self._models.pop(name, None)
        held = self._models[name] = HeldModel(
            name, version, memory_bytes, ModelStatus.WAITING, now, stamp=stamp, fetched=fetched
        )
        if replaced is not None and replaced.status in RESIDENT:
            held.replaced_bytes = replaced.memory_bytes
        return replaced if replaced is not None and replaced.version != version else None

    def loaded_ok(self, name: str, version: int, now: float, instance_count: int = 0) -> None:
        held = self._require(name, version)
        held.status = ModelStatus.LOADED
        held.last_used = now
        held.instance_count = instance_count

    def set_fetched(self, name: str, version: int, fetched: bool) -> None:
        """The agent put this version's files in the repository (so an unload deletes them)."""
        self._require(name, version).fetched = fetched

    def begin_unload(self, name: str, version: int) -> None:
        self._require(name, version).status = ModelStatus.UNLOADING

    def unload_failed(self, name: str, version: int) -> None:
        """The server refused to unload: it still holds the model, so it stays counted."""
        self._require(name, version).status = ModelStatus.LOADED

    def begin_evict(self, name: str) -> HeldModel:
        held = self._models[name]
        held.status = ModelStatus.EVICTING
        return held

    def evicted(self, name: str, *, ok: bool) -> None:
        """The eviction's server unload ended: the model is out of memory, or (not `ok`) the
        server still holds it."""
        held = self._models.get(name)
        if held is not None and held.status is ModelStatus.EVICTING:
            held.status = ModelStatus.EVICTED if ok else ModelStatus.LOADED

    def reserve(self, name: str) -> None:
        """Room was made: a WAITING load becomes LOADING, an EVICTED model RELOADING; either way
        its memory counts as resident from now on."""
        held = self._models[name]
        if held.status is ModelStatus.WAITING:
            held.status = ModelStatus.LOADING
            held.replaced_bytes = 0  # the new version's own bytes count from now on
        elif held.status is ModelStatus.EVICTED:
            held.status = ModelStatus.RELOADING
        else:
            raise ValueError(f"{name} is {held.status.value}: nothing to reserve")

    def reloaded(self, name: str, now: float, *, ok: bool) -> None:
        held = self._models.get(name)
        if held is not None and held.status is ModelStatus.RELOADING:
            held.status = ModelStatus.LOADED if ok else ModelStatus.EVICTED
            if ok:
                held.last_used = max(held.last_used, now)

    def restore(self, held: HeldModel) -> None:
        """Put back the record a failed replace took out: the server still serves that version."""
        self._models[held.name] = held

    def forget(self, name: str) -> HeldModel | None:
        """Drop the record (after an unload or a failed load), releasing its memory."""
        return self._models.pop(name, None)

    def pin(self, name: str, now: float) -> None:
        """A request is sent to the server for the model: it is not evicted until `unpin`."""
        self._in_flight[name] = self._in_flight.get(name, 0) + 1
        self.touch(name, now)

    def unpin(self, name: str, now: float) -> bool:
        """The request ended; True when it was the model's last one in flight."""
        left = self._in_flight.get(name, 0) - 1
        if left > 0:
            self._in_flight[name] = left
        else:
            self._in_flight.pop(name, None)
        self.touch(name, now)
        return left <= 0

    def queue(self, name: str) -> None:
        self._queued[name] = self._queued.get(name, 0) + 1

    def unqueue(self, name: str) -> bool:
        """A request stopped waiting; True when it was the model's last one waiting."""
        left = self._queued.get(name, 0) - 1
        if left > 0:
            self._queued[name] = left
        else:
            self._queued.pop(name, None)
        return left <= 0

    def touch(self, name: str, now: float) -> None:
        """A request used the model: it moves to the back of the eviction order."""
        held = self._models.get(name)
        if held is not None:
            held.last_used = max(held.last_used, now)

    def _require(self, name: str, version: int) -> HeldModel:
        held = self._models.get(name)
        if held is None or held.version != version:
            raise KeyError(f"{name} version {version} is not held")
        return held
