"""`Autoscaler`: the scheduler's side of model autoscaling (compat §9). Agents report what their
data planes count per model (`AgentStats`, every `stats_interval` seconds); every `interval` the
autoscaler turns the fresh reports into a `ModelLoad` per model, asks the pure policy
(`placement.scaling.decide`) and applies each decision as a replicas-only change of the model's
spec (scaled in place, no new version), which `GET /v1/models/{name}` then shows.

Reports older than `stats_max_age` count as none (an agent that stopped reporting does not keep a
model busy or idle), and a replica's report is dropped when its agent disconnects.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from modelyard.placement import ROUTABLE, ReplicaState
from modelyard.placement.scaling import Decision, ModelLoad, ScalingMemory, ScalingPolicy, decide
from modelyard.scheduler.records import Model
from modelyard.scheduler.state import SchedulerState

log = logging.getLogger("modelyard.scheduler")

# A load on its way: a model with one is not settled (a scale-up lands before the next decision).
_LOADING = frozenset({ReplicaState.LOAD_REQUESTED, ReplicaState.LOADING, ReplicaState.LOADED})


@dataclass(frozen=True)
class ModelUsage:
    """One model at one replica, as its agent's data plane counted it."""

    version: int
    in_flight: int
    queued: int
    idle_seconds: float


class Autoscaler:
    def __init__(
        self,
        state: SchedulerState,
        policy: ScalingPolicy,
        *,
        stats_max_age: float,
        on_scaled: Callable[[Decision], None] = lambda decision: None,
    ) -> None:
        self._state = state
        self.policy = policy
        self._max_age = stats_max_age
        self._on_scaled = on_scaled
        self._reports: dict[tuple[str, int], tuple[float, dict[str, ModelUsage]]] = {}
        self._memory = ScalingMemory()

    def record(self, server: str, index: int, models: dict[str, ModelUsage], now: float) -> None:
        self._reports[(server, index)] = (now, models)

    def forget(self, server: str, index: int) -> None:
        self._reports.pop((server, index), None)

    def _usage(
        self, server: str, index: int, name: str, version: int, now: float
    ) -> tuple[float, ModelUsage] | None:
        report = self._reports.get((server, index))
        if report is None or now - report[0] > self._max_age:
            return None
        usage = report[1].get(name)
        if usage is None or usage.version != version:
            return None
        return report[0], usage

    def load_of(self, model: Model, now: float) -> ModelLoad:
        latest = model.latest
        spec = latest.spec
        lags: list[int] = []
        idle: list[float] = []
        if latest.server is not None:
            for index, status in latest.replicas.items():
                if status.state not in ROUTABLE:
                    continue
                found = self._usage(latest.server, index, model.name, latest.version, now)
                if found is None:
                    continue
                reported_at, usage = found
                lags.append(usage.in_flight + usage.queued)
                idle.append(0.0 if usage.in_flight else usage.idle_seconds + (now - reported_at))
        return ModelLoad(
            model.name,
            replicas=spec.replicas,
            min_replicas=spec.min_replicas,
            max_replicas=spec.max_replicas,
            # Settled: nothing loading, whatever the model's state (a scale-up beyond what could be
            # placed leaves it ScheduleFailed with min_replicas 0, and must still scale back down).
            settled=not model.deleted and not any(s.state in _LOADING for s in latest.replicas.values()),
            available=sum(1 for s in latest.replicas.values() if s.state is ReplicaState.AVAILABLE),
            lag=sum(lags) / len(lags) if lags else None,
            idle_for=min(idle) if idle else None,
        )

    def tick(self, now: float) -> list[Decision]:
        """Decide and apply: the decisions applied, each logged and reported to `on_scaled`."""
        models = [m for m in self._state.models.values() if not m.deleted]
        decisions, self._memory = decide(
            (self.load_of(m, now) for m in models), self._memory, now, self.policy
        )
        applied = []
        for decision in decisions:
            try:
                self._state.scale(decision.name, decision.replicas, now)
            except Exception:  # the model changed meanwhile, or the store failed: next tick decides again
                log.exception("scaling %s to %d replicas", decision.name, decision.replicas)
                continue
            log.info(
                "scaled %s %s to %d replica(s): %s",
                decision.name,
                decision.direction.value,
                decision.replicas,
                decision.reason,
            )
            self._on_scaled(decision)
            applied.append(decision)
        return applied
