"""Passive outlier detection (Envoy's, plus latency) and the panic threshold, as pure functions.

The gateway reports each answer with `observe` on the request path and calls `decide` from a timer;
both take the time as an argument, so tests drive them with plain floats. `decide` is the only
place an endpoint is ejected or returned, so the max-ejection-percent cap sees the whole pool.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal, TypeVar

from modelyard.config import OutlierDetectionConfig

T = TypeVar("T")

Reason = Literal["consecutive_5xx", "latency"]

# Latency samples kept per endpoint and window: enough for a stable median, and a bound on the
# tuple `observe` copies when it takes one.
MAX_SAMPLES = 256


@dataclass(slots=True, frozen=True)
class OutlierState:
    """One endpoint's passive-health record.

    `ejections` is Envoy's ejection-time multiplier: it grows with each ejection and decays while
    the endpoint stays in. `healthy_since` is when that decay clock started (the last return, moved
    forward by each decrement). `samples` are (time, latency seconds), oldest first. `adopted`: out
    by another worker's decision (`adopt`), which that worker counts, return included."""

    consecutive_failures: int = 0
    ejections: int = 0
    ejected_until: float | None = None
    healthy_since: float | None = None
    samples: tuple[tuple[float, float], ...] = ()
    adopted: bool = False

    @property
    def ejected(self) -> bool:
        return self.ejected_until is not None


@dataclass(slots=True, frozen=True)
class Ejection:
    name: str
    reason: Reason
    until: float


@dataclass(slots=True, frozen=True)
class Decision:
    """The pool's next states, and what changed, for the caller to apply, log and count.

    `overflow` names endpoints that qualified but were left in by `max_ejection_percent` (Envoy's
    `ejections_overflow`); they keep their counts and are judged again next time."""

    states: Mapping[str, OutlierState]
    ejected: tuple[Ejection, ...] = ()
    returned: tuple[str, ...] = ()
    overflow: tuple[str, ...] = ()


def observe(
    state: OutlierState, *, ok: bool, latency: float | None, now: float, config: OutlierDetectionConfig
) -> OutlierState:
    """The state after one answer. `ok=False` is whatever the caller counts as a failure (a 5xx, a
    refused or reset connection); pass `latency` only when it says something about the endpoint's
    speed (a fast 500 would drag the median down). A latency is sampled when the endpoint's last
    sample is at least `latency_window / MAX_SAMPLES` old."""
    failures = 0 if ok else state.consecutive_failures + 1
    samples = state.samples
    # At most MAX_SAMPLES per window, evenly: under load the samples span the whole window instead
    # of its last few hundred answers, and most answers change nothing (this runs once per answer).
    if latency is not None and (not samples or now - samples[-1][0] >= config.latency_window / MAX_SAMPLES):
        # Samples are in time order: cut the old ones by bisection and slicing, at C speed.
        start = bisect.bisect_left(samples, (now - config.latency_window,))
        kept = samples[max(start, len(samples) - (MAX_SAMPLES - 1)) :]
        samples = kept + ((now, latency),)  # noqa: RUF005 (one copy; unpacking makes two)
    elif failures == state.consecutive_failures:
        return state
    return OutlierState(
        failures, state.ejections, state.ejected_until, state.healthy_since, samples, state.adopted
    )


def decide(states: Mapping[str, OutlierState], now: float, config: OutlierDetectionConfig) -> Decision:
    """Return the endpoints whose ejection is over, decay multipliers, then eject the endpoints with
    `consecutive_5xx` failures in a row or a median latency above `latency_factor` times their
    peers', most failures first (then by name), within `max_ejection_percent` of the pool."""
    if not config.enabled:
        # Turned off (perhaps by a reload): nobody stays out.
        back = {name: _returned(s, now) for name, s in states.items() if s.ejected}
        return Decision({**states, **back}, returned=tuple(sorted(back)))

    current: dict[str, OutlierState] = {}
    returned: list[str] = []
    for name, state in states.items():
        if state.ejected_until is not None and state.ejected_until <= now:
            state = _returned(state, now)
            returned.append(name)
        current[name] = _decayed(state, now, config.base_ejection_time)

    reasons: dict[str, Reason] = {}
    for name, state in current.items():
        if not state.ejected and state.consecutive_failures >= config.consecutive_5xx:
            reasons[name] = "consecutive_5xx"
    for name in _slow(current, now, config):
        reasons.setdefault(name, "latency")

    budget = _max_ejected(len(current), config.max_ejection_percent)
    out = sum(1 for s in current.values() if s.ejected)
    ejected: list[Ejection] = []
    overflow: list[str] = []
    for name in sorted(reasons, key=lambda n: (-current[n].consecutive_failures, n)):
        if out >= budget:
            overflow.append(name)
            continue
        current[name], until = _ejected(current[name], now, config)
        ejected.append(Ejection(name, reasons[name], until))
        out += 1
    return Decision(current, tuple(ejected), tuple(sorted(returned)), tuple(overflow))


def adopt(
    states: Mapping[str, OutlierState],
    name: str,
    until: float,
    ejections: int,
    now: float,
    config: OutlierDetectionConfig,
) -> dict[str, OutlierState] | None:
    """Another worker of the same gateway ejected `name` until `until` (its `ejections` multiplier):
    the states with it out here too, till the same instant; None when nothing changes: detection
    off, the ejection already over, `name` already out at least as long, or `max_ejection_percent`
    of the pool already out here (the cap holds in every worker, as `decide` keeps it)."""
    state = states.get(name)
    if not config.enabled or state is None or until <= now:
        return None
    if state.ejected_until is not None and state.ejected_until >= until:
        return None
    if not state.ejected:
        out = sum(1 for s in states.values() if s.ejected)
        if out >= _max_ejected(len(states), config.max_ejection_percent):
            return None
    adopted = replace(
        state,
        ejections=max(state.ejections, ejections),
        ejected_until=until,
        healthy_since=None,
        adopted=True,
    )
    return {**states, name: adopted}


def routable(healthy: Sequence[T], all_: Sequence[T], panic_threshold_percent: float) -> tuple[list[T], bool]:
    """Envoy's panic mode: when under `panic_threshold_percent` of the pool is available, spread
    load over every endpoint (some requests fail) rather than crush the few left. Returns the
    endpoints to route over and whether the pool is in panic; a threshold of 0 never panics."""
    if not all_:
        return [], False
    if panic_threshold_percent > 0 and len(healthy) * 100 < panic_threshold_percent * len(all_):
        return list(all_), True
    return list(healthy), False


def _returned(state: OutlierState, now: float) -> OutlierState:
    # A fresh start: failures and latency from before the ejection (or in-flight answers that
    # arrived during it) must not eject it again on the next tick. `ejections` stays for backoff.
    return replace(
        state, consecutive_failures=0, ejected_until=None, healthy_since=now, samples=(), adopted=False
    )


def _decayed(state: OutlierState, now: float, base: float) -> OutlierState:
    """Envoy decrements the multiplier once per interval a host stays in; ours is once per
    `base_ejection_time` since the return (or the last decrement), never below 0."""
    if state.ejected or state.ejections == 0 or state.healthy_since is None:
        return state
    steps = state.ejections if base <= 0 else int((now - state.healthy_since) // base)
    if steps <= 0:
        return state
    left = max(0, state.ejections - steps)
    since = None if left == 0 else state.healthy_since + steps * base
    return replace(state, ejections=left, healthy_since=since)


def _ejected(state: OutlierState, now: float, config: OutlierDetectionConfig) -> tuple[OutlierState, float]:
    base = config.base_ejection_time
    cap = max(base, config.max_ejection_time)  # Envoy: max_ejection_time never shortens the base
    # Stop growing the multiplier once it reaches the cap, so decay from the cap takes bounded time.
    limit = max(1, math.ceil(cap / base)) if base > 0 else 1
    ejections = min(state.ejections + 1, limit)
    until = now + min(base * ejections, cap)
    return replace(state, ejections=ejections, ejected_until=until, healthy_since=None, adopted=False), until


def _slow(states: Mapping[str, OutlierState], now: float, config: OutlierDetectionConfig) -> list[str]:
    """Endpoints in the pool whose recent median latency exceeds `latency_factor` times the median
    of the other judged endpoints' medians. Only endpoints in the pool with `latency_min_requests`
    samples in the window are judged or count as peers, and one needs at least one peer."""
    horizon = (now - config.latency_window,)
    medians: dict[str, float] = {}
    for name, state in states.items():
        recent = [latency for _at, latency in state.samples[bisect.bisect_left(state.samples, horizon) :]]
        if not state.ejected and len(recent) >= config.latency_min_requests:
            medians[name] = statistics.median(recent)
    slow: list[str] = []
    for name, median in medians.items():
        peers = [m for other, m in medians.items() if other != name]
        if peers and median > config.latency_factor * statistics.median(peers):
            slow.append(name)
    return slow


def _max_ejected(pool: int, percent: float) -> int:
    """How many of `pool` may be out at once. Newer Envoy ejects one host whatever the percent; we
    allow one only when the pool has a second endpoint to take the traffic and percent > 0."""
    allowed = math.floor(pool * percent / 100 + 1e-9)  # 1e-9: 3 x 33.333...% is 1, not 0.99999
    if percent > 0 and pool >= 2:
        allowed = max(allowed, 1)
    return allowed
