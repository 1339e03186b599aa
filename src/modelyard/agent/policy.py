"""Pure rules of the agent: out-of-order command protection and backoff delays.

Time and randomness are arguments (DESIGN.md habit 1), so unit tests need no clock or sleeps.
"""

from __future__ import annotations

import random


class CommandStamps:
    """Seldon's out-of-order protection (compat §7.6): the newest command for a model version wins.

    Each operation is stamped when the stream-reading loop receives it. A command whose stamp is
    strictly older than the last one handled for the same `(name, version)` is dropped silently.
    The caller checks under the model's lock, after an unload's grace period, so an UNLOAD still
    sleeping when a later LOAD of the same version was handled is dropped.

    Differs from Seldon: stamps are a receive counter, not milliseconds since start, so two
    commands received in the same millisecond are still ordered.
    """

    def __init__(self) -> None:
        self._last: dict[tuple[str, int], int] = {}

    def admit(self, name: str, version: int, stamp: int) -> bool:
        """True (and remember `stamp`) unless a newer command for this version was handled."""
        key = (name, version)
        last = self._last.get(key)
        if last is not None and stamp < last:
            return False
        self._last[key] = stamp
        return True


class Backoff:
    """Exponential backoff with full jitter: attempt n (1-based) waits uniform in
    [initial, min(maximum, initial x 2^(n-1))]. The floor keeps a reconnect from spinning when
    the jitter draws 0; `reset()` after a success starts over."""

    def __init__(self, initial: float, maximum: float, rng: random.Random) -> None:
        if initial <= 0 or maximum < initial:
            raise ValueError("backoff needs 0 < initial <= maximum")
        self.initial = initial
        self.maximum = maximum
        self._rng = rng
        self.attempt = 0

    def next_delay(self) -> float:
        self.attempt += 1
        ceiling = min(self.maximum, self.initial * 2 ** min(self.attempt - 1, 62))
        return self._rng.uniform(self.initial, ceiling)

    def reset(self) -> None:
        self.attempt = 0


def retry_delays(attempts: int, initial: float, maximum: float, rng: random.Random) -> list[float]:
    """The waits between `attempts` tries (one fewer than attempts): Seldon retries a load up to
    5 times with exponential backoff (compat §7.4). Differs from Seldon: a count below 1 is an
    error here, not 256 attempts (its unsigned wrap-around)."""
    if attempts < 1:
        raise ValueError("attempts must be >= 1")
    backoff = Backoff(initial, maximum, rng)
    return [backoff.next_delay() for _ in range(attempts - 1)]
