"""Health as a state machine over probe outcomes (Envoy's healthy/unhealthy thresholds)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class HealthThresholds:
    unhealthy_threshold: int = 2
    healthy_threshold: int = 1


@dataclass(slots=True, frozen=True)
class HealthState:
    """`checked` is False until the first probe: an endpoint starts healthy (traffic can flow before
    any check), and the first probe's verdict then counts at once, whatever the thresholds."""

    healthy: bool = True
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    last_error: str = ""
    checked: bool = False


def observe(state: HealthState, ok: bool, limits: HealthThresholds, error: str = "") -> HealthState:
    """The state after one probe: `unhealthy_threshold` failures in a row take an endpoint out,
    `healthy_threshold` successes in a row bring it back."""
    if ok:
        successes = state.consecutive_successes + 1
        healthy = state.healthy or successes >= limits.healthy_threshold or not state.checked
        return HealthState(healthy, 0, successes, "", True)
    failures = state.consecutive_failures + 1
    healthy = state.healthy and failures < limits.unhealthy_threshold and state.checked
    return HealthState(healthy, failures, 0, error, True)


def passed() -> HealthState:
    """The state a passing check gives an endpoint it brings in (or keeps in): healthy, no error."""
    return HealthState(True, 0, 1, "", True)


def ejected(error: str) -> HealthState:
    """A passive failure (the connection was refused mid-request): out until a probe succeeds."""
    return HealthState(False, 1, 0, error, True)
