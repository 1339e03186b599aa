"""Outlier detection and the panic threshold, driven by a fake clock (plain floats)."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from modelyard.cluster.outlier import (
    MAX_SAMPLES,
    Decision,
    Ejection,
    OutlierState,
    adopt,
    decide,
    observe,
    routable,
)
from modelyard.config import OutlierDetectionConfig

CONFIG = OutlierDetectionConfig(
    consecutive_5xx=3,
    base_ejection_time=30.0,
    max_ejection_time=300.0,
    max_ejection_percent=100.0,
    latency_min_requests=5,
    latency_window=30.0,
)


def config(**changes: object) -> OutlierDetectionConfig:
    return CONFIG.model_copy(update=changes)


def fail(state: OutlierState, times: int = 1, now: float = 0.0) -> OutlierState:
    for _ in range(times):
        state = observe(state, ok=False, latency=None, now=now, config=CONFIG)
    return state


def timed(
    state: OutlierState, latencies: list[float], now: float, cfg: OutlierDetectionConfig = CONFIG
) -> OutlierState:
    """Answers with these latencies, the last at `now`, each a sampling interval after the one before."""
    gap = cfg.latency_window / MAX_SAMPLES
    for i, latency in enumerate(latencies):
        state = observe(state, ok=True, latency=latency, now=now - (len(latencies) - 1 - i) * gap, config=cfg)
    return state


def names(decision: Decision) -> list[str]:
    return [e.name for e in decision.ejected]


def eject_once(state: OutlierState, now: float, cfg: OutlierDetectionConfig = CONFIG) -> OutlierState:
    """`state` failed `consecutive_5xx` times at `now` and was ejected; returns its new state."""
    pool = {"a": fail(state, cfg.consecutive_5xx, now), "b": OutlierState()}
    decision = decide(pool, now, cfg)
    assert names(decision) == ["a"]
    return decision.states["a"]


# observe


def test_failures_count_and_a_success_resets() -> None:
    state = fail(OutlierState(), 2)
    assert state.consecutive_failures == 2
    state = observe(state, ok=True, latency=None, now=0.0, config=CONFIG)
    assert state.consecutive_failures == 0


def test_latency_samples_are_recorded_bounded_and_aged_out() -> None:
    gap = CONFIG.latency_window / MAX_SAMPLES
    state = OutlierState()
    for i in range(2 * MAX_SAMPLES):  # a sample per interval: the window holds MAX_SAMPLES
        state = observe(state, ok=True, latency=0.1, now=i * gap, config=CONFIG)
    assert MAX_SAMPLES - 1 <= len(state.samples) <= MAX_SAMPLES
    state = timed(state, [0.2], now=200.0)  # everything before now - latency_window is dropped
    assert state.samples == ((200.0, 0.2),)


def test_answers_closer_than_the_sampling_interval_are_sampled_once() -> None:
    gap = CONFIG.latency_window / MAX_SAMPLES
    state = OutlierState()
    for i in range(100):  # 100 answers within one interval
        state = observe(state, ok=True, latency=0.1 + i, now=i * gap / 100, config=CONFIG)
    assert state.samples == ((0.0, 0.1),)
    state = observe(state, ok=True, latency=0.5, now=gap, config=CONFIG)
    assert state.samples == ((0.0, 0.1), (gap, 0.5))


def test_an_answer_that_changes_nothing_keeps_the_state() -> None:
    state = timed(OutlierState(), [0.1], now=0.0)
    assert observe(state, ok=True, latency=0.1, now=0.001, config=CONFIG) is state
    assert observe(state, ok=True, latency=None, now=0.001, config=CONFIG) is state


def test_no_latency_no_sample() -> None:
    assert observe(OutlierState(), ok=False, latency=None, now=0.0, config=CONFIG).samples == ()


# ejection on errors


def test_ejected_after_exactly_consecutive_5xx_failures() -> None:
    pool = {"a": fail(OutlierState(), 2), "b": OutlierState()}
    assert decide(pool, 0.0, CONFIG).ejected == ()
    pool["a"] = fail(pool["a"])
    decision = decide(pool, 0.0, CONFIG)
    assert decision.ejected == (Ejection("a", "consecutive_5xx", 30.0),)
    assert decision.states["a"].ejected
    assert decision.states["a"].ejections == 1
    assert not decision.states["b"].ejected


def test_a_success_in_between_resets_the_count() -> None:
    state = fail(OutlierState(), 2)
    state = observe(state, ok=True, latency=None, now=0.0, config=CONFIG)
    state = fail(state, 2)
    assert decide({"a": state, "b": OutlierState()}, 0.0, CONFIG).ejected == ()


def test_returns_after_base_ejection_time_with_counts_reset() -> None:
    state = eject_once(OutlierState(), now=0.0)
    assert decide({"a": state}, 29.9, CONFIG).returned == ()
    decision = decide({"a": state}, 30.0, CONFIG)
    assert decision.returned == ("a",)
    back = decision.states["a"]
    assert not back.ejected
    assert back.consecutive_failures == 0
    assert back.ejections == 1  # kept, so the next ejection is longer


def test_an_ejected_endpoint_is_not_ejected_again() -> None:
    state = fail(eject_once(OutlierState(), now=0.0), 5)
    assert decide({"a": state, "b": OutlierState()}, 1.0, CONFIG).ejected == ()


def test_second_ejection_lasts_twice_as_long() -> None:
    state = eject_once(OutlierState(), now=0.0)
    state = decide({"a": state}, 30.0, CONFIG).states["a"]
    state = eject_once(state, now=31.0)
    assert state.ejections == 2
    assert state.ejected_until == 31.0 + 60.0


def test_ejection_time_is_capped_by_max_ejection_time() -> None:
    cfg = config(max_ejection_time=70.0)
    state, now, lengths = OutlierState(), 0.0, []
    for _ in range(5):
        state = eject_once(state, now, cfg)
        assert state.ejected_until is not None
        lengths.append(state.ejected_until - now)
        now = state.ejected_until
        state = decide({"a": state}, now, cfg).states["a"]  # returns; no time for decay
    assert lengths == [30.0, 60.0, 70.0, 70.0, 70.0]
    assert state.ejections == 3  # the multiplier stops growing at the cap


def test_multiplier_decays_once_per_base_ejection_time_of_good_health() -> None:
    state = eject_once(OutlierState(), now=0.0)
    state = decide({"a": state}, 30.0, CONFIG).states["a"]
    state = eject_once(state, now=30.0)  # ejections 2, back at 90
    state = decide({"a": state}, 90.0, CONFIG).states["a"]
    assert state.ejections == 2
    assert decide({"a": state}, 119.0, CONFIG).states["a"].ejections == 2
    state = decide({"a": state}, 120.0, CONFIG).states["a"]
    assert state.ejections == 1
    state = decide({"a": state}, 150.0, CONFIG).states["a"]
    assert state.ejections == 0
    assert decide({"a": state}, 1000.0, CONFIG).states["a"].ejections == 0
    assert eject_once(state, now=1000.0).ejected_until == 1030.0  # back to the base time


def test_decay_skips_several_steps_at_once_and_stops_at_zero() -> None:
    state = OutlierState(ejections=2, healthy_since=0.0)
    assert decide({"a": state}, 45.0, CONFIG).states["a"] == OutlierState(ejections=1, healthy_since=30.0)
    assert decide({"a": state}, 500.0, CONFIG).states["a"] == OutlierState()


# max_ejection_percent


@pytest.mark.parametrize(
    ("pool", "percent", "allowed"), [(10, 10.0, 1), (3, 50.0, 1), (10, 35.0, 3), (4, 1.0, 1)]
)
def test_max_ejection_percent_refuses_ejections_beyond_the_cap(
    pool: int, percent: float, allowed: int
) -> None:
    states = {f"e{i}": fail(OutlierState(), 3) for i in range(pool)}
    decision = decide(states, 0.0, config(max_ejection_percent=percent))
    assert len(decision.ejected) == allowed
    assert len(decision.overflow) == pool - allowed
    refused = decision.states[decision.overflow[0]]
    assert not refused.ejected
    assert refused.consecutive_failures == 3  # judged again next time


def test_already_ejected_endpoints_count_against_the_cap() -> None:
    states = {f"e{i}": OutlierState() for i in range(10)}
    states["e0"] = eject_once(OutlierState(), now=0.0)
    states["e1"] = fail(OutlierState(), 3)
    decision = decide(states, 1.0, config(max_ejection_percent=10.0))
    assert decision.ejected == ()
    assert decision.overflow == ("e1",)
    # Once e0 returns, the slot is free in the same decision.
    decision = decide(states, 30.0, config(max_ejection_percent=10.0))
    assert decision.returned == ("e0",)
    assert names(decision) == ["e1"]


def test_zero_percent_or_a_single_endpoint_ejects_nothing() -> None:
    states = {"a": fail(OutlierState(), 3), "b": fail(OutlierState(), 3)}
    assert decide(states, 0.0, config(max_ejection_percent=0.0)).ejected == ()
    assert decide({"a": states["a"]}, 0.0, config(max_ejection_percent=50.0)).ejected == ()


def test_eligible_endpoints_are_ejected_most_failures_first_then_by_name() -> None:
    states = {
        "d": fail(OutlierState(), 3),
        "c": fail(OutlierState(), 4),
        "b": fail(OutlierState(), 3),
        "a": fail(OutlierState(), 3),
        "e": OutlierState(),
    }
    decision = decide(states, 0.0, config(max_ejection_percent=60.0))
    assert names(decision) == ["c", "a", "b"]
    assert decision.overflow == ("d",)


# latency


def latency_pool(slow: float, now: float = 0.0, count: int = 5) -> dict[str, OutlierState]:
    return {
        "a": timed(OutlierState(), [0.9, 1.0, 1.1, 1.0, 1.0], now),
        "b": timed(OutlierState(), [1.0, 1.2, 1.2, 1.2, 0.8], now),
        "slow": timed(OutlierState(), [slow] * count, now),
    }


def test_one_slow_endpoint_among_peers_is_ejected_for_latency() -> None:
    decision = decide(latency_pool(slow=5.0), 1.0, CONFIG)
    assert [(e.name, e.reason) for e in decision.ejected] == [("slow", "latency")]


def test_latency_within_the_factor_is_not_ejected() -> None:
    assert decide(latency_pool(slow=3.0), 1.0, CONFIG).ejected == ()  # 3.0 is not above 3 x 1.0...
    assert decide(latency_pool(slow=3.2), 1.0, CONFIG).ejected == ()  # ...nor 3 x 1.1 (a 1.0, b 1.2)


def test_latency_needs_min_requests() -> None:
    assert decide(latency_pool(slow=5.0, count=4), 1.0, CONFIG).ejected == ()


def test_latency_needs_a_peer_with_enough_samples() -> None:
    pool = latency_pool(slow=5.0)
    pool["a"] = timed(OutlierState(), [1.0] * 4, 0.0)
    pool["b"] = OutlierState()
    assert decide(pool, 1.0, CONFIG).ejected == ()
    assert decide({"slow": pool["slow"]}, 1.0, config(max_ejection_percent=100.0)).ejected == ()


def test_old_latency_samples_are_ignored() -> None:
    pool = latency_pool(slow=5.0, now=0.0)
    pool = {name: timed(state, [1.0] * 5, now=20.0) for name, state in pool.items()}
    assert names(decide(pool, 20.0, CONFIG)) == []  # slow's median over all ten is 3.0: not above 3x
    # At 31 the samples from 0 are out of the window: only the fast ones from 20 are left.
    assert names(decide(pool, 31.0, CONFIG)) == []
    pool["slow"] = timed(OutlierState(), [5.0] * 5, now=0.0)
    assert names(decide(pool, 20.0, CONFIG)) == ["slow"]
    assert names(decide(pool, 31.0, CONFIG)) == []  # too few recent samples to judge


def test_errors_win_over_latency_as_the_reason() -> None:
    pool = latency_pool(slow=5.0)
    pool["slow"] = fail(pool["slow"], 3)
    assert decide(pool, 1.0, CONFIG).ejected[0].reason == "consecutive_5xx"


def test_samples_are_cleared_on_return_so_old_slowness_does_not_re_eject() -> None:
    pool = latency_pool(slow=5.0)
    cfg = config(latency_window=300.0)
    decision = decide(pool, 1.0, cfg)
    assert names(decision) == ["slow"]
    decision = decide(decision.states, 31.0, cfg)
    assert decision.returned == ("slow",)
    assert decision.ejected == ()
    assert decision.states["slow"].samples == ()


# enabled


def test_disabled_ejects_nothing_and_lets_everyone_back() -> None:
    pool: Mapping[str, OutlierState] = latency_pool(slow=5.0) | {"bad": fail(OutlierState(), 10)}
    off = config(enabled=False)
    assert decide(pool, 1.0, off).ejected == ()
    out = {"a": eject_once(OutlierState(), now=0.0), "b": OutlierState()}
    decision = decide(out, 1.0, off)
    assert decision.returned == ("a",)
    assert not decision.states["a"].ejected


# panic threshold


@pytest.mark.parametrize(
    ("healthy", "panic"),
    [(5, False), (10, False), (4, True), (0, True)],
)
def test_panic_below_the_threshold_routes_over_everyone(healthy: int, panic: bool) -> None:
    pool = list(range(10))
    chosen, panicked = routable(pool[:healthy], pool, 50.0)
    assert panicked is panic
    assert chosen == (pool if panic else pool[:healthy])


def test_panic_threshold_zero_disables_panic() -> None:
    assert routable([], ["a", "b"], 0.0) == ([], False)


def test_empty_pool_is_not_panic() -> None:
    assert routable([], [], 50.0) == ([], False)


def test_another_workers_ejection_is_adopted_until_the_same_instant():
    states = {"a": OutlierState(consecutive_failures=1), "b": OutlierState()}
    adopted = adopt(states, "a", until=40.0, ejections=2, now=10.0, config=CONFIG)
    assert adopted is not None
    assert adopted["a"] == OutlierState(consecutive_failures=1, ejections=2, ejected_until=40.0, adopted=True)
    assert adopted["b"] is states["b"]
    assert adopt(adopted, "a", until=35.0, ejections=1, now=10.0, config=CONFIG) is None  # out as long
    longer = adopt(adopted, "a", until=50.0, ejections=1, now=10.0, config=CONFIG)
    assert longer is not None and longer["a"].ejected_until == 50.0 and longer["a"].ejections == 2
    returned = decide(adopted, 40.0, CONFIG)
    assert returned.returned == ("a",) and not returned.states["a"].adopted


@pytest.mark.parametrize(
    ("states", "name", "until", "detection"),
    [
        ({"a": OutlierState()}, "a", 40.0, config(enabled=False)),  # detection off
        ({"a": OutlierState()}, "a", 10.0, CONFIG),  # already over
        ({"a": OutlierState()}, "gone", 40.0, CONFIG),  # not an endpoint here (replaced)
        # one of two out already, with a 50% cap
        (
            {"a": OutlierState(), "b": OutlierState(ejected_until=20.0)},
            "a",
            40.0,
            config(max_ejection_percent=50),
        ),
    ],
)
def test_an_ejection_is_not_adopted_when_the_policy_says_no(states, name, until, detection):
    assert adopt(states, name, until=until, ejections=1, now=10.0, config=detection) is None
