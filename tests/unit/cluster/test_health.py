"""The health state machine over probe outcomes (Envoy's thresholds)."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from modelyard.cluster import HealthState, HealthThresholds, observe
from modelyard.cluster.health import ejected, passed


def run(outcomes: Iterable[bool], limits: HealthThresholds, state: HealthState | None = None) -> list[bool]:
    """Healthy after each probe, starting from `state` (a fresh, unchecked endpoint by default)."""
    state = state or HealthState()
    seen = []
    for ok in outcomes:
        state = observe(state, ok, limits, "" if ok else "connection refused")
        seen.append(state.healthy)
    return seen


def test_new_endpoint_is_healthy_and_unchecked() -> None:
    state = HealthState()
    assert state.healthy
    assert not state.checked


@pytest.mark.parametrize("unhealthy_threshold", [1, 2, 5])
def test_first_failed_probe_takes_endpoint_out_at_once(unhealthy_threshold: int) -> None:
    limits = HealthThresholds(unhealthy_threshold=unhealthy_threshold)
    state = observe(HealthState(), False, limits, "refused")
    assert not state.healthy
    assert state.checked
    assert state.last_error == "refused"


def test_first_successful_probe_keeps_endpoint_in_whatever_the_threshold() -> None:
    state = observe(HealthState(), True, HealthThresholds(healthy_threshold=5))
    assert state.healthy
    assert state.checked


@pytest.mark.parametrize("threshold", [1, 2, 3])
def test_unhealthy_threshold_failures_in_a_row_take_endpoint_out(threshold: int) -> None:
    limits = HealthThresholds(unhealthy_threshold=threshold)
    seen = run([True] + [False] * threshold, limits)
    assert seen == [True] * threshold + [False]


@pytest.mark.parametrize("threshold", [1, 2, 3])
def test_healthy_threshold_successes_in_a_row_bring_endpoint_back(threshold: int) -> None:
    limits = HealthThresholds(healthy_threshold=threshold)
    seen = run([False] + [True] * threshold, limits)
    assert seen == [False] * threshold + [True]


def test_a_success_resets_the_failure_count() -> None:
    limits = HealthThresholds(unhealthy_threshold=3)
    seen = run([True, False, False, True, False, False], limits)
    assert all(seen)
    assert run([True, False, False, True, False, False, False], limits)[-1] is False


def test_a_failure_resets_the_success_count_while_recovering() -> None:
    limits = HealthThresholds(healthy_threshold=2)
    assert run([False, True, False, True], limits) == [False, False, False, False]
    assert run([False, True, False, True, True], limits)[-1] is True


def test_failures_while_down_keep_it_down() -> None:
    assert run([False, False, False], HealthThresholds()) == [False, False, False]


def test_success_clears_last_error() -> None:
    limits = HealthThresholds()
    state = observe(HealthState(), False, limits, "timed out")
    assert state.last_error == "timed out"
    assert observe(state, True, limits).last_error == ""


def test_ejected_is_unhealthy_until_probes_succeed() -> None:
    state = ejected("connection reset")
    assert not state.healthy
    assert state.checked
    assert state.last_error == "connection reset"
    assert run([True], HealthThresholds(healthy_threshold=1), state) == [True]
    assert run([True, True], HealthThresholds(healthy_threshold=2), state) == [False, True]
    assert run([False], HealthThresholds(), state) == [False]


def test_passed_is_what_a_passing_check_gives() -> None:
    assert passed() == observe(HealthState(), True, HealthThresholds())
    assert passed().last_error == ""
