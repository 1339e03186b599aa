"""Model autoscaling (compat §9), pure: from what the agents report, which models scale up or down.

Inputs, per model (`ModelLoad`): its replica counts, whether its latest version is settled (no
load under way) and how many of its replicas are Available, its *lag*
(requests in flight or waiting at its agents, per replica, averaged over the replicas that report
it) and how long since any replica served a request.
`decide` returns the decisions and the memory the next call needs (since when the lag has been
high, when the model last scaled); time is an argument, so tests need no clock.

Rules (`ScalingPolicy` holds the numbers; the scheduler's config documents the defaults):
- A model autoscales when `min_replicas > 0` or `max_replicas > 0`, as in Seldon.
- **Up** by one when the lag stayed above `lag_threshold` for `scale_up_window` seconds, the latest
  version is settled with every wanted replica Available (a scale-up still loading lands before
  the next one; a model counts as ModelAvailable from `min_replicas` Available replicas on, so its
  state alone is not enough) and `replicas` is below `max_replicas` (no max: no scale-up). The window
  starts again after each scale-up.
- **Down** by one when no replica served a request for `inactivity` seconds, `replicas` is above
  `max(min_replicas, 1)`, the version is settled (even when not all its replicas could be
  placed), and the model last scaled (either way) at least `scale_down_cooldown` seconds ago.

Differs from Seldon: Seldon's agent fires SCALE_UP when its in-flight count reaches the threshold
at a 5 s tick (one sample, then it resets the count) and SCALE_DOWN every tick while idle; the
scheduler only spaces scale-downs by a 60 s stability rule. Here the lag must *stay* high for a
window (one busy tick does not add a replica), a scale-up waits for the previous one to be
Available, and both directions share the cooldown before a scale-down (a replica just added is
not taken away by the next quiet minute).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


class Direction(enum.Enum):
    UP = "up"
    DOWN = "down"


@dataclass(frozen=True)
class ScalingPolicy:
    lag_threshold: float = 30.0
    scale_up_window: float = 5.0
    inactivity: float = 60.0
    scale_down_cooldown: float = 60.0


@dataclass(frozen=True)
class ModelLoad:
    name: str
    replicas: int
    min_replicas: int
    max_replicas: int | None
    settled: bool  # no load of the latest version under way; not deleted
    available: int  # replicas of the latest version that are Available
    lag: float | None  # mean requests in flight or queued per reporting replica; None: no report
    idle_for: float | None  # seconds since any replica served it; None: no report

    @property
    def autoscaled(self) -> bool:
        return self.min_replicas > 0 or bool(self.max_replicas)


@dataclass(frozen=True)
class Decision:
    name: str
    direction: Direction
    replicas: int  # the new count
    reason: str


@dataclass(frozen=True)
class ScalingMemory:
    lag_high_since: Mapping[str, float] = field(default_factory=dict)
    last_scaled: Mapping[str, float] = field(default_factory=dict)


def decide(
    models: Iterable[ModelLoad], memory: ScalingMemory, now: float, policy: ScalingPolicy
) -> tuple[list[Decision], ScalingMemory]:
    decisions: list[Decision] = []
    high_since: dict[str, float] = {}
    last_scaled = dict(memory.last_scaled)
    for model in models:
        if not model.autoscaled:
            continue
        name = model.name
        if model.lag is not None and model.lag > policy.lag_threshold:
            since = memory.lag_high_since.get(name, now)
            high_since[name] = since
            ceiling = model.max_replicas or 0
            complete = model.settled and model.available >= model.replicas
            if now - since >= policy.scale_up_window and complete and model.replicas < ceiling:
                decisions.append(
                    Decision(
                        name,
                        Direction.UP,
                        model.replicas + 1,
                        f"lag {model.lag:g} per replica above {policy.lag_threshold:g} for {now - since:g}s",
                    )
                )
                high_since.pop(name)  # the next scale-up needs a full window of its own
                last_scaled[name] = now
            continue
        floor = max(model.min_replicas, 1)
        if (
            model.idle_for is not None
            and model.idle_for >= policy.inactivity
            and model.replicas > floor
            and model.settled
            and now - last_scaled.get(name, float("-inf")) >= policy.scale_down_cooldown
        ):
            decisions.append(
                Decision(name, Direction.DOWN, model.replicas - 1, f"no request for {model.idle_for:g}s")
            )
            last_scaled[name] = now
    return decisions, ScalingMemory(high_since, last_scaled)
