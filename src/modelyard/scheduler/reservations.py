"""Memory reserved on each server replica by loads in flight (a version in LoadRequested or Loading
there needs its `required_memory` before its agent reports the memory as used).

Summed from the replica states rather than kept as a counter, so it cannot leak (compat §5.4), but
not summed over every model per decision: that made placing N models O(N^2) (benchmarks/
placement.py). Each model's share is kept, and refreshed only for models marked changed since the
last refresh; every mutation of a model marks it (the scheduler's `_touch`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from modelyard.placement import ReplicaState, required_memory
from modelyard.scheduler.records import Model

Key = tuple[str, int]  # (server, replica index)
_RESERVING = frozenset({ReplicaState.LOAD_REQUESTED, ReplicaState.LOADING})


class Reservations:
    def __init__(self) -> None:
        self._total: dict[Key, int] = {}
        self._by_model: dict[str, dict[Key, int]] = {}
        self._stale: set[str] = set()

    def mark(self, name: str) -> None:
        """The model changed (or is gone): its share is summed again at the next refresh."""
        self._stale.add(name)

    def refresh(self, models: Mapping[str, Model]) -> Mapping[Key, int]:
        """The reservations per replica, with every marked model's share summed again."""
        for name in self._stale:
            for key, need in self._by_model.pop(name, {}).items():
                left = self._total[key] - need
                if left:
                    self._total[key] = left
                else:
                    del self._total[key]
            model = models.get(name)
            mine = reserved_by(model) if model is not None else {}
            if mine:
                self._by_model[name] = mine
                for key, need in mine.items():
                    self._total[key] = self._total.get(key, 0) + need
        self._stale.clear()
        return self._total


def reserved_by(model: Model) -> dict[Key, int]:
    """What the model's loads in flight reserve on each replica."""
    mine: dict[Key, int] = {}
    for version in model.versions:
        if version.server is None:
            continue
        reserving = [index for index, status in version.replicas.items() if status.state in _RESERVING]
        if reserving:
            need = required_memory(version.view())
            for index in reserving:
                key = (version.server, index)
                mine[key] = mine.get(key, 0) + need
    return mine


def recount(models: Iterable[Model]) -> dict[Key, int]:
    """Every model's reservations summed from scratch."""
    total: dict[Key, int] = {}
    for model in models:
        for key, need in reserved_by(model).items():
            total[key] = total.get(key, 0) + need
    return total
