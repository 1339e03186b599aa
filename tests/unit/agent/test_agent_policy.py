"""CommandStamps (out-of-order protection, compat §7.6) and backoff, with a seeded rng."""

from __future__ import annotations

import random

import pytest

from modelyard.agent import Backoff, CommandStamps, retry_delays


def test_a_command_older_than_the_last_handled_one_is_dropped():
    stamps = CommandStamps()
    # UNLOAD received at 1 sleeps its grace; LOAD received at 2 is handled first.
    assert stamps.admit("iris", 1, 2)
    assert not stamps.admit("iris", 1, 1)
    assert stamps.admit("iris", 1, 3)


def test_equal_stamps_and_other_versions_are_independent():
    stamps = CommandStamps()
    assert stamps.admit("iris", 1, 5)
    assert stamps.admit("iris", 1, 5)  # only strictly older is dropped
    assert stamps.admit("iris", 2, 1)  # another version has its own history
    assert stamps.admit("other", 1, 1)


def test_backoff_grows_exponentially_within_its_bounds_and_resets():
    backoff = Backoff(0.1, 10.0, random.Random(7))
    ceilings = [min(10.0, 0.1 * 2**i) for i in range(12)]
    delays = [backoff.next_delay() for _ in range(12)]
    assert all(0.1 <= d <= c for d, c in zip(delays, ceilings, strict=True))
    assert max(delays) <= 10.0
    assert delays[-1] > 0.2  # the ceiling has grown well beyond the first one
    backoff.reset()
    assert backoff.next_delay() == pytest.approx(0.1)


def test_backoff_jitter_depends_on_the_rng_only():
    a = [Backoff(0.1, 10.0, random.Random(1)).next_delay() for _ in range(1)]
    b = [Backoff(0.1, 10.0, random.Random(1)).next_delay() for _ in range(1)]
    assert a == b
    many = Backoff(1.0, 1000.0, random.Random(3))
    draws = [many.next_delay() for _ in range(10)]
    assert len(set(draws)) == 10  # jittered, not a fixed schedule


def test_retry_delays_has_one_wait_between_each_pair_of_attempts():
    assert retry_delays(1, 0.5, 30.0, random.Random(0)) == []
    delays = retry_delays(5, 0.5, 30.0, random.Random(0))
    assert len(delays) == 4
    assert all(0.5 <= d <= 30.0 for d in delays)
    with pytest.raises(ValueError):
        retry_delays(0, 0.5, 30.0, random.Random(0))


def test_backoff_refuses_nonsense_bounds():
    with pytest.raises(ValueError):
        Backoff(0.0, 1.0, random.Random(0))
    with pytest.raises(ValueError):
        Backoff(2.0, 1.0, random.Random(0))
