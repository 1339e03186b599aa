"""Autoscaling decisions (issue 9 item 5): a pure function of the agents' stats, driven by a fake clock."""

from __future__ import annotations

from dataclasses import replace

from modelyard.placement.scaling import Direction, ModelLoad, ScalingMemory, ScalingPolicy, decide

POLICY = ScalingPolicy(lag_threshold=4, scale_up_window=5, inactivity=30, scale_down_cooldown=60)
BUSY = ModelLoad(
    "m", replicas=1, min_replicas=1, max_replicas=3, settled=True, available=1, lag=10, idle_for=0
)
IDLE = replace(BUSY, replicas=3, available=3, lag=0, idle_for=45)


class Clock:
    """Runs `decide` at successive times, carrying its memory like the scheduler's loop does."""

    def __init__(self, memory: ScalingMemory | None = None) -> None:
        self.memory = memory or ScalingMemory()

    def at(self, now: float, *models: ModelLoad) -> list[tuple[str, Direction, int]]:
        decisions, self.memory = decide(models, self.memory, now, POLICY)
        return [(d.name, d.direction, d.replicas) for d in decisions]


def test_lag_above_the_threshold_for_the_window_scales_up_by_one():
    clock = Clock()
    assert clock.at(100, BUSY) == []  # the window starts
    assert clock.at(104, BUSY) == []
    assert clock.at(105, BUSY) == [("m", Direction.UP, 2)]
    two = replace(BUSY, replicas=2, available=2)
    assert clock.at(106, two) == []  # the next one needs a window of its own
    assert clock.at(111, two) == [("m", Direction.UP, 3)]


def test_a_lag_that_drops_in_the_window_starts_it_again():
    clock = Clock()
    clock.at(100, BUSY)
    assert clock.at(103, replace(BUSY, lag=4)) == []  # at the threshold is not above it
    assert clock.at(106, BUSY) == []
    assert clock.at(111, BUSY) == [("m", Direction.UP, 2)]


def test_no_scale_up_past_max_replicas_or_without_a_max_or_while_the_last_one_loads():
    for model in (
        replace(BUSY, replicas=3),  # at max
        replace(BUSY, max_replicas=None, min_replicas=1),  # no max: never up
        replace(BUSY, settled=False),  # the previous scale-up is still loading
        replace(BUSY, replicas=2, available=1),  # ModelAvailable from min_replicas on: not enough
    ):
        clock = Clock()
        clock.at(100, model)
        assert clock.at(200, model) == [], model


def test_models_without_min_or_max_replicas_do_not_autoscale():
    model = replace(BUSY, min_replicas=0, max_replicas=None, replicas=2)
    clock = Clock()
    clock.at(100, model)
    assert clock.at(200, model) == [] and clock.at(300, replace(model, lag=0, idle_for=1000)) == []


def test_inactivity_scales_down_by_one_with_a_cooldown_to_min_replicas():
    clock = Clock()
    assert clock.at(100, replace(IDLE, idle_for=29)) == []
    assert clock.at(101, IDLE) == [("m", Direction.DOWN, 2)]
    assert clock.at(130, replace(IDLE, replicas=2, idle_for=75)) == []  # cooldown
    assert clock.at(161, replace(IDLE, replicas=2, idle_for=106)) == [("m", Direction.DOWN, 1)]
    assert clock.at(500, replace(IDLE, replicas=1, idle_for=500)) == []  # min_replicas


def test_scale_down_stops_at_one_with_min_zero_and_waits_for_a_settled_version():
    model = replace(IDLE, min_replicas=0, replicas=1)
    assert Clock().at(100, model) == []
    assert Clock().at(100, replace(IDLE, settled=False)) == []


def test_a_scale_up_delays_the_next_scale_down_by_the_cooldown():
    clock = Clock()
    clock.at(100, BUSY)
    assert clock.at(105, BUSY) == [("m", Direction.UP, 2)]
    assert clock.at(150, replace(IDLE, replicas=2)) == []
    assert clock.at(165, replace(IDLE, replicas=2)) == [("m", Direction.DOWN, 1)]


def test_no_report_no_decision_and_models_are_independent():
    silent = replace(BUSY, name="s", lag=None, idle_for=None)
    idle = replace(IDLE, name="i")
    clock = Clock()
    assert clock.at(100, BUSY, silent, idle) == [("i", Direction.DOWN, 2)]
    assert clock.at(105, BUSY, silent, replace(idle, replicas=2, available=2)) == [("m", Direction.UP, 2)]


def test_decisions_name_why():
    decisions, _ = decide([IDLE], ScalingMemory(), 0.0, POLICY)
    assert decisions[0].reason == "no request for 45s"
    decisions, _ = decide([BUSY], ScalingMemory(lag_high_since={"m": 0.0}), 6.0, POLICY)
    assert decisions[0].reason == "lag 10 per replica above 4 for 6s"
