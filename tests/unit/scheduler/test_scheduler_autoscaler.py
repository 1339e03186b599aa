"""Autoscaler: what it makes of the scheduler's state and the agents' reports (issue 9 item 5)."""

from __future__ import annotations

from scheduler_harness import Harness, spec

from modelyard.placement.scaling import Direction, ScalingPolicy
from modelyard.scheduler import AgentEventKind
from modelyard.scheduler.autoscaler import Autoscaler, ModelUsage

POLICY = ScalingPolicy(lag_threshold=4, scale_up_window=0, inactivity=30, scale_down_cooldown=0)


def _two_replicas() -> Harness:
    h = Harness()
    for index in range(3):
        h.connect(index=index)
    return h


def test_a_model_available_from_min_replicas_while_another_replica_loads_is_not_settled():
    h = _two_replicas()
    h.state.apply(spec(memory=100, replicas=2, min_replicas=1, max_replicas=3), 1.0)
    loads = h.take()
    assert len(loads) == 2
    _, server, index, name, version = loads[0]
    h.state.event(server, index, name, version, AgentEventKind.LOADED, now=2.0)
    assert h.model_state("iris") == "ModelAvailable"  # one of two is enough for min_replicas=1
    scaler = Autoscaler(h.state, POLICY, stats_max_age=10)
    for i in range(3):
        scaler.record("mlserver", i, {"iris": ModelUsage(1, 50, 0, 0.0)}, 2.0)
    load = scaler.load_of(h.state.model("iris"), 2.0)
    assert (load.settled, load.available, load.lag) == (False, 1, 50)
    assert scaler.tick(2.0) == []  # no second scale-up while the first is still loading


def test_reports_too_old_or_for_another_version_count_as_none_and_busy_replicas_are_not_idle():
    h = _two_replicas()
    h.state.apply(spec(memory=100, replicas=2, min_replicas=1, max_replicas=3), 1.0)
    h.answer()
    scaler = Autoscaler(h.state, POLICY, stats_max_age=10)
    model = h.state.model("iris")
    placed = sorted(model.latest.replicas)
    scaler.record("mlserver", placed[0], {"iris": ModelUsage(7, 50, 0, 0.0)}, 2.0)  # another version
    scaler.record("mlserver", placed[1], {"iris": ModelUsage(1, 0, 0, 40.0)}, 2.0)
    load = scaler.load_of(model, 5.0)
    assert (load.lag, load.idle_for) == (0, 43.0)  # the report's age counts as idle time too
    assert scaler.load_of(model, 20.0).lag is None  # too old
    scaler.record("mlserver", placed[0], {"iris": ModelUsage(1, 2, 0, 0.0)}, 20.0)
    assert scaler.load_of(model, 20.0).idle_for == 0.0  # requests in flight: not idle


def test_a_decision_is_applied_as_a_replicas_change_in_place():
    h = _two_replicas()
    h.state.apply(spec(memory=100, replicas=1, min_replicas=1, max_replicas=2), 1.0)
    h.answer()
    scaled = []
    scaler = Autoscaler(h.state, POLICY, stats_max_age=10, on_scaled=scaled.append)
    index = next(iter(h.state.model("iris").latest.replicas))
    scaler.record("mlserver", index, {"iris": ModelUsage(1, 9, 1, 0.0)}, 3.0)
    decisions = scaler.tick(3.0)
    assert [(d.direction, d.replicas) for d in decisions] == [(Direction.UP, 2)]
    model = h.state.model("iris")
    assert (model.spec.replicas, model.latest.version) == (2, 1)  # no new version
    assert len(h.take()) == 1 and scaled == decisions  # one more load was sent


def test_a_scale_up_that_could_not_be_placed_is_undone_once_idle():
    h = Harness()
    for index in range(2):
        h.connect(index=index)
    h.state.apply(spec(memory=100, replicas=2, max_replicas=5), 1.0)
    h.answer()
    scaler = Autoscaler(h.state, POLICY, stats_max_age=100)
    h.state.scale("iris", 3, 2.0)  # more replicas than the server has
    h.answer()
    assert h.model_state("iris") == "ScheduleFailed"
    for index in range(2):
        scaler.record("mlserver", index, {"iris": ModelUsage(1, 0, 0, 60.0)}, 3.0)
    load = scaler.load_of(h.state.model("iris"), 3.0)
    assert (load.settled, load.available) == (True, 2)
    assert [(d.direction, d.replicas) for d in scaler.tick(3.0)] == [(Direction.DOWN, 2)]
